"""Checkpoint I/O: reading and validating release checkpoints, formats, key mapping, streaming conversion."""

from __future__ import annotations

from pathlib import Path

from ..config.m3 import M3Config
from .reader import CheckpointError, CheckpointReader
from .source import Source


def open_source(path: str | Path, config: M3Config | None = None, deep: bool = False) -> Source:
    """A validated, format-aware reader: ``get(key)`` returns the release tensor ``key`` in full precision
    (bf16/fp32 as stored; MXFP8 and NVFP4 weights dequantized exactly to float32).

    Raises one :class:`CheckpointError` listing every problem found (``deep=True`` also reads every scale).
    """
    from .validate import open_checkpoint

    return open_checkpoint(path, config, deep).source


__all__ = ["CheckpointError", "CheckpointReader", "Source", "open_source"]
