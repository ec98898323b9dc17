"""MiniMax-M3 attention on NxDI's ``NeuronAttentionBase``, with MiniMax Sparse Attention in prefill and decode.

* Per-head Gemma q/k norms (``+1`` folded, fp32 weights) through NxDI's ``q_layernorm``/``k_layernorm`` hook;
  partial NeoX RoPE on the first ``rotary_dim`` channels (``apply_rotary_embedding`` override).
* GQA sharding REPLICATE_TO_TP_DEGREE when ``tp > num_kv_heads`` (TP=64: rank r holds Q head r and KV head
  r//16). The lightning indexer is sharded the same way: rank r computes only the index heads of the KV
  groups it holds (``IndexQProjection`` replicates index heads across ranks like NxDI replicates K/V), plus
  the single index-K head (replicated).
* **Every call runs the one attention step**, ``ops.attention_step``, on this rank's view of the caches: the KV
  group of ``G = num_cores_per_group`` ranks with sequence-sharded caches (``kv_layout="sharded"``; its collectives
  are ``nxd_compat.KVGroupOps``), or the group of one rank (``ops.Alone``) with the replicated layout. Context
  encoding (``perform_prefill``): the call's own keys (``ops.call_active``, the rank's residue) plus, when prompts
  are prefilled in several calls (``prefill_chunk``), the rows' prior lines from the cache manager
  (``M3KVCacheManager.prior``); a call starts at ``position_ids[:, 0]``. Token generation and NxDI's speculative
  verify step (``attention_tokengen``): the bucket's prior caches plus the step's tokens (``ops.token_active``).
  The caches are only read here and written once, in place, by the cache manager after the layers.
* Sparse layers select per query and KV group the top-k blocks from the prior and active index keys (top-k through
  the SDK's ``TopK`` op on device) and read only those blocks, prior and active alike. Dense layers of a prompt's
  only call use NxDI's flash-attention kernel where NxDI's strategy picks it (device builds with the CTE attention
  kernel on); otherwise the step over the call's own keys on the rank alone. A call with nothing before it is walked
  in query tiles (``ops.tile_for``: ``prefill_tiles`` (8) tiles up to ``prefill_tiles x prefill_max_tile`` tokens,
  then tiles of ``prefill_max_tile`` (4096) queries, bounding one tile's index scores and gathered K/V; the loop is
  unrolled into the graph: docs/neuron.md); over the sharded caches (the whole prior lines, whatever the call: one
  graph, one collective pattern for every bucket) a rank reads ``1/G`` of each block and takes the call in one
  tile.
"""

from __future__ import annotations

import torch
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed_inference.modules.attention.attention_base import (
    FlashAttentionStrategy, NeuronAttentionBase, NeuronAttentionBaseOutput,
)
from neuronx_distributed.utils import cpu_mode
from torch import nn

from .. import ops
from ..ops.prefill import PREFILL_MAX_TILE, PREFILL_TILES
from . import nxd_compat
from .config import kv_group_size, prefill_in_calls
from .layers import GemmaNorm, PartialRope


class IndexQProjection(ColumnParallelLinear):
    """Index-query projection sharded by KV group. With ``tp > G`` index heads its preshard hook repeats each
    head ``tp / G`` times (rank r gets head r // (tp/G), the head of its KV group); with ``tp <= G`` rank r
    gets heads ``[r*G/tp, (r+1)*G/tp)`` — the KV heads it holds."""

    def __init__(self, hidden: int, heads: int, head_dim: int, tp: int, dtype: torch.dtype):
        self.src_heads, self.head_dim_, self.tp = heads, head_dim, tp
        super().__init__(hidden, max(heads, tp) * head_dim, bias=False, gather_output=False, dtype=dtype)

    def preshard_hook(self, model_state_dict: dict, prefix: str) -> None:
        if not prefix.endswith("weight") or prefix not in model_state_dict:
            return
        w = model_state_dict[prefix]
        if self.tp > self.src_heads and w.shape[0] == self.src_heads * self.head_dim_:
            w = w.view(self.src_heads, self.head_dim_, -1).repeat_interleave(self.tp // self.src_heads, dim=0)
            model_state_dict[prefix] = w.reshape(self.tp * self.head_dim_, -1).contiguous()


class NeuronMiniMaxM3Attention(NeuronAttentionBase):
    def __init__(self, config, layer_idx: int):
        c = config.m3_config()
        super().__init__(
            config=config, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
            rotary_emb=PartialRope(c.rotary_dim, c.rope_theta), rms_norm_eps=c.rms_norm_eps, use_qk_norm=False,
            q_layernorm=GemmaNorm(c.head_dim, c.rms_norm_eps), k_layernorm=GemmaNorm(c.head_dim, c.rms_norm_eps),
            softmax_scale=c.head_dim**0.5,  # NxDI divides by it
            # the converter writes the module's own key (``o_proj.o_proj.weight``): naming it as the "checkpoint
            # layer" makes GroupQueryAttention_O's preshard rename an identity (default "o_proj" copies it one
            # level deeper, a key NxD then removes as redundant)
            o_proj_layer_name="o_proj.o_proj",
        )
        self.m3, self.layer_idx = c, layer_idx
        self.sparse = bool(c.sparse_layers[layer_idx])
        self.scale = c.softmax_scale
        self.tiles = getattr(config, "prefill_tiles", PREFILL_TILES)  # the rule `minimax-m3 plan` models
        self.max_tile = getattr(config, "prefill_max_tile", PREFILL_MAX_TILE)
        self.selection = ops.Selection.of(c)
        self._index = None
        self.call_context = None  # (kv_mgr, layer, seq_ids, position_ids) of the current call
        self.group = kv_group_size(config)
        # prompts longer than one call: every context-encoding call must read what the earlier calls wrote
        self.chunked = prefill_in_calls(config.neuron_config)
        self.continuous_batching = config.neuron_config.is_continuous_batching
        if self.sparse:
            tp, dtype = config.neuron_config.tp_degree, self.torch_dtype
            self.index_heads_local = max(1, c.index_heads // tp)
            self.index_q_proj = IndexQProjection(c.hidden_size, c.index_heads, c.index_head_dim, tp, dtype)
            self.index_k_proj = nn.Linear(c.hidden_size, c.index_head_dim, bias=False, dtype=dtype)
            self.index_q_norm = GemmaNorm(c.index_head_dim, c.rms_norm_eps)
            self.index_k_norm = GemmaNorm(c.index_head_dim, c.rms_norm_eps)

    # ---- RoPE -------------------------------------------------------------------------------------
    def apply_rotary_embedding(self, Q, K, V, position_ids, cos_cache, sin_cache, use_polar_compatible_rope):
        if cos_cache is None or sin_cache is None:
            cos_cache, sin_cache = self.rotary_emb(V, position_ids)
        return ops.apply_rope(Q, cos_cache, sin_cache), ops.apply_rope(K, cos_cache, sin_cache), cos_cache, sin_cache

    # ---- indexer ----------------------------------------------------------------------------------
    def _index_heads(self, x, proj, norm, n, cos, sin):
        b, s, _ = x.shape
        y = norm(proj(x).view(b, s, n, self.m3.index_head_dim)).transpose(1, 2)
        return ops.apply_rope(y, cos, sin)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, *args, **kwargs):
        self.call_context = (kwargs.get("kv_mgr"), kwargs.get("idx", self.layer_idx), kwargs.get("seq_ids"),
                             position_ids)
        if not self.sparse:
            try:
                return super().forward(hidden_states, attention_mask, position_ids, past_key_value, *args, **kwargs)
            finally:
                self.call_context = None
        x = hidden_states.to(self.torch_dtype)
        rot_pos = kwargs.get("rotary_position_ids")
        rot_pos = position_ids if rot_pos is None else rot_pos
        cos, sin = kwargs.get("cos_cache"), kwargs.get("sin_cache")
        if cos is None or sin is None:
            cos, sin = self.rotary_emb(x, rot_pos)
            kwargs["cos_cache"], kwargs["sin_cache"] = cos, sin
        iq = self._index_heads(x, self.index_q_proj, self.index_q_norm, self.index_heads_local, cos, sin)
        ik = self._index_heads(x, self.index_k_proj, self.index_k_norm, 1, cos, sin)[:, 0]  # [B, S, Di]
        self._index = (iq, ik, position_ids, None if past_key_value is None else past_key_value[2])
        try:
            out = super().forward(hidden_states, attention_mask, position_ids, past_key_value, *args, **kwargs)
        finally:
            self._index, self.call_context = None, None
        k, v = out.present_key_value[0], out.present_key_value[1]
        return NeuronAttentionBaseOutput(out.hidden_states, (k, v, ik), out.cos_cache, out.sin_cache, out.residual)

    # ---- prefill ----------------------------------------------------------------------------------
    def perform_prefill(self, Q, K, V, q_len, bsz, attention_mask):
        # a dense layer of a prompt's only call attends its own keys, on this rank, whatever the cache layout (the
        # manager writes the rank's residue): NxDI's flash kernel where NxDI's strategy picks it (device builds with
        # the CTE attention kernel). Everything else runs the step
        if not self.sparse and not self.chunked and self.get_flash_attention_strategy(
                q_len, attention_mask is not None) != FlashAttentionStrategy.NONE:
            return super().perform_prefill(Q, K, V, q_len, bsz, attention_mask)  # NxDI's flash kernel (device)
        return self.prefill_call(Q, K, V), FlashAttentionStrategy.NONE

    def prefill_call(self, Q, K, V):
        """A context-encoding call of ``T`` tokens from ``start = position_ids[:, 0]``. A dense layer of a prompt's
        only call attends the call's own keys on this rank alone (every rank computes its KV head's K/V for the whole
        call: no collective), in query tiles. Otherwise the KV group's step over the rows' prior lines (what earlier
        calls wrote; the whole lines, whatever the call) plus the call's own keys (the rank's residue), in one tile;
        with one rank per KV head and a prompt in one call, over the call's own keys alone, in query tiles."""
        kv_mgr, layer, seq_ids, position_ids = self.call_context
        b, t = Q.shape[0], Q.shape[2]
        start = position_ids[:, 0].to(torch.int64)
        q_pos = start.view(-1, 1) + torch.arange(t, device=Q.device).view(1, -1)
        tiles = ops.tile_for(t, self.tiles, self.m3.index_block_size, self.max_tile)
        if not self.sparse and not self.chunked:
            act = ops.call_active(K, V, None, start, 0, 1)
            return ops.attention_step(Q, None, None, act, q_pos, start, 0, ops.Alone(), self.scale, tile=tiles)
        prior = [None, None, None]
        if self.chunked or self.group > 1:
            prior = kv_mgr.prior(layer, seq_ids.view(-1).to(torch.int64) if self.continuous_batching else None, b)
        dtype = K.dtype if prior[0] is None else prior[0].dtype
        rank = self.group_rank()
        iq, ik = (self._index[0], self._index[1].to(dtype)) if self.sparse else (None, None)
        act = ops.call_active(K.to(dtype), V.to(dtype), ik, start, rank, self.group)
        return ops.attention_step(Q, prior[0], prior[1], act, q_pos, start, rank, self.group_ops(), self.scale,
                                  self.selection if self.sparse else None, iq, prior[2] if self.sparse else None,
                                  _topk_fn(), tile=tiles if prior[0] is None else t)

    # ---- decode and verify ---------------------------------------------------------------------------
    def attention_tokengen(self, Q, K, V, attention_mask, position_ids, past_key_value, active_mask, **kwargs):
        """One token per row (decode) or ``k + 1`` (NxDI's speculative verify step, each row from its own position)
        over the bucket's prior caches (the rank's shard of the lines; all of them with one rank per head), the
        step's tokens active where the rank owns them."""
        kc, vc = past_key_value[0], past_key_value[1]  # the bucket's prior cache, read only
        rank, t = self.group_rank(), position_ids.shape[-1]
        q_pos = position_ids.to(torch.int64)
        iq, ik = (self._index[0], self._index[1]) if self.sparse else (None, None)
        act = ops.token_active(K.to(kc.dtype), V.to(vc.dtype), None if ik is None else ik.to(kc.dtype), q_pos, rank,
                               self.group)
        return ops.attention_step(Q, kc, vc, act, q_pos, q_pos[:, 0], rank, self.group_ops(), self.scale,
                                  self.selection if self.sparse else None, iq,
                                  past_key_value[2] if self.sparse else None, _topk_fn(),
                                  one_gather=t < ops.step.ONE_GATHER_TOKENS)

    # ---- the KV group --------------------------------------------------------------------------------------
    def group_rank(self):
        return torch.remainder(self.rank_util.get_rank(), self.group).to(torch.int64) if self.group > 1 else 0

    def group_ops(self):
        return nxd_compat.KVGroupOps(self.group) if self.group > 1 else ops.Alone()


def _topk_fn():
    """The SDK's top-k op on device, NxD's own choice (``neuronx_distributed.operators.topk``), rather than the full
    ``sort`` ``torch.topk`` lowers to; ``torch.topk`` in CPU mode. Any order and index dtype: ``ops.select_blocks``
    takes the k winners as a set."""
    if cpu_mode():
        return None
    from torch_neuronx.xla_impl.ops import TopK

    return lambda x, k, dim=-1: TopK.apply(x, k, dim=dim)
