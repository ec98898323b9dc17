"""Build the reference model from a checkpoint directory, streaming one layer's tensors at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..checkpoint import open_source
from ..checkpoint.mapping import convert_unit, layer_units
from ..config import M3Config
from .model import M3Model


def build_model(c: M3Config, state: dict[str, torch.Tensor], device) -> M3Model:
    """Assemble the model from a complete state dict (no random initialisation happens)."""
    with torch.device("meta"):
        model = M3Model(c)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = ops.rope_inv_freq(c.rotary_dim, c.rope_theta)
    return model.to(device).eval()


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
               config: M3Config | None = None) -> M3Model:
    c = config or M3Config.from_pretrained(path)
    source = open_source(path, c)
    state: dict[str, torch.Tensor] = {}
    for unit in layer_units(c):
        for name, t in convert_unit(source.get, c, unit, dtype):
            state[name] = t.to(device)
    return build_model(c, state, device)
