"""Small building blocks of the NxDI port: fp32-kept parameters, Gemma norm (``+1`` folded), partial RoPE and
the SwiGLU-OAI MLP (dense layers and shared expert). All math is ``minimax_m3.ops``."""

from __future__ import annotations

import torch
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from .. import ops


class KeepFP32(nn.Module):
    """Parameters named in ``_fp32_params`` stay float32 through every ``_apply`` cast — NxDI's cast policy
    (``DecoderModelInstance.load_module``) and ``to_cpu``'s ``.bfloat16()`` both cast with ``_apply``."""

    _fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        for name in self._fp32_params:
            p = getattr(self, name, None)
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return self


class GemmaNorm(KeepFP32):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in float32, where ``weight = 1 + w`` was folded by the converter
    (``checkpoint.nxdi_rules``). The weight is kept float32."""

    _fp32_params = ("weight",)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=0.0)


class PartialRope(nn.Module):
    """``rotary_emb(x, position_ids) -> (cos, sin)`` ``[B, S, rotary_dim]`` for NxDI; no buffers (a buffer
    would be cast to bf16 by the cast policy)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv_freq = ops.rope_inv_freq(self.rotary_dim, self.theta).to(x.device)
        return ops.rope_cos_sin(position_ids, inv_freq, x.dtype)


class SwiGLUOAIMLP(nn.Module):
    """Dense / shared-expert MLP: fused ``gate_up_proj`` (ColumnParallel, ``stride=2`` so rank r holds gate_r and
    up_r of a ``[gate; up]`` weight) and RowParallel ``down_proj``: all-reduced in ``reduce_dtype`` (None = the
    model dtype, NxDI's ``rpl_reduce_dtype`` convention; NxD's own default would be float32), or left as this
    rank's partial sums with ``reduce_output=False`` (the shared expert: the MoE reduces them with the routed
    experts' in one all-reduce)."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, dtype: torch.dtype,
                 reduce_output: bool = True, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, bias=False, gather_output=False, stride=2,
                                                 dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, input_is_parallel=True, dtype=dtype,
                                           reduce_output=reduce_output, reduce_dtype=reduce_dtype)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(ops.swiglu_oai(gate, up, self.alpha, self.limit))
