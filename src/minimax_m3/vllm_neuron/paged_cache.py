"""The vLLM Neuron model's caches: paged K/V per layer and paged index keys per sparse layer, one block table.

Per layer ``i`` the runner allocates, from :meth:`~.model.MiniMaxM3ForCausalLM.get_kv_spec`, K and V pages
``[num_blocks, kv_heads, block, head_dim]`` under :func:`.contract.attention_spec`; per sparse layer the index keys
under :func:`.contract.index_spec`, one head of ``index_head_dim / 2``: the first half of each key in the spec's K
pages, the second in its V pages (the contract gives every spec a K and a V tensor; this way neither is idle). Every
spec has the same block size and the scheduler hands one block table for all of them (a request's page ``j`` of
every spec holds its positions ``j*block ..``), so a prefix-cache hit restores the K/V and the index keys together.

A forward call (:meth:`PagedCache.attend`, per layer) writes its tokens' K, V and index keys at vLLM's
``slot_mapping`` FIRST, then runs ``ops.attention_step`` with no active keys over the pages (``ops.paged.Pages``):
every query reads its row's pages up to its own position (prefill from position 0, a segment after cached tokens or a
prefix-cache hit, decode, a speculative verify step: one rule), by selected page on sparse layers, the segment's own
keys included. Where a KV head (and its index head) is replicated on several ranks, a prefill segment's index
selection is split by query over them (``ops.QuerySplit``: each scores its share of the queries, one all-gather of
the block ids), not computed whole on each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..config.m3 import M3Config
from ..errors import ServingError
from ..ops.paged import Pages, write_slots
from .contract import attention_spec, check_block_size, index_spec


class PagedCache:
    """The bound K/V and index-key pages of every layer; :meth:`call` binds one forward call's slots and tables."""

    def __init__(self, c: M3Config, kv_caches: dict, tile: int, dtype: torch.dtype,
                 split: ops.QuerySplit | None = None):
        self.config, self.tile, self.split = c, tile, split
        self.k, self.v, self.ik = {}, {}, {}
        for i in range(c.num_layers):
            names = [attention_spec(i)] + ([index_spec(i)] if c.sparse_layers[i] else [])
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ServingError(f"no KV cache bound for {missing}: allocate every spec of get_kv_spec()")
            self.k[i], self.v[i] = kv_caches[names[0]]
            check_block_size(c, self.k[i].shape[2])
            if self.k[i].dtype != dtype:
                raise ServingError(f"KV cache dtype {self.k[i].dtype}, model dtype {dtype}: serve with "
                                   "--kv-cache-dtype auto (the caches in the model's dtype)")
            if c.sparse_layers[i]:
                self.ik[i] = tuple(kv_caches[names[1]])

    def call(self, slots: torch.Tensor, table: torch.Tensor, prefill: bool = False) -> Call:
        """The caches as one forward call sees them: ``slots [T]`` (flat tokens, row-major; negative: padding) and
        the rows' block tables ``table [B, W]`` (a new object per call, no state kept: the call is captured whole);
        ``prefill``: a prompt segment (the runner's ``max_query_len > decode_token_threshold``), whose selection the
        ranks of a KV head split (decode and verify steps select whole)."""
        return Call(self, slots, table, self.split if prefill else None)


@dataclass
class Call:
    """One forward call over the :class:`PagedCache`: what the model's layers hand their step to."""

    cache: PagedCache
    slots: torch.Tensor
    table: torch.Tensor
    split: ops.QuerySplit | None = None

    def attend(self, layer: int, q, k, v, iq, ik, positions: torch.Tensor, kv_len, decode, sel, paths):
        """Layer ``layer``'s attention ``[B, Hq, S, D]`` for ``S`` tokens per row at ``positions [B, S]``: write the
        call's K, V (and index keys) at its slots, then attend over the pages (``kv_len``, ``decode`` and ``paths``
        are the contiguous cache's; pages need neither)."""
        cache = self.cache
        b, h, s, d = k.shape
        write_slots(cache.k[layer], k.transpose(1, 2).reshape(b * s, h, d), self.slots)
        write_slots(cache.v[layer], v.transpose(1, 2).reshape(b * s, h, d), self.slots)
        ik_line = None
        if sel is not None:
            lo, hi = cache.ik[layer]
            half = ik.shape[-1] // 2
            write_slots(lo, ik[..., :half].reshape(b * s, 1, half), self.slots)
            write_slots(hi, ik[..., half:].reshape(b * s, 1, half), self.slots)
            ik_line = (Pages(lo, self.table).lines()[:, 0], Pages(hi, self.table).lines()[:, 0])  # scored by halves
        q_pos = positions.to(torch.int64)
        return ops.attention_step(q, Pages(cache.k[layer], self.table), Pages(cache.v[layer], self.table), None,
                                  q_pos, q_pos[:, 0], 0, ops.Alone(), cache.config.softmax_scale, sel, iq, ik_line,
                                  tile=cache.tile, split=self.split)
