"""MiniMax-M3 MoE on NxD: NxDI's ``initialize_moe_module`` with our router and a decode dispatch that works at
any batch size with expert parallelism (``nxd_compat.M3ExpertMLPs``). ``routed_scaling_factor`` is folded into the
routed experts' down projection by the converter; our shared expert's partial sums join the routed ones before NxD's
one all-reduce."""

from __future__ import annotations

import torch
from neuronx_distributed.modules.moe.routing import RouterTopK
from neuronx_distributed_inference.modules.moe_v2 import initialize_moe_module
from torch import nn

from .. import ops
from . import nxd_compat
from .layers import KeepFP32


class M3Router(KeepFP32, RouterTopK):
    """Sigmoid router in float32 with ``e_score_correction_bias`` used for selection only (``ops.route``).

    Returns NxD's router contract ``(router_logits [T, E], expert_affinities [T, E], expert_index [T, k])``;
    the affinities are the winners' sigmoid scores renormalised to 1 (zero elsewhere). The bias is an fp32
    ``nn.Parameter`` initialised non-uniformly (a constant could be folded by the tracer) and, like the router
    weight, kept float32 whatever the model dtype."""

    _fp32_params = ("e_score_correction_bias",)

    def __init__(self, **kwargs):
        kwargs["dtype"] = torch.float32
        kwargs["act_fn"] = "sigmoid"
        super().__init__(**kwargs)
        self.e_score_correction_bias = nn.Parameter(
            torch.arange(self.num_experts, dtype=torch.float32) * 1e-3, requires_grad=False)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        lin = self.linear_router
        lin.weight.data = lin.weight.data.float()
        if lin.bias is not None:
            lin.bias.data = lin.bias.data.float()
        return self

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, self.hidden_size)
        logits = self.get_router_logits(x).float()
        weights, experts = ops.route(x, self.linear_router.weight, self.e_score_correction_bias, self.top_k)
        affinities = ops.combine_matrix(weights, experts, self.num_experts).to(hidden_states.dtype)
        return logits, affinities, experts.to(torch.long)


def initialize_m3_moe_module(config) -> nn.Module:
    """NxDI's factory (SwiGLU-OAI via the neuron config, ``experts_bias=True`` so NxD adds the ``+1`` to the up
    half, no fused TKG kernel, no NxD shared experts), then our router and an expert dispatch that takes expert
    parallelism at any batch (both through ``nxd_compat``: the factory takes no class for either)."""
    moe = initialize_moe_module(config=config, init_tkg_module=False, experts_bias=True)
    nxd_compat.replace_router(moe, M3Router)
    nxd_compat.dispatch_ep_at_any_batch(moe)
    nxd_compat.one_clamp_shift(moe)  # --decode-experts tp: NxD's second expert copy clamps as the first
    return moe


class SharedPartialSums:
    """What NxD's ``MoE._apply_shared_experts`` calls as ``shared_experts(hidden [T, H], seq_len)``: our SwiGLU-OAI
    shared expert built with ``reduce_output=False``, so ``MoE`` adds this rank's partial sums to the routed
    experts' and reduces both in its one all-reduce (``modules/moe/model.py``, ``_forward_compute_bound``).

    A plain object, not a module: the shared expert's parameters stay registered once, under the decoder layer's
    ``shared_expert`` (the converter's keys); NxD reads ``sequence_parallel_enabled`` (False: tensor parallel)."""

    sequence_parallel_enabled = False

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp

    def __call__(self, hidden_states: torch.Tensor, seq_len: int) -> torch.Tensor:
        return self.mlp(hidden_states)


def attach_shared_expert(moe: nn.Module, mlp: nn.Module) -> None:
    """Give NxD's ``MoE`` our shared expert (whose down projection must not reduce: one reduction per layer)."""
    if getattr(mlp.down_proj, "reduce_output", True):
        raise ValueError("the shared expert handed to the MoE must be built with reduce_output=False "
                         "(the MoE all-reduces its partial sums with the routed experts')")
    moe.shared_experts = SharedPartialSums(mlp)
