"""Preallocated KV cache plus the per-sparse-layer index-K cache (slot == position)."""

from __future__ import annotations

import torch

from .. import ops
from ..config.m3 import M3Config


class KVCache:
    def __init__(self, c: M3Config, batch: int, max_len: int, dtype: torch.dtype, device, tile: int = 256,
                 kv_heads: int | None = None):
        """``kv_heads``: the KV heads this rank holds (default: all of them)."""
        bs = c.index_block_size
        self.max_len = -(-max_len // bs) * bs  # whole blocks, so decode can page the cache by block
        shape = (batch, kv_heads or c.num_kv_heads, self.max_len, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.index_k = {
            i: torch.zeros(batch, self.max_len, c.index_head_dim, dtype=dtype, device=device)
            for i in range(c.num_layers) if c.sparse_layers[i]
        }
        self.tile = tile

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        ops.write_positions(self.k[layer], k, positions, seq_dim=2)
        ops.write_positions(self.v[layer], v, positions, seq_dim=2)
        return self.k[layer], self.v[layer]

    def write_index_k(self, layer: int, ik: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ops.write_positions(self.index_k[layer], ik, positions, seq_dim=1)

    def nbytes(self) -> int:
        ts = self.k + self.v + list(self.index_k.values())
        return sum(t.numel() * t.element_size() for t in ts)
