"""Preallocated KV cache plus the per-sparse-layer index-K cache (slot == position)."""

from __future__ import annotations

import torch

from .. import ops
from ..config.m3 import M3Config
from . import fast


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
        self.tile, self.config = tile, c

    def attend(self, layer: int, q, k, v, iq, ik, positions: torch.Tensor, kv_len: int, decode: bool,
               sel: ops.Selection | None, paths) -> torch.Tensor:
        """One layer's attention ``[B, Hq, S, D]`` for a call of ``S`` tokens per row at ``positions`` (``kv_len - S ..
        kv_len - 1`` for a prefill call; one token per row in decode), then the call's entries written.

        The step is ``ops.attention_step`` on the group of one rank (the step the Neuron port and the XLA proofs run):
        the call attends to the prior cache (slots before the call) plus its own tokens. A call from a block boundary
        reads its own keys by selected block (``ops.call_active``); a decode step or a verify step from any position
        attends its few tokens densely (``ops.token_active``). Prefill from position 0 may instead run FlexAttention
        (``paths``: the model's ``FastPaths``)."""
        c, s = self.config, q.shape[2]
        start = kv_len - s
        if not decode and start == 0 and paths.flex(q.device):
            blocks = fast.select_prefill_blocks(iq, ik, tile=self.tile, **sel.kwargs()) if sel else None
            out = fast.flex_prefill(q, k, v, c.softmax_scale, blocks, c.index_block_size, paths.flex_compile)
        else:
            q_pos = positions.to(torch.int64)
            first = q_pos[:, 0]
            if decode or start % c.index_block_size:  # a few tokens per row from any position
                act = ops.token_active(k, v, ik, q_pos, 0, 1)
            else:  # a prefill call from a block boundary
                act = ops.call_active(k, v, ik, first, 0, 1)
            kc = vc = ikc = None
            if kv_len > s:  # what the earlier calls (or steps) wrote: whole caches (sparse layers page them by
                # block), index keys in whole blocks up to the call's end; dense layers read the slots before it
                n = -(-kv_len // c.index_block_size) * c.index_block_size
                if sel is not None:
                    kc, vc, ikc = self.k[layer], self.v[layer], self.index_k[layer][:, :n]
                else:
                    kc, vc = self.k[layer][:, :, :start], self.v[layer][:, :, :start]
            out = ops.attention_step(q, kc, vc, act, q_pos, first, 0, ops.Alone(), c.softmax_scale, sel, iq, ikc,
                                     tile=self.tile)
        self.write_kv(layer, k, v, positions)
        if sel is not None:
            self.write_index_k(layer, ik, positions)
        return out

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        ops.write_positions(self.k[layer], k, positions, seq_dim=2)
        ops.write_positions(self.v[layer], v, positions, seq_dim=2)
        return self.k[layer], self.v[layer]

    def write_index_k(self, layer: int, ik: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ops.write_positions(self.index_k[layer], ik, positions, seq_dim=1)

    def nbytes(self) -> int:
        ts = self.k + self.v + list(self.index_k.values())
        return sum(t.numel() * t.element_size() for t in ts)
