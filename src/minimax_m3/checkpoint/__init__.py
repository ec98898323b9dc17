"""Checkpoint I/O: reading and validating release checkpoints, formats, key mapping, synthetic writer."""

from __future__ import annotations

from pathlib import Path

from ..config import M3Config
from .reader import CheckpointReader


def open_source(path: str | Path, config: M3Config | None = None) -> CheckpointReader:
    """A reader whose ``get(key)`` returns the release tensor ``key`` in full precision."""
    return CheckpointReader(path)


__all__ = ["CheckpointReader", "open_source"]
