"""Static-shape cache writes (XLA-safe): scatter new entries at their positions along the sequence dim."""

import torch


def write_positions(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Return ``cache`` with ``new`` written at ``positions [B, T]`` along ``seq_dim``, in place (XLA
    functionalises it). ``cache`` is ``[B, ..., S, ...]`` and ``new`` the same with ``T`` in place of ``S``.
    """
    shape = [1] * new.dim()
    shape[0] = positions.shape[0]
    shape[seq_dim] = positions.shape[1]
    index = positions.view(shape).expand_as(new)
    return cache.scatter_(seq_dim, index, new)
