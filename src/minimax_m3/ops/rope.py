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


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """Full-width tables for :func:`apply_rope_tables`, built once per forward and shared by every layer.

    ``cos`` padded with ones and ``sin`` with zeros over the pass-through channels; rotate-half's sign folded into
    ``sin`` and its channel swap into a permutation. Returns ``(cos [.., head_dim], sin [.., head_dim], perm)``."""
    rd, half = cos.shape[-1], cos.shape[-1] // 2
    pad = head_dim - rd
    cos_f = torch.nn.functional.pad(cos, (0, pad), value=1.0)
    sin_f = torch.nn.functional.pad(torch.cat((-sin[..., :half], sin[..., half:]), dim=-1), (0, pad), value=0.0)
    ch = torch.arange(head_dim, device=cos.device)
    perm = torch.where(ch < half, ch + half, torch.where(ch < rd, ch - half, ch))
    return cos_f, sin_f, perm


def apply_rope_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the tables of :func:`rope_tables`: four ops instead of ten, the same numbers
    (``x * 1 + x' * 0`` on the pass-through channels and ``x_j * (-s)`` for ``(-x_j) * s``: bit-equal, tested)."""
    return x * cos.unsqueeze(1) + x.index_select(-1, perm) * sin.unsqueeze(1)
