"""Partial NeoX (rotate-half) rotary embedding on the first ``rotary_dim`` channels of each head."""

import torch


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta^(-2i/rotary_dim)`` for i in [0, rotary_dim/2), float32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables ``[*positions.shape, rotary_dim]`` for integer ``positions``, computed in float32."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` ``[B, H, S, D]``; ``cos``/``sin`` are ``[B, S, R]``."""
    rd = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat(((x_rot * c) + (rotated * s), x_pass), dim=-1)
