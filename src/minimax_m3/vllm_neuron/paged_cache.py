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

**Decode context parallelism** (vLLM's ``decode_context_parallel_size``, ``dcp`` ranks of one KV head): the plugin's
runner deals the pages by whole blocks (its slot mapping with interleave = the block: block ``n`` of a request on DCP
rank ``n mod dcp``, in that rank's page ``table[n div dcp]``; other ranks write the token to the null page; a prefill
segment's ``slot_mapping`` holds only this rank's blocks of it). Each rank writes its own tokens and the step runs
over the group block-interleaved (``ops.attention_step(unit=block)``: each rank scores its own blocks, one
all-gather of the group's query heads and candidates, each reads the selected pages it holds, the all-to-all merge):
the pages of a context are ``1 / dcp`` per rank.
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
                 split: ops.QuerySplit | None = None, dcp: tuple[int, object] | None = None):
        self.config, self.tile, self.split, self.dcp = c, tile, split, dcp
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

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, ...]``, the call's tokens, as many as its slots: all of them, or under decode context parallelism
        a prefill segment's tokens this rank holds (the plugin sends their slots only: the segment starts on a lap
        of ``dcp`` blocks, its block ``j`` is DCP rank ``j mod dcp``'s)."""
        n = self.slots.shape[0]
        if n == x.shape[0]:
            return x
        rank, group = self.cache.dcp if self.cache.dcp else (0, None)
        p = self.cache.k[0].shape[2]
        if group is None or x.shape[0] != n * group.size or n % p:
            raise ServingError(f"{n} slots for {x.shape[0]} tokens: the runner sends a slot per token, or under "
                               "decode context parallelism a segment's own blocks (whole blocks, a lap per rank)")
        return x.view(n // p, group.size, p, *x.shape[1:])[:, rank].reshape(n, *x.shape[1:])

    def attend(self, layer: int, q, k, v, iq, ik, positions: torch.Tensor, kv_len, decode, sel, paths):
        """Layer ``layer``'s attention ``[B, Hq, S, D]`` for ``S`` tokens per row at ``positions [B, S]``: write the
        call's K, V (and index keys) at its slots, then attend over the pages (``kv_len``, ``decode`` and ``paths``
        are the contiguous cache's; pages need neither)."""
        cache = self.cache
        b, h, s, d = k.shape
        write_slots(cache.k[layer], self._mine(k.transpose(1, 2).reshape(b * s, h, d)), self.slots)
        write_slots(cache.v[layer], self._mine(v.transpose(1, 2).reshape(b * s, h, d)), self.slots)
        ik_line = None
        if sel is not None:
            lo, hi = cache.ik[layer]
            half = ik.shape[-1] // 2
            write_slots(lo, self._mine(ik[..., :half].reshape(b * s, 1, half)), self.slots)
            write_slots(hi, self._mine(ik[..., half:].reshape(b * s, 1, half)), self.slots)
            ik_line = (Pages(lo, self.table).lines()[:, 0], Pages(hi, self.table).lines()[:, 0])  # scored by halves
        q_pos = positions.to(torch.int64)
        rank, group, unit = 0, ops.Alone(), 1
        if cache.dcp is not None:  # the group's pages dealt by whole blocks
            (rank, group), unit = cache.dcp, cache.k[layer].shape[2]
        return ops.attention_step(q, Pages(cache.k[layer], self.table), Pages(cache.v[layer], self.table), None,
                                  q_pos, q_pos[:, 0], rank, group, cache.config.softmax_scale, sel, iq, ik_line,
                                  tile=cache.tile, split=self.split, unit=unit)
