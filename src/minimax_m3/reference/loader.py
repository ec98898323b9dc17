"""Build the reference model from a checkpoint directory, streaming one layer's tensors at a time.

Under a :class:`ShardPlan` each rank keeps only its slices, and reads only its own experts' tensors (the bulk of the
model), so a rank's host memory stays near its share of the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import ops
from ..checkpoint import open_source
from ..checkpoint.mapping import apply_rule, layer_units, target_name, unit_rules
from ..config.m3 import M3Config
from .model import M3Model
from .parallel import ShardPlan


def build_model(c: M3Config, state: dict[str, torch.Tensor], device, plan: ShardPlan | None = None) -> M3Model:
    """Assemble the model from a complete (already sharded) state dict; no random initialisation happens."""
    with torch.device("meta"):
        model = M3Model(c, plan)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = ops.rope_inv_freq(c.rotary_dim, c.rope_theta)
    return model.to(device).eval()


def _local_experts(rule, layer: int, experts: range, get, dtype: torch.dtype) -> torch.Tensor:
    """A per-expert rule applied to this rank's experts only (the other experts' tensors are never read)."""
    srcs = [[get(t.replace("{L}", str(layer)).replace("{E}", str(e))) for e in experts] for t in rule.sources]
    return rule.transform(srcs).to(dtype).contiguous()


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
               config: M3Config | None = None, plan: ShardPlan | None = None) -> M3Model:
    c = config or M3Config.from_pretrained(path)
    plan = plan or ShardPlan()
    plan.check(c)
    source = open_source(path, c)
    state: dict[str, torch.Tensor] = {}
    for unit in layer_units(c):
        for rule in unit_rules(c, unit):
            name = target_name(rule, unit)
            if any("{E}" in s for s in rule.sources):
                t = plan.shard_experts(c, name, _local_experts(rule, unit, plan.experts(c), source.get, dtype))
            else:
                t = plan.shard(c, name, apply_rule(rule, unit, c, source.get, dtype))
            state[name] = t.to(device)
    return build_model(c, state, device, plan)
