"""``load_engine(spec)``: the one entry point that picks and builds a backend (the only module that knows them all).

Backends are imported inside :func:`load_engine`, so loading the reference backend never imports the Neuron SDK.
"""

from __future__ import annotations

import dataclasses

from . import storage
from .config.m3 import M3Config
from .engine.loop import Engine
from .engine.spec import BACKENDS, EngineSpec, SpecError, spec_from_kwargs

__all__ = ["load_engine"]


def load_engine(spec: EngineSpec | str, backend: str | None = None, **kw) -> Engine:
    """Load the engine ``spec`` describes. The model's ``config.json`` is parsed here, once, and handed to the
    backend as an :class:`~minimax_m3.config.M3Config`; the backend validates the spec against it (every problem in
    one error) before any work. The older form ``load_engine(model, backend="reference", **fields)`` builds the
    spec from its arguments (the old keyword names such as ``max_batch_size`` and ``tp_degree`` are accepted)."""
    if not isinstance(spec, EngineSpec):
        spec = spec_from_kwargs(spec, backend or "reference", **kw)
    elif backend is not None or kw:
        raise SpecError([f"load_engine(spec) takes no other arguments, got {sorted(kw) or [backend]}; put them in "
                         "the EngineSpec"])
    if spec.backend not in BACKENDS:
        raise SpecError(spec.problems())  # names the unknown backend with every other problem
    if spec.backend != "reference":
        from . import neuron

        neuron.require_sdk()  # without the SDK: one clear error saying what to install, before any other work
    # s3:// models (and compiled artifacts) are downloaded, or found cached, once here
    spec = dataclasses.replace(spec, model=str(storage.resolve(spec.model, spec.cache_dir)))
    if spec.compiled and storage.is_s3(spec.compiled):
        spec = dataclasses.replace(spec, compiled=str(storage.resolve(spec.compiled, spec.cache_dir)))
    if spec.draft and storage.is_s3(spec.draft):
        spec = dataclasses.replace(spec, draft=str(storage.resolve(spec.draft, spec.cache_dir)))
    config = M3Config.from_pretrained(spec.model)
    if spec.backend == "reference":
        from .reference.engine import load_reference

        return load_reference(spec, config)
    from .neuron import load_neuron_engine

    drafter = None
    if spec.draft and not spec.fused_speculation:  # verify on the device, draft on the host (fused: both on it)
        from .reference.eagle3 import load_host_drafter

        drafter = load_host_drafter(spec.draft, spec.model, config)
    return load_neuron_engine(spec, config, drafter)
