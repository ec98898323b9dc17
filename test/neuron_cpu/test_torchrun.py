"""TP 2 and TP 4: the shared suite and the port checks rerun under ``torchrun`` (gloo, float32), one pytest per
rank, with the same ``--backend neuron-cpu``. This process only launches and reads the exit code.

One torchrun per test file: under torchrun NxDI's ``to_cpu()`` initialises the default process group every time,
so each process builds exactly one NxDI model."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test.support.neuron.cpu_plugin import free_port

pytestmark = pytest.mark.neuron_cpu
ROOT = Path(__file__).resolve().parents[2]
SUITE = ["test/integration/test_backend_suite.py", "test/neuron_cpu/test_harness_llama.py",
         "test/neuron_cpu/test_port_cpu.py", "test/neuron_cpu/test_vocab_padding.py",
         "test/neuron_cpu/test_continuous_batching.py", "test/neuron_cpu/test_sharded_caches.py",
         "test/neuron_cpu/test_chunked_prefill.py"]
TIMEOUT_S = int(os.environ.get("NEURON_CPU_TORCHRUN_TIMEOUT", "3600"))


@pytest.mark.parametrize("path", SUITE)
@pytest.mark.parametrize("tp", [2, 4])
def test_suite_under_torchrun(tp, path, tmp_path):
    if "WORLD_SIZE" in os.environ:
        pytest.skip("already running under torchrun")
    env = dict(os.environ, NEURON_CPU_BASETEMP=str(tmp_path), OMP_NUM_THREADS="1")
    logs = tmp_path / "rank-logs"  # one stdout per rank: interleaved console output cannot be counted reliably
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", f"--master-port={free_port()}",
           f"--log-dir={logs}", "--redirects=3", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-p", "test.support.neuron.cpu_plugin", "--backend", "neuron-cpu", path]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    rank_out = sorted(logs.glob("**/stdout.log"))
    text = "\n".join(f.read_text() for f in rank_out)
    tail = "\n".join((proc.stdout + proc.stderr + text).splitlines()[-40:])
    assert proc.returncode == 0, f"torchrun tp={tp} {path} failed (rc {proc.returncode}):\n{tail}"
    # every rank ran tests (not only skips); failures already show in the exit code
    assert len(rank_out) == tp, f"expected one stdout log per rank, found {len(rank_out)}:\n{tail}"
    for f in rank_out:
        passed = re.findall(r"\b(\d+) passed\b", f.read_text())
        assert passed and int(passed[-1]) > 0, f"rank log {f} has no passing summary:\n{f.read_text()[-2000:]}"
