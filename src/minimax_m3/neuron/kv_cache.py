"""NxDI's KV cache manager extended with the persistent index-K cache of every sparse layer and the sequence-sharded
layout.

The index-K tensors ``[batch, max_len, index_head_dim]`` (one per sparse layer) are appended to
``past_key_values`` after the 2·L K/V tensors. NxDI aliases every entry of ``kv_mgr.past_key_values`` in and
out of the traced graph (``DecoderModelInstance.get``: entry i ↔ output ``num_output_from_trace + i``) and, off
device, copies the returned tensors back entry by entry (``_copy_past_key_values``), so the index-K cache is
carried exactly like K and V. Layers receive ``past_key_value = [K, V, index_K]`` on sparse layers and return
``(K, V, index_k_new)``; index-K uses the same rows and slots as K/V:

* a context-encoding call (:meth:`CallWrites.write_call`, whatever the layout): its tokens from ``start =
  position_ids[:, 0]`` at slots ``start/G ..`` of rows ``seq_ids`` (continuous batching) or ``0..B-1`` (static),
  one scatter per line (the rank's residue of the call with ``G > 1``; all of it with one rank per KV head), so a
  prompt can be prefilled in several calls;
* decode, one rank per KV head: K/V through NxDI's own ``update_cache`` (its scatter at ``position_ids[r]`` for row
  r when ``batch_size == kv_cache_batch_size``, which ``validate_config`` requires), index-K at the same slots
  (``ops.write_positions``); a speculative verify step writes its ``k + 1`` tokens per row the same way;
* decode on the sharded layout (:meth:`M3KVCacheManager.write_tokens`): each row's token on the rank that owns its
  position (``ops.layout.write_token``);
* reads: NxDI's ``get_kv_by_layer_id`` for K/V (padding rows dropped), a decode bucket ``b`` read as ``b / G``
  slots; :meth:`CallWrites.prior` hands context encoding the rows' whole lines.

**Sharded layout** (``kv_layout == "sharded"``, G = ``neuron.config.kv_group_size`` > 1 ranks per KV head): every
K/V and index-K line holds ``max_len / G`` slots, token ``p`` on group rank ``p mod G`` at slot ``p div G``
(``ops.layout``); a call starts on a multiple of G.

:class:`DraftKVCacheManager`: the same call writes (:class:`CallWrites`) for the EAGLE3 draft of a fused build whose
prompts take several calls (``neuron.eagle``), on NxDI's own cache otherwise.
"""

from __future__ import annotations

import torch
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager
from torch import nn

from .. import ops
from .config import kv_group_size


class CallWrites:
    """Mixin for NxDI's ``KVCacheManager``: a context-encoding call written at its first position (so a prompt can be
    prefilled in several calls) and the rows' whole lines read back for the next call. ``group`` ranks per KV head
    (1: every slot on this rank); :meth:`extra_lines` the lines a layer has after its K and V (``[rows, S, D]``)."""

    group = 1

    def kv_lines(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V cache tensors of ``layer`` (``past_key_values[2 * layer]`` and ``[2 * layer + 1]``)."""
        return self.past_key_values[2 * layer], self.past_key_values[2 * layer + 1]

    def extra_lines(self, layer: int) -> list[torch.Tensor]:
        return []

    def prior(self, layer: int, rows: torch.Tensor | None, batch: int) -> list[torch.Tensor]:
        """The whole K, V (and extra) lines of a context-encoding call of ``layer``: cache ``rows`` (continuous
        batching), or with ``rows=None`` the first ``batch`` rows (static batching: a slice, no copy). What the
        earlier calls of a chunked prefill wrote, read only (the attention masks slots past the call's start)."""
        lines = [*self.kv_lines(layer), *self.extra_lines(layer)]
        return [x[:batch] if rows is None else x.index_select(0, rows) for x in lines]

    def group_rank(self):
        return torch.remainder(self.global_rank.get_rank(), self.group).to(torch.int64) if self.group > 1 else 0

    def write_call(self, seq_ids, position_ids, new_key_values) -> list[torch.Tensor]:
        """A context-encoding call of ``T`` tokens from ``start = position_ids[:, 0]``: the rank's residue (all
        ``T`` with one rank per head) at slots ``start/G ..`` of rows ``seq_ids`` (continuous batching) or
        ``0..B-1``; every layer's K and V, then every layer's extra lines (NxDI's cache order)."""
        b = position_ids.shape[0]
        rows = seq_ids.view(-1).to(torch.int64) if self.is_continuous_batching else \
            torch.arange(b, device=position_ids.device)
        rank, first = self.group_rank(), position_ids[:, 0].to(torch.int64) // self.group
        kv, extra = [], []
        for layer, new in enumerate(new_key_values):
            for line, tokens in zip(self.kv_lines(layer), new[:2]):
                kv.append(_write_slots(line, ops.step.residue(tokens, rank, self.group, 2), rows, first, 2))
            for line, tokens in zip(self.extra_lines(layer), new[2:]):
                extra.append(_write_slots(line, ops.step.residue(tokens, rank, self.group, 1), rows, first, 1))
        return kv + extra


class DraftKVCacheManager(CallWrites, KVCacheManager):
    """NxDI's cache of the EAGLE3 draft in a fused build whose prompts take several calls (``neuron.eagle``): a
    context-encoding call written at its first position (:class:`CallWrites`; NxDI's writes a call from slot 0), the
    rest NxDI's. A call at position ``-1`` (a prompt's first: its entry 0 has no target state) is written from slot 0
    rotated by one, entry 0 on the call's last slot, which the next call (or a fused step, past the prompt) writes
    again before anything reads it."""

    def update_cache(self, is_for_context_encoding: bool, seq_ids, position_ids, new_key_values, seq_len: int,
                     *args, **kwargs):
        if is_for_context_encoding:
            first = (position_ids[:, :1] < 0).view(-1, 1, 1, 1)
            new = [[torch.where(first, x.roll(-1, dims=2), x) for x in kv] for kv in new_key_values]
            return self.write_call(seq_ids, position_ids.clamp(min=0), new)
        return super().update_cache(is_for_context_encoding, seq_ids, position_ids, new_key_values, seq_len, *args,
                                    **kwargs)


class M3KVCacheManager(CallWrites, KVCacheManager):
    def __init__(self, config, *, num_kv_head, global_rank=None, **kwargs):
        self.group = kv_group_size(config)
        super().__init__(config, num_kv_head=num_kv_head, global_rank=global_rank, **kwargs)
        c = config.m3_config()
        self.num_layers = c.num_layers
        self.sparse_layers = [i for i in range(c.num_layers) if c.sparse_layers[i]]
        self.index_slot = {layer: j for j, layer in enumerate(self.sparse_layers)}
        batch = config.neuron_config.kv_cache_batch_size + config.neuron_config.kv_cache_padding_size
        shape = (batch, config.neuron_config.max_length // self.group, c.index_head_dim)
        for _ in self.sparse_layers:
            self.past_key_values.append(nn.Parameter(torch.zeros(shape, dtype=self.cache_dtype), requires_grad=False))

    def _init_kv_shape(self, config, layer_to_cache_size_mapping=None):
        super()._init_kv_shape(config, layer_to_cache_size_mapping)
        if self.group > 1:  # [rows, heads, max_len / G, D]: the rank's residue of every line
            self.k_shape = (*self.k_shape[:2], self.k_shape[2] // self.group, *self.k_shape[3:])
            self.v_shape = (*self.v_shape[:2], self.v_shape[2] // self.group, *self.v_shape[3:])

    def index_k_cache(self, layer: int) -> torch.Tensor:
        return self.past_key_values[2 * self.num_layers + self.index_slot[layer]]

    def extra_lines(self, layer: int) -> list[torch.Tensor]:
        return [self.index_k_cache(layer)] if layer in self.index_slot else []

    def get_cache(self, seq_len: int, skip_slice=False, kvcache_buffer=None, seq_ids=None,
                  windowed_context_encoding_window_idx=-1, **kwargs):
        seq_len //= self.group  # a decode bucket's slots on this rank
        out = []
        for idx in range(self.num_layers):
            k, v = self.get_kv_by_layer_id(idx=idx, skip_slice=skip_slice, seq_len=seq_len,
                                           kvcache_buffer=kvcache_buffer, seq_ids=seq_ids,
                                           windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                                           **kwargs)
            entry = [k, v]
            if idx in self.index_slot:
                ik = self.index_k_cache(idx)
                if self.kv_cache_padding_size > 0:
                    ik = ik[: -self.kv_cache_padding_size]
                entry.append(ik if skip_slice else ik[:, :seq_len])
            out.append(entry)
        return out

    def update_cache(self, is_for_context_encoding: bool, seq_ids, position_ids, new_key_values, seq_len: int,
                     scatter_index=None, kv_active_mask=None, kvcache_buffer=None,
                     windowed_context_encoding_window_idx: int = -1, **kwargs):
        if is_for_context_encoding:
            return self.write_call(seq_ids, position_ids, new_key_values)
        if self.group > 1:
            return self.write_tokens(position_ids, new_key_values)
        kv = [(layer[0], layer[1]) for layer in new_key_values]
        updated = super().update_cache(is_for_context_encoding, seq_ids, position_ids, kv, seq_len,
                                       scatter_index=scatter_index, kv_active_mask=kv_active_mask,
                                       kvcache_buffer=kvcache_buffer,
                                       windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                                       **kwargs)
        for layer in self.sparse_layers:
            cache = self.index_k_cache(layer)
            new = new_key_values[layer][2]  # [B, 1, D]
            updated.append(ops.write_positions(cache.clone(), new.to(cache.dtype), position_ids, seq_dim=1))
        return updated

    def write_tokens(self, position_ids, new_key_values) -> list[torch.Tensor]:
        """Decode (or a speculative verify step's ``T`` tokens per row) on the sharded layout: row r's tokens (cache
        row r) on the ranks owning their positions. One scatter per token: a row's consecutive positions can share a
        rank's slot index (``p div G``) only across ranks, never within one scatter."""
        rank = self.group_rank()
        kv, ik_out = [], []
        for layer, new in enumerate(new_key_values):
            k, v = self.kv_lines(layer)
            lines = [(k.clone(), new[0], 2), (v.clone(), new[1], 2)]
            if layer in self.index_slot:
                lines.append((self.index_k_cache(layer).clone(), new[2], 1))
            for t in range(position_ids.shape[1]):
                pos = position_ids[:, t].to(torch.int64)
                for line, tokens, dim in lines:
                    ops.layout.write_token(line, tokens.narrow(dim, t, 1), pos, rank, self.group, seq_dim=dim)
            kv += [lines[0][0], lines[1][0]]
            ik_out += [line for line, _, _ in lines[2:]]
        return kv + ik_out


def _write_slots(cache: torch.Tensor, new: torch.Tensor, rows: torch.Tensor, first: torch.Tensor,
                 seq_dim: int) -> torch.Tensor:
    """``cache[rows[b], ..., first[b] + i] = new[b, ..., i]`` along ``seq_dim`` (2 for K/V ``[R, H, S, D]``, 1 for
    index-K ``[R, S, D]``): one scatter, rows and start dynamic (NxDI's ``update_cache_const_indices`` with an
    offset)."""
    b, n = new.shape[0], new.shape[seq_dim]
    slots = first.view(b, 1) + torch.arange(n, device=new.device).view(1, n)
    idx = (rows.view(b, 1).expand(b, n), slots)
    if seq_dim == 1:
        return torch.index_put(cache, idx, new.to(cache.dtype))
    return torch.index_put(cache.transpose(1, 2), idx, new.transpose(1, 2).to(cache.dtype)).transpose(1, 2)
