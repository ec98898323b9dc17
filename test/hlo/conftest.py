"""The graph harness: NxDI's own ``compile(dry_run=True)`` down to per-bucket HLO, traced in subprocesses.

Needs the NxDI/NxD sources (``NXDI_SRC``/``NXD_SRC``) and an environment where NxDI imports (transformers 4.57: run it
through ``scripts/test_neuron_offdevice.sh``); without the sources every test here is skipped with one line.

The three shapes of issue 13, each traced once per session by ``python -m test.support.hlo.dry_run``
(``minimax-m3 compile --dry-run`` with the stand-ins of ``standins_trace``):

* ``dry_tiny``: the tiny synthetic checkpoint at TP=1, float32, 2 context-encoding + 2 token-generation buckets;
* ``dry_narrow``: MiniMax-M3's head and expert counts (64 q / 4 KV / 4 index heads, 128 experts) at tiny widths,
  TP=64 / EP=64 / LNC=2, rank 0's graphs;
* ``dry_m3``: the real M3 widths with 4 layers (one dense, three sparse MoE) at TP=64 / EP=64 / LNC=2, bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test.support.neuron import result_cache, standins

REPO = Path(__file__).resolve().parents[2]


def _reason() -> str | None:
    reason = standins.missing_reason()
    if reason:
        return reason
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return (f"NxDI needs transformers 4.57 (this environment has {transformers.__version__}): run "
                "scripts/test_neuron_offdevice.sh")
    return None


REASON = _reason()

TINY = ["--tp", "1", "--ep", "1", "--lnc", "1", "--batch", "2", "--seq-len", "256", "--context-buckets", "128,256",
        "--token-buckets", "128,256", "--dtype", "float32"]
NARROW = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", "1", "--seq-len", "1024", "--context-buckets",
          "256,1024", "--token-buckets", "512,1024"]
M3 = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", "1", "--seq-len", "8192", "--context-buckets",
      "2048,8192", "--token-buckets", "4096,8192"]


@pytest.fixture(autouse=True)
def _needs_sources():
    if REASON:
        pytest.skip(f"graph harness: {REASON}")


def run_module(module: str, *args: str, timeout: int = 900) -> tuple[str, float]:
    """``python -m module args`` in a fresh process of this interpreter; fails the test with its output on error."""
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NXD_CPU_MODE", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode:
        pytest.fail(f"{module} {' '.join(args)} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return p.stdout, time.perf_counter() - t0


# ---- the trace cache -------------------------------------------------------------------------------------------
# A dry run is a pure function of its inputs (the model directory's files, its arguments, this repository's code, the
# NxDI/NxD sources, the library versions): its output directory is kept under a key hashing all of them
# (test.support.neuron.result_cache, MINIMAX_M3_TRACE_CACHE), so a second run of the suite on the same machine and
# tree reads the same modules instead of tracing them again. The tests still check every module they read.

def cached_run(module: str, model: Path, out: Path, args: list[str], draft: Path | None = None) -> str:
    """``python -m module --model MODEL --compiled OUT args [--draft DRAFT]``, or its cached output directory and
    stdout copied into ``out`` when the same inputs were traced before (a draft directory is keyed by its files, not
    its path, like the model's)."""
    extra = ["--draft", str(draft)] if draft else []

    def trace() -> str:
        stdout, seconds = run_module(module, "--model", str(model), "--compiled", str(out), *args, *extra)
        (out / "trace_seconds.txt").write_text(f"{seconds:.1f}\n")
        return stdout

    key_args = args + (["--draft", "DRAFT"] if draft else [])
    return result_cache.cached(module, key_args, [model] + ([draft] if draft else []), out, trace)


def dry_run(model: Path, out: Path, args: list[str], draft: Path | None = None) -> Path:
    """``compile --dry-run`` of ``model`` with ``args`` into ``out`` (through the trace cache); ``draft``: a
    directory with an EAGLE3 draft's ``config.json`` (a build with the speculation graph; add
    ``--speculative-tokens K`` to ``args``)."""
    if REASON:  # module-scoped fixtures are set up before the autouse skip runs
        pytest.skip(f"graph harness: {REASON}")
    cached_run("test.support.hlo.dry_run", model, out, args, draft)
    return out


# TP 64: the 4 KV groups of 16 consecutive ranks (the sequence-sharded caches' collectives) and the whole TP group
KV_GROUPS = [list(range(16 * k, 16 * k + 16)) for k in range(4)]
ALL = [list(range(64))]


def collective_ops(g: dict) -> dict[tuple, int]:
    """A graph report's collectives counted by ``(kind, dtype, shape, bytes, "kv" | "tp" | "?")``: what the tests
    write out by hand."""
    out: dict[tuple, int] = {}
    for op in g["collective_ops"]:
        groups = "kv" if op["replica_groups"] == KV_GROUPS else "tp" if op["replica_groups"] == ALL else "?"
        key = (op["kind"], op["dtype"], tuple(op["shape"]), op["bytes"], groups)
        out[key] = out.get(key, 0) + 1
    return out


def write_config(path: Path, config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_release_dict()))
    return path


def draft_and_target(tmp_path_factory, config) -> tuple[Path, Path]:
    """(an EAGLE3 draft directory holding only the synthetic draft's ``config.json`` for ``config``, the target's
    config-only checkpoint): all a dry run reads of either."""
    from minimax_m3.checkpoint.draft import synthetic_config

    draft = tmp_path_factory.mktemp("draft") / "eagle3"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(synthetic_config(config).to_dict(), indent=2) + "\n")
    return draft, write_config(tmp_path_factory.mktemp("cfg") / "m3w3", config)


def m3_layers(n: int = 4):
    from minimax_m3.config import M3Config

    flags = (False,) + (True,) * (n - 1)
    return M3Config().replace(num_layers=n, moe_layers=flags, sparse_layers=flags)


@pytest.fixture(scope="session")
def dry_tiny(tiny_ckpt, tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    return dry_run(Path(tiny_ckpt), tmp_path_factory.mktemp("dry") / "tiny", TINY)


@pytest.fixture(scope="session")
def dry_narrow(tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    from test.support.hlo.nxd_shard_tp64 import narrow_config

    model = write_config(tmp_path_factory.mktemp("cfg") / "narrow", narrow_config())
    return dry_run(model, tmp_path_factory.mktemp("dry") / "narrow", NARROW)


@pytest.fixture(scope="session")
def dry_m3(tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    model = write_config(tmp_path_factory.mktemp("cfg") / "m3w4", m3_layers(4))
    return dry_run(model, tmp_path_factory.mktemp("dry") / "m3w4", M3)


@pytest.fixture(scope="session", params=["tiny", "narrow", "m3"])
def dry(request):
    return request.getfixturevalue(f"dry_{request.param}")
