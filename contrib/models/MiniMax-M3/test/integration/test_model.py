"""NxDI contrib accuracy test: the project's shared backend suite (prefill and decode logits against golden
logits, identical greedy tokens, a prompt long enough that sparse attention drops blocks in prefill and decode,
batch/padding invariance), run on the Neuron backend.

    pytest contrib/models/MiniMax-M3/test/integration/test_model.py                      # Trainium host
    M3_BACKEND=neuron-cpu NXDI_SRC=... NXD_SRC=... pytest contrib/.../test_model.py     # NxDI CPU mode

Skipped, with the reason, where the backend cannot run; when it runs, no test of the suite may be skipped.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]
BACKEND = os.environ.get("M3_BACKEND", "neuron")


def _unavailable() -> str | None:
    if BACKEND == "neuron-cpu":
        if not (os.environ.get("NXDI_SRC") and os.environ.get("NXD_SRC")):
            return "neuron-cpu needs NXDI_SRC and NXD_SRC"
        return None
    from minimax_m3.neuron import sdk_available

    return None if sdk_available() else "the Neuron SDK (NxDI 0.9 / NxD 0.18) is not installed here"


def test_shared_suite_on_neuron_backend():
    why = _unavailable()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", f"--backend={BACKEND}",
                        "test/integration/test_backend_suite.py"], cwd=ROOT, capture_output=True, text=True)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert " skipped" not in r.stdout.splitlines()[-1], tail
