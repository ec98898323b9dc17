"""The backend-neutral engine: :class:`EngineSpec` (``spec``: the one description of an engine, its defaults and
checks) and :class:`Engine` (``loop``: the one generation loop over a backend's step provider).

The public names are re-exported lazily (PEP 562) for callers outside the package (``from minimax_m3.engine import
Engine``), so ``minimax_m3.engine.spec`` still imports without torch; modules of the package import ``.spec`` /
``.loop`` directly.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **{n: "loop" for n in ("SPEC_TIMING_KEYS", "TIMING_KEYS", "Engine", "EngineInputError", "GenerationConfig",
                            "GenerationResult", "StepOutput", "StepProvider", "unpad")},
    **{n: "spec" for n in ("BACKENDS", "EngineSpec", "SpecError")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
