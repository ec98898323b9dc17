"""The one home of atomic writes: a temporary file in the target's directory, then one rename over the target.

A reader never sees a half-written file: it sees the old file (or none) until the rename, then the whole new one.
A leaf module (stdlib only, nothing from the package): every layer may import it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "move_into_place", "staged_directory", "write_atomic"]


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def move_into_place(tmp: str | Path, path: str | Path) -> Path:
    """Rename a finished file or directory ``tmp`` over ``path`` (same filesystem), creating ``path``'s parent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def staged_directory(out: str | Path) -> Iterator[Path]:
    """Yield a new temporary directory beside ``out`` to write a whole directory into; when the block ends normally
    it replaces ``out`` (any old one removed), when it raises it is removed and ``out`` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that wants a file name (``torch.save``, safetensors,
    ``tokenizer.save``); when the block ends normally it replaces ``path``, when it raises the temporary file is
    removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    move_into_place(tmp, path)


def write_atomic(path: str | Path, data: bytes | str, fsync: bool = True) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` through a temporary file and a rename; returns ``path``.
    ``fsync`` makes the bytes durable before the rename (a crash then leaves the old or the new file, whole)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(path)
