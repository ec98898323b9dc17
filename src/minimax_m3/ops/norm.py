"""Gemma RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (offset + w)`` computed in float32."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """Normalise over the last dim in float32, scale by ``offset + weight``, cast back to ``x.dtype``.

    The release stores zero-centred Gemma weights (``offset=1``). Converters that fold the ``+1`` into the
    weight (the NxDI state dict) call this with ``offset=0``.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + weight.float())).to(x.dtype)
