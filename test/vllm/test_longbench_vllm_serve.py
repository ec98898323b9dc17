"""LongBench through ``vllm serve`` (``minimax-m3 longbench --server``), off-device: the tiny synthetic checkpoint
served by vLLM 0.13 + vllm-neuron 0.4.1 in NxDI's CPU mode, the samples and prompt table of the project's
LongBench end-to-end test (hotpotqa, truncated to 200 tokens; trec, no chat template).

Oracle: the project's runner with the reference backend (float32, CPU) on the same checkpoint and samples, greedy:
every prediction (text, generated ids, finish reason, prompt length) and the report's scores must be equal; both
reports come from the same metrics code (``eval.report``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import vllm_missing
from .test_vllm_smoke import model, vllm_serve  # noqa: F401  (module fixture)

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 256
BUCKETS = {"context_encoding_buckets": [64, 128, 256], "token_generation_buckets": [256]}
TASKS = "hotpotqa,trec"


@pytest.fixture(scope="module")
def longbench(tmp_path_factory):
    from test.integration.test_longbench_e2e import MAXLEN, PROMPTS, rows

    root = tmp_path_factory.mktemp("lb") / "LongBench"
    (root / "config").mkdir(parents=True)
    (root / "config" / "dataset2prompt.json").write_text(json.dumps(PROMPTS))
    (root / "config" / "dataset2maxlen.json").write_text(json.dumps(MAXLEN))
    (root / "data").mkdir()
    for task in PROMPTS:
        (root / "data" / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(task)))
    return root


def _preds(out: Path) -> dict:
    keys = ("pred", "gen_tokens", "finish_reason", "prompt_tokens", "truncated")
    return {t: [{k: r[k] for k in keys} for r in map(json.loads, (out / "pred" / f"{t}.jsonl").read_text()
                                                        .splitlines())] for t in TASKS.split(",")}


def test_longbench_through_the_server_equals_the_reference_runner(model, longbench, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    from minimax_m3.load import load_engine
    from minimax_m3.eval.runner import run_longbench

    ref = load_engine(model, backend="reference", device="cpu", dtype="float32", max_seq_len=MAX_LEN)
    want = run_longbench(ref, AutoTokenizer.from_pretrained(model), longbench / "data", longbench, TASKS,
                         tmp_path / "ref", batch_size=2, max_input_tokens=200, progress=False)
    with vllm_serve(model, tmp_path / "serve.log", MAX_LEN, BUCKETS) as port:
        proc = subprocess.run(
            [sys.executable, "-m", "minimax_m3.cli", "longbench", "--server", f"http://127.0.0.1:{port}/v1",
             "--served-model", "m3-tiny", "--model", model, "--data", str(longbench / "data"), "--longbench-dir",
             str(longbench), "--tasks", TASKS, "--out", str(tmp_path / "srv"), "--batch-size", "2",
             "--max-input-tokens", "200", "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "srv" / "report.json").read_text())
    assert _preds(tmp_path / "srv") == _preds(tmp_path / "ref")
    preds = _preds(tmp_path / "srv")
    assert [len(preds[t]) for t in TASKS.split(",")] == [3, 2] and all(r["gen_tokens"] >= 1 for v in preds.values()
                                                                        for r in v)
    assert all(r["truncated"] for r in preds["hotpotqa"])  # middle truncation to 200 ids, on the client
    assert got["tasks"] == want["tasks"]
    assert got["meta"]["backend"] == "server" and got["meta"]["server"].endswith("/v1")
