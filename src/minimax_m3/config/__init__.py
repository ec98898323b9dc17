"""The model's configuration and the arithmetic of splitting it over ranks.

``m3``: :class:`M3Config`, the one description of a MiniMax-M3 text backbone, parsed once per load from either
``config.json`` form; ``parallel``: heads per rank, expert groups and what divides what over TP/EP, the KV group and
the prefill call's size rules, read by the reference plan, the engine spec, the NxDI config, the dry run and the
planner; ``draft``: an EAGLE3 draft's config.

``M3Config`` and ``ConfigError`` are re-exported here (``from minimax_m3.config import M3Config``).
"""

from __future__ import annotations

from .m3 import ConfigError, M3Config  # noqa: F401

__all__ = ["ConfigError", "M3Config"]
