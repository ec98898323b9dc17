"""The package root imports lazily: pure-Python parts work where torch is not installed.

Oracle: a fresh interpreter in which ``import torch`` fails (``sys.modules['torch'] = None`` makes Python refuse it),
so the result does not depend on what this test process has already imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


def test_blocker_really_blocks_torch():
    r = _run("import torch")
    assert r.returncode != 0 and "torch" in r.stderr


def test_metrics_import_without_torch():
    r = _run("import minimax_m3.eval.metrics as m\nprint(m.qa_f1_score('The cat.', 'the cat'))\n"
             "print('torch' in sys.modules and sys.modules['torch'] is not None)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1.0", "False"]


def test_config_and_errors_import_without_torch():
    r = _run("import minimax_m3\nfrom minimax_m3 import M3Config, M3Error\nprint(M3Config.__name__, M3Error.__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["M3Config", "M3Error"]


def test_root_still_exports_the_engine_names():
    import minimax_m3

    from minimax_m3.load import load_engine
    from minimax_m3.engine import GenerationConfig

    assert minimax_m3.GenerationConfig is GenerationConfig and minimax_m3.load_engine is load_engine
    assert set(minimax_m3.__all__) <= set(dir(minimax_m3))
    with pytest.raises(AttributeError, match="NoSuchThing"):
        getattr(minimax_m3, "NoSuchThing")  # noqa: B009 (the attribute lookup is what is tested)
