"""Outputs of the test suites' deterministic subprocesses, kept across runs under a hash of every input.

A graph-harness dry run, the TP 1 execution of its modules, a pre-sharding run and a ``torchrun`` launch of the
CPU-mode suite at TP 2 or 4 are each a pure function of their inputs: the files they read (a checkpoint, a dry run's
modules, a request, the test tree), their arguments, this repository's package and test support code, the NxDI/NxD
sources, the ``constraints/`` pins, the Python version and every installed distribution's version. :func:`cached`
keeps a run's output folder and stdout under a key hashing all of them (like neuronx-cc's own compile cache, or a
build system's test-result cache), so a second run of the suites on the same machine and tree copies them instead of
running again; any change to any input is a new key. The tests still check every file they read (a launch's per-rank
outcomes and logs are graded as if it had just run).

``MINIMAX_M3_TRACE_CACHE`` names the folder (default ``~/.cache/minimax-m3/traces``); ``off`` runs everything every
time. Point it at an empty folder to time a first run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CODE = (".py", ".json", ".txt", ".toml")


def cache_root() -> Path | None:
    where = os.environ.get("MINIMAX_M3_TRACE_CACHE", str(Path.home() / ".cache" / "minimax-m3" / "traces"))
    return None if where == "off" else Path(where)


def _tree_digest(h, root: Path, suffixes: tuple[str, ...] | None) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and (suffixes is None or p.suffix in suffixes) and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")


@functools.cache
def installed_versions() -> tuple[tuple[str, str], ...]:
    """Every installed distribution of this interpreter as (name, version), sorted: torch-xla, NxD's and vLLM's
    dependencies, ... (a changed pin must not reuse a result). Read once per process."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.add((name.lower().replace("_", "-"), dist.version))
    return tuple(sorted(found))


def inputs_key(name: str, args: list[str], inputs: list[Path]) -> str:
    """The key of ``name`` run with ``args`` over the files under ``inputs`` (every file; a folder's relative paths,
    so the same files elsewhere give the same key), this repository's code, its ``constraints/`` pins, the NxDI/NxD
    sources, the Python version and every installed distribution's version."""
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps([name, args, sys.version, torch.__version__, transformers.__version__,
                         installed_versions()]).encode())
    if (REPO / "constraints").is_dir():
        h.update(b"\1constraints\0")
        _tree_digest(h, REPO / "constraints", None)
    # the package's own folder, not src/: an editable install may leave a *.egg-info (text files) there in one clone
    # and not in the next, which would change every key between two runs of the same tree
    for root in (REPO / "src" / "minimax_m3", REPO / "test" / "support",
                 Path(os.environ.get("NXDI_SRC", "/nonexistent")), Path(os.environ.get("NXD_SRC", "/nonexistent"))):
        if root.is_dir():
            _tree_digest(h, root, CODE)
    for p in inputs:
        p = Path(p)
        h.update(b"\1input\0")
        if p.is_dir():
            _tree_digest(h, p, None)
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:24]


def cached(name: str, args: list[str], inputs: list[Path], out: Path, produce: Callable[[], str],
           keep: Callable[[str], bool] = lambda stdout: True) -> str:
    """``produce()`` (which writes ``out`` and returns its stdout), or, when the same inputs ran before, their output
    folder copied into ``out`` and their stdout. A run is stored only when ``keep(stdout)`` (a launch that failed
    for a reason outside its inputs, a timeout or a taken port, must run again next time)."""
    root = cache_root()
    key = root / inputs_key(name, args, inputs) if root else None
    if key is not None and (key / ".done").is_file():
        shutil.copytree(key / "out", out, dirs_exist_ok=True)
        return (key / "stdout.txt").read_text()
    stdout = produce()
    if key is not None and keep(stdout):
        tmp = key.with_name(key.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out, tmp / "out")
        (tmp / "stdout.txt").write_text(stdout)
        (tmp / ".done").write_text("")
        shutil.rmtree(key, ignore_errors=True)
        try:
            tmp.rename(key)
        except OSError:  # another session stored the same key first: same inputs, same output
            shutil.rmtree(tmp, ignore_errors=True)
    return stdout
