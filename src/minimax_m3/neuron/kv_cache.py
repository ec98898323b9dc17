"""NxDI's KV cache manager extended with the persistent index-K cache of every sparse layer.

The index-K tensors ``[batch, max_len, index_head_dim]`` (one per sparse layer) are appended to
``past_key_values`` after the 2·L K/V tensors. NxDI aliases every entry of ``kv_mgr.past_key_values`` in and
out of the traced graph (``DecoderModelInstance.get``: entry i ↔ output ``num_output_from_trace + i``) and, off
device, copies the returned tensors back entry by entry (``_copy_past_key_values``), so the index-K cache is
carried exactly like K and V. Layers receive ``past_key_value = [K, V, index_K]`` on sparse layers and return
``(K, V, index_k_new)``; index-K uses the same rows and slots as K/V:

* prefill, static batching: rows ``0..B-1``, slots ``0..S-1`` (NxDI's ``fill_prefix``);
* prefill, continuous batching (``ctx_batch_size=1``): row ``seq_ids[0]``, slots ``0..S-1``, written with
  constant position indices as NxDI writes K/V there (``update_cache_const_indices``);
* decode: row r for batch row r, slot ``position_ids[r]`` (NxDI's scatter when ``batch_size ==
  kv_cache_batch_size``, which ``validate_config`` requires);
* reads take the rows NxDI's ``get_kv_by_layer_id`` takes (padding rows dropped).
"""

from __future__ import annotations

import torch
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager
from neuronx_distributed_inference.modules.kvcache.utils import fill_prefix
from torch import nn

from .. import ops


class M3KVCacheManager(KVCacheManager):
    def __init__(self, config, *, num_kv_head, global_rank=None, **kwargs):
        super().__init__(config, num_kv_head=num_kv_head, global_rank=global_rank, **kwargs)
        c = config.m3_config()
        self.num_layers = c.num_layers
        self.sparse_layers = [i for i in range(c.num_layers) if c.sparse_layers[i]]
        self.index_slot = {layer: j for j, layer in enumerate(self.sparse_layers)}
        batch = config.neuron_config.kv_cache_batch_size + config.neuron_config.kv_cache_padding_size
        shape = (batch, config.neuron_config.max_length, c.index_head_dim)
        for _ in self.sparse_layers:
            self.past_key_values.append(nn.Parameter(torch.zeros(shape, dtype=self.cache_dtype), requires_grad=False))

    def index_k_cache(self, layer: int) -> torch.Tensor:
        return self.past_key_values[2 * self.num_layers + self.index_slot[layer]]

    def get_cache(self, seq_len: int, skip_slice=False, kvcache_buffer=None, seq_ids=None,
                  windowed_context_encoding_window_idx=-1, **kwargs):
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
        kv = [(layer[0], layer[1]) for layer in new_key_values]
        updated = super().update_cache(is_for_context_encoding, seq_ids, position_ids, kv, seq_len,
                                       scatter_index=scatter_index, kv_active_mask=kv_active_mask,
                                       kvcache_buffer=kvcache_buffer,
                                       windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                                       **kwargs)
        for layer in self.sparse_layers:
            cache = self.index_k_cache(layer)
            new = new_key_values[layer][2]  # [B, S_active, D]
            if is_for_context_encoding and self.is_continuous_batching:
                cache = _write_rows(cache, new.to(cache.dtype), seq_ids)
            elif is_for_context_encoding:  # rows 0..B-1, slots 0..S-1 written in place, as NxDI writes K/V
                cache = fill_prefix(cache, new.to(cache.dtype))
            else:
                cache = ops.write_positions(cache.clone(), new.to(cache.dtype), position_ids, seq_dim=1)
            updated.append(cache)
        return updated


def _write_rows(cache: torch.Tensor, new: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """``cache[seq_ids[b], 0:S] = new[b]``: the 3-D form of NxDI's ``update_cache_const_indices`` (the K/V
    write under continuous batching): the position indices are constants, only the row offset is dynamic."""
    b, s, _ = new.shape
    rows = seq_ids.view(-1, 1).expand(b, s).to(torch.int32)
    pos = torch.arange(s, dtype=torch.int32, device=new.device).view(1, -1).expand(b, s)
    return torch.index_put(cache, (rows, pos), new)
