"""SwiGLU-OAI: ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``."""

import torch
import torch.nn.functional as F


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The activation. The gate is clamped above only; ``up`` on both sides."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1.0) * glu


def swiglu_mlp(
    x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor, alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Dense / shared-expert MLP. ``gate_up_weight`` is ``[2I, H]`` = ``[gate; up]`` (not interleaved)."""
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return F.linear(swiglu_oai(gate, up, alpha, limit), down_weight)
