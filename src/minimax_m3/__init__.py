"""MiniMax-M3 text backbone on AWS Trainium (NxD Inference) with a pure-PyTorch reference backend.

The root imports lazily (PEP 562): ``import minimax_m3.eval.metrics`` or ``minimax_m3.config`` needs no torch, and
``minimax_m3.load_engine`` etc. load their module on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module (relative to this package) that defines it
    "M3Error": "errors",
    "ConfigError": "config.m3", "M3Config": "config.m3",
    "Engine": "engine.loop", "EngineInputError": "engine.loop", "GenerationConfig": "engine.loop",
    "GenerationResult": "engine.loop", "load_engine": "load", "EngineSpec": "engine.spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
