"""TP 2 and TP 4: the shared suite and the port checks rerun under ``torchrun`` (gloo, float32), one pytest per
rank, with the same ``--backend neuron-cpu``. This process only launches and reads what the ranks report.

One ``torchrun`` per TP degree runs every file of ``SUITE`` selected in this session (``-k port_cpu`` launches that
file alone); starting the ranks (torch, NxDI and collection) is most of a small file's time. Each file still starts
without a process group, as in a process of its own: the neuron-cpu plugin leaves the group after each file (NxDI's
``to_cpu()`` initialises it afresh). Every (TP, file) stays a test of its own, graded from the per-rank outcome files
the plugin writes (``NEURON_CPU_REPORT_DIR``): on every rank the file ran tests that passed, and none failed."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test.support.neuron import result_cache
from test.support.neuron.cpu_plugin import free_port

pytestmark = pytest.mark.neuron_cpu
ROOT = Path(__file__).resolve().parents[2]
SUITE = ["test/integration/test_backend_suite.py", "test/neuron_cpu/test_harness_llama.py",
         "test/neuron_cpu/test_port_cpu.py", "test/neuron_cpu/test_vocab_padding.py",
         "test/neuron_cpu/test_continuous_batching.py", "test/neuron_cpu/test_sharded_caches.py",
         "test/neuron_cpu/test_chunked_prefill.py", "test/neuron_cpu/test_speculative_port.py",
         "test/neuron_cpu/test_fused_speculation.py", "test/neuron_cpu/test_decode_experts_tp.py"]
TPS = (2, 4)
# files run at fewer degrees (the targets: TP 1 and 2; CI time): the speculative paths at TP 2
ONLY = {"test/neuron_cpu/test_speculative_port.py": (2,), "test/neuron_cpu/test_fused_speculation.py": (2,)}
CASES = [(tp, path) for tp in TPS for path in SUITE if tp in ONLY.get(path, TPS)]
TIMEOUT_S = int(os.environ.get("NEURON_CPU_TORCHRUN_TIMEOUT", "3600"))


def _launch(tp: int, paths: list[str], where: Path) -> dict:
    """One ``torchrun`` of ``paths`` at ``tp``: its exit code, console tail and each rank's outcomes.

    The launch is a pure function of the test tree, the package, the NxDI/NxD sources and the library versions: a
    launch that exited 0 is kept in the suites' result cache under a key hashing all of them
    (``test.support.neuron.result_cache``; ``MINIMAX_M3_TRACE_CACHE=off`` launches every time), and the same tree
    tested again on this machine reads its per-rank outcome files and logs from there. Any edit reruns it."""
    reports = where / "reports"
    logs = where / "rank-logs"  # one stdout per rank: interleaved console output cannot be counted reliably

    def launch() -> str:
        reports.mkdir(parents=True)
        env = dict(os.environ, NEURON_CPU_BASETEMP=str(where / "tmp"), NEURON_CPU_REPORT_DIR=str(reports),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}",
               f"--master-port={free_port()}", f"--log-dir={logs}", "--redirects=3", "-m", "pytest", "-q",
               "-p", "no:cacheprovider", "-p", "test.support.neuron.cpu_plugin", "--backend", "neuron-cpu", *paths]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        shutil.rmtree(where / "tmp", ignore_errors=True)  # the ranks' scratch checkpoints: not an output
        return json.dumps({"rc": proc.returncode, "console": proc.stdout + proc.stderr})

    ran = json.loads(result_cache.cached("test.neuron_cpu.torchrun", [str(tp), *paths],
                                         [ROOT / "test", ROOT / "pyproject.toml"], where, launch,
                                         keep=lambda stdout: json.loads(stdout)["rc"] == 0))
    rank_out = sorted(logs.glob("**/stdout.log"))
    text = "\n".join(f.read_text() for f in rank_out)
    outcomes = {}  # rank -> [(nodeid, phase, outcome)]
    for f in sorted(reports.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        outcomes[int(f.stem.removeprefix("rank"))] = [(r["nodeid"], r["when"], r["outcome"]) for r in rows]
    return {"rc": ran["rc"], "rank_out": rank_out, "outcomes": outcomes, "paths": paths,
            "tail": "\n".join((ran["console"] + text).splitlines()[-60:])}


@pytest.fixture(scope="module")
def torchrun_at(request, tmp_path_factory):
    """``torchrun_at(tp)``: the one launch at ``tp`` over the SUITE files this session selected, run on first use."""
    runs = {}

    def get(tp: int) -> dict:
        if tp not in runs:
            chosen = {item.callspec.params["path"] for item in request.session.items
                      if item.originalname == "test_suite_under_torchrun" and item.callspec.params["tp"] == tp}
            runs[tp] = _launch(tp, [p for p in SUITE if p in chosen], tmp_path_factory.mktemp(f"torchrun-tp{tp}"))
        return runs[tp]

    return get


def _problems(outcomes: list, path: str) -> tuple[int, list]:
    """(passed tests, failed or errored phases) of ``path`` in one rank's outcomes."""
    mine = [o for o in outcomes if o[0].split("::")[0] == path]
    passed = sum(1 for _, when, outcome in mine if when == "call" and outcome == "passed")
    return passed, [o for o in mine if o[2] == "failed"]


@pytest.mark.parametrize("tp, path", CASES)
def test_suite_under_torchrun(tp, path, torchrun_at):
    if "WORLD_SIZE" in os.environ:
        pytest.skip("already running under torchrun")
    run = torchrun_at(tp)
    tail = run["tail"]
    assert len(run["rank_out"]) == tp, f"expected one stdout log per rank, found {len(run['rank_out'])}:\n{tail}"
    assert sorted(run["outcomes"]) == list(range(tp)), f"outcome files of ranks {sorted(run['outcomes'])}:\n{tail}"
    for rank, outcomes in sorted(run["outcomes"].items()):
        passed, failed = _problems(outcomes, path)
        assert not failed, f"torchrun tp={tp} rank {rank}: {path} failed {failed}:\n{tail}"
        # every rank ran tests of this file (not only skips)
        assert passed > 0, f"torchrun tp={tp} rank {rank}: no test of {path} passed:\n{tail}"
    for f in run["rank_out"]:  # each rank's pytest reached its summary
        assert re.findall(r"\b(\d+) passed\b", f.read_text()), f"rank log {f} has no summary:\n{f.read_text()[-2000:]}"
    if run["rc"] != 0:  # a non-zero exit that no file's failures explain fails every file of the launch
        explained = any(_problems(o, p)[1] for o in run["outcomes"].values() for p in run["paths"])
        assert explained, f"torchrun tp={tp} exited {run['rc']} with every file passing:\n{tail}"
