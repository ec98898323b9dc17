"""Every adaptation of NxD / NxDI that the port needs beyond their hooks, in one place.

Each entry names the SDK version it targets (Neuron SDK 2.29: NxDI 0.9 at 4bcdc54, NxD 0.18 "Release 2.29") and the
upstream behaviour it works around, so a newer SDK is checked here first. The model files (``model.py``,
``attention.py``, ``moe.py``) use NxDI's hooks only and call these by name.
"""

from __future__ import annotations

import os

import torch


def to_cpu(app) -> None:
    """``app.to_cpu()``, joining a process group that already exists in this process.

    Targets NxDI 0.9 (``NeuronApplicationBase.to_cpu``, SDK 2.29).
    Under torchrun NxDI's ``to_cpu`` calls ``init_process_group("gloo")`` unconditionally, which fails when
    another engine (e.g. the reference golden in the same pytest) already joined; hiding ``WORLD_SIZE`` for the
    call makes NxDI reuse the existing group after we check that it has the size NxDI would have asserted."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and "WORLD_SIZE" in os.environ):
        app.to_cpu()
        return
    want = app.neuron_config.world_size
    if dist.get_world_size() != want or dist.get_backend() != "gloo":
        raise RuntimeError(f"existing process group ({dist.get_backend()}, world {dist.get_world_size()}) cannot "
                           f"host NxDI's CPU mode (gloo, world {want})")
    world = os.environ.pop("WORLD_SIZE")
    try:
        app.to_cpu()
    finally:
        os.environ["WORLD_SIZE"] = world
