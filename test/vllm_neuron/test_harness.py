"""The off-device harness of the vLLM Neuron 1.x model contract (``test/support/vllm_neuron``), tested with its toy
model: real, unmodified vLLM 0.24 (scheduler with chunked prefill and prefix caching, sampler) drives the contract's
forward calls on CPU, and the greedy tokens must equal the toy's dense oracle (the same weights, no pages, every
token recomputed from scratch). The trace (``M3_VNEURON_TRACE``) shows what each forward got.

Each engine runs in a process of its own (``test/support/vllm_neuron/drive.py``): vLLM picks its platform once per
process. ``scripts/test_vllm_neuron_offdevice.sh`` builds the environment (.venv-vneuron)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test_vllm_neuron_offdevice.sh builds it)")
pytest.importorskip("m3_vneuron_harness", reason="the harness plugin is not installed (test/support/vllm_neuron)")

import torch  # noqa: E402

from test.support.vllm_neuron.toy_model import dense_greedy, load_dense, write_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODELS = "test.support.vllm_neuron.toy_model:MODELS"
BLOCK = 16


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("toy") / "m3-toy", seed=0)
    return path, load_dense(path)


@pytest.fixture(scope="module")
def toy_index(tmp_path_factory):
    """The toy with index keys: a second LayerSpec per layer, one head of 16 (the main layers: two heads of 8)."""
    path = write_checkpoint(tmp_path_factory.mktemp("toy-index") / "m3-toy-index", seed=1, index_head_size=16)
    return path, load_dense(path)


def drive(tmp: Path, model: Path, engine: dict, requests: list[dict], env: dict | None = None) -> tuple[dict, list]:
    """One vllm.LLM on the harness in a fresh process; returns (driver output, trace records)."""
    trace = tmp / "trace.jsonl"
    spec = {"model": str(model), "engine": engine, "requests": requests,
            "env": {"M3_VNEURON_MODELS": MODELS, "M3_VNEURON_TRACE": str(trace), **(env or {})}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "test.support.vllm_neuron.drive", str(tmp / "spec.json"),
                           str(tmp / "out.json")], cwd=REPO, env=run_env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    out = json.loads((tmp / "out.json").read_text())
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return out, records


def ext(req_id: str) -> str:
    """vLLM 0.24 suffixes the request id the engine core sees ("<id>-<8 hex>")."""
    return req_id.rsplit("-", 1)[0]


def forwards_of(records: list, rid: str, kind: str | None = None) -> list[dict]:
    return [r for r in records if r["event"] == "forward" and rid in map(ext, r["req_ids"])
            and (kind is None or r["kind"] == kind)]


def assert_oracle(out: dict, requests: list[dict], dense) -> None:
    for r in requests:
        assert out["tokens"][r["id"]] == dense_greedy(dense, r["prompt"], r["max_tokens"]), r["id"]


SEGMENTED = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=2 * BLOCK, block_size=BLOCK,
                 enable_prefix_caching=True, enable_chunked_prefill=True, num_gpu_blocks_override=96)


def segmented_requests() -> list[dict]:
    long, a = _ids(100, 1), _ids(40, 2)
    return [
        {"id": "long", "prompt": long, "max_tokens": 8, "arrive": 0},
        {"id": "a", "prompt": a, "max_tokens": 6, "arrive": 0},
        # arrive while long and a decode; b shares a's first two blocks, d long's first four
        {"id": "b", "prompt": a[:32] + _ids(12, 3), "max_tokens": 5, "arrive": 8},
        {"id": "c", "prompt": _ids(5, 4), "max_tokens": 5, "arrive": 8},
        {"id": "d", "prompt": long[:64] + _ids(3, 5), "max_tokens": 4, "arrive": 11},
    ]


@pytest.fixture(scope="module")
def segmented(toy_index, tmp_path_factory):
    path, dense = toy_index
    requests = segmented_requests()
    out, records = drive(tmp_path_factory.mktemp("segmented"), path, SEGMENTED, requests)
    return requests, out, records, dense


def test_greedy_tokens_equal_the_dense_oracle(segmented):
    requests, out, _, dense = segmented
    assert_oracle(out, requests, dense)


def test_index_key_specs_share_the_kv_cache_group(segmented):
    """LayerSpecs of other head sizes (the index keys, 1 x 16) join the main layers (2 x 8) in one vLLM KV cache group
    (UniformTypeKVCacheSpecs): one block table and one set of block ids for all, per-layer cache shapes
    [num_blocks, heads, block_size, head_size]; the block table 256/16 = 16 blocks wide."""
    _, _, records, _ = segmented
    (kv,) = [r for r in records if r["event"] == "kv_cache"]
    (group,) = kv["groups"]
    assert group["spec"] == "UniformTypeKVCacheSpecs" and group["block_table_width"] == 16
    n = kv["num_blocks"]
    assert group["layers"] == {"layers.0.self_attn": [n, 2, BLOCK, 8], "layers.1.self_attn": [n, 2, BLOCK, 8],
                               "layers.0.self_attn.indexer": [n, 1, BLOCK, 16],
                               "layers.1.self_attn.indexer": [n, 1, BLOCK, 16]}


def test_a_prompt_longer_than_the_token_budget_is_prefilled_over_several_steps(segmented):
    """max_num_batched_tokens = two blocks (32): the 100-token prompt runs as one-request prefill forwards of at most
    32 tokens, each padded to the one token bucket (32), each continuing where the last stopped (cached_seq_len)."""
    _, _, records, _ = segmented
    pre = forwards_of(records, "long", "prefill")
    assert len(pre) >= 4 and len({r["step"] for r in pre}) == len(pre)
    assert sum(r["num_tokens"][0] for r in pre) == 100
    pos = 0
    for r in pre:
        assert r["req_ids"] == [r["req_ids"][0]] and r["input_ids_shape"] == [32] and r["max_query_len"] == 32
        assert r["first_positions"] == [pos] and r["cached_seq_len"] == pos and r["kv_segment_size"] == 32
        pos += r["num_tokens"][0]


def test_a_prefix_cache_hit_runs_only_the_new_tokens(segmented):
    """b = a's first 32 tokens (two full blocks) + 12: vLLM's prefix cache serves the 32, the model runs 12 (from
    position 32); d = long's first 64 + 3: it runs 3."""
    _, out, records, _ = segmented
    for rid, hit, new in (("b", 32, 12), ("d", 64, 3)):
        pre = forwards_of(records, rid, "prefill")
        assert [r["first_positions"][0] for r in pre][:1] == [hit], rid
        assert sum(r["num_tokens"][0] for r in pre) == new, rid
        assert pre[0]["cached_seq_len"] == hit, rid
        decoded = sum(1 for r in forwards_of(records, rid, "decode"))
        assert decoded == len(out["tokens"][rid]) - 1, rid


def test_requests_arriving_while_others_decode(segmented):
    """One scheduler step runs a padded decode batch and then each new request's prefill forward, one request per
    forward (never mixed): b and c arrive together while long and a decode."""
    _, _, records, _ = segmented
    by_step = defaultdict(list)
    for r in records:
        if r["event"] == "forward":
            by_step[r["step"]].append(r)
    mixed = [fw for fw in by_step.values()
             if fw[0]["kind"] == "decode" and len(fw[0]["req_ids"]) >= 2 and len(fw) >= 3]
    assert mixed, "no step with a decode batch and two prefills"
    fw = mixed[0]
    assert {ext(r["req_ids"][0]) for r in fw[1:]} >= {"b", "c"}
    assert all(r["kind"] == "prefill" and len(r["req_ids"]) == 1 for r in fw[1:])
    for r in records:
        if r["event"] == "forward" and r["kind"] == "decode":  # batch buckets 1, 2, 4
            n = len(r["req_ids"])
            assert r["input_ids_shape"] == [{1: 1, 2: 2, 3: 4, 4: 4}[n]] and r["max_query_len"] == 1
            assert r["block_table_shape"] == [r["input_ids_shape"][0], 16]


def test_tokens_are_reported_at_the_step_that_sampled_them(segmented):
    """The trace's sampled tokens (runner steps) and the driver's (engine steps) agree, one token per step."""
    _, out, records, _ = segmented
    sampled = defaultdict(list)
    for r in records:
        if r["event"] == "sampled":
            for rid, toks in r["tokens"].items():
                sampled[ext(rid)] += [(r["step"], t) for t in toks]
    for rid, toks in out["tokens"].items():
        assert [t for _, t in sampled[rid]] == toks, rid
        steps = [s for s, _ in sampled[rid]]
        assert steps == sorted(set(steps)), rid


def test_single_shot_prefill_and_a_preempted_request(toy, tmp_path):
    """max_num_batched_tokens = max_model_len: no segmented prefill (kv_segment_size 0), the token buckets powers of
    two from 128 (here [128]); each prompt one forward. 8 usable blocks of 16 hold two 60-token prompts but not their
    64th tokens: vLLM preempts one, and its recompute is one prefill forward of prompt + the tokens it had."""
    path, dense = toy
    engine = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128, block_size=BLOCK,
                  enable_prefix_caching=False, num_gpu_blocks_override=9)
    requests = [{"id": "x", "prompt": _ids(60, 1), "max_tokens": 12, "arrive": 0},
                {"id": "y", "prompt": _ids(58, 2), "max_tokens": 12, "arrive": 0},
                {"id": "z", "prompt": _ids(9, 3), "max_tokens": 6, "arrive": 3}]
    out, records = drive(tmp_path, path, engine, requests)
    assert_oracle(out, requests, dense)
    recomputed = []
    for r in requests:
        pre = forwards_of(records, r["id"], "prefill")
        assert pre[0]["num_tokens"] == [len(r["prompt"])] and pre[0]["first_positions"] == [0]
        for p in pre:
            assert p["kv_segment_size"] == 0 and p["input_ids_shape"] == [128] and p["block_table_shape"] == [1, 8]
        recomputed += [(r["id"], p["num_tokens"][0] - len(r["prompt"])) for p in pre[1:]]
    assert recomputed and all(n > 0 for _, n in recomputed), recomputed


def test_compiled_buckets_cover_every_forward(toy, tmp_path):
    """M3_VNEURON_COMPILE=aot_eager: torch.compile(fullgraph) of the model, every bucket warmed as the plugin warms
    them, then any recompile is an error: every forward of a run with chunked prefill, a prefix hit and a padded
    decode batch has a warmed shape."""
    path, dense = toy
    long = _ids(50, 20)
    requests = [{"id": "p", "prompt": long, "max_tokens": 4, "arrive": 0},
                {"id": "q", "prompt": long[:32] + _ids(4, 21), "max_tokens": 4, "arrive": 3},
                {"id": "s", "prompt": _ids(7, 22), "max_tokens": 3, "arrive": 3}]
    out, records = drive(tmp_path, path, SEGMENTED, requests, env={"M3_VNEURON_COMPILE": "aot_eager"})
    assert_oracle(out, requests, dense)
    assert {r["input_ids_shape"][0] for r in records if r["event"] == "forward"} <= {32, 1, 2, 4}
