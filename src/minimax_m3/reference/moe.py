"""Routed experts for the reference backend: tokens sorted by expert, one matmul pair per used expert."""

from __future__ import annotations

import torch

from .. import ops
from ..config import M3Config


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, c: M3Config) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight * expert(x)`` (before routed scaling), ``[T, H]``.

    Each expert's contribution is rounded to the activation dtype before it is accumulated, like
    transformers' implementation."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    w_sorted = weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=c.num_experts).tolist()  # host sync: fine for the reference
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = ops.expert_ffn(x[rows], gate_up[e], down[e], c.swiglu_alpha, c.swiglu_limit)
        out.index_add_(0, rows, (y.float() * w_sorted[start:start + n, None]).to(x.dtype))
        start += n
    return out
