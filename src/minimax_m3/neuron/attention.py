"""MiniMax-M3 attention on NxDI's ``NeuronAttentionBase``, with MiniMax Sparse Attention in prefill and decode.

* Per-head Gemma q/k norms (``+1`` folded, fp32 weights) through NxDI's ``q_layernorm``/``k_layernorm`` hook;
  partial NeoX RoPE on the first ``rotary_dim`` channels (``apply_rotary_embedding`` override).
* GQA sharding REPLICATE_TO_TP_DEGREE when ``tp > num_kv_heads`` (TP=64: rank r holds Q head r and KV head
  r//16). The lightning indexer is sharded the same way: rank r computes only the index heads of the KV
  groups it holds (``IndexQProjection`` replicates index heads across ranks like NxDI replicates K/V), plus
  the single index-K head (replicated).
* Prefill: ``perform_prefill`` → ``ops.prefill_step`` in query chunks (``ops.chunk_for``): ``prefill_chunks`` (8)
  chunks up to ``prefill_chunks x prefill_max_chunk`` tokens (32K), then chunks of ``prefill_max_chunk`` (4096)
  queries, which bounds one chunk's gathered K/V (the chunk loop is unrolled into the graph: see docs/neuron.md).
  Sparse layers: per chunk the indexer scores the keys up to the chunk's end (top-k through the SDK's ``TopK`` op
  on device) and each query attends only to its gathered top-k blocks (block-sparse FLOPs). Dense layers: NxDI's
  flash-attention kernel (boolean causal mask) where NxDI's strategy picks it (device builds with the CTE attention
  kernel on); otherwise, and in CPU mode, the chunked causal path. Causality comes from slot == position (right
  padding), not from NxDI's mask.
* Decode (every layer): ``attention_tokengen`` attends to the bucket's PRIOR caches plus the ACTIVE token (NxDI's
  decomposition; the caches are only read here and written once, in place, by the cache manager). Sparse layers
  score the prior index keys and the active index key, take the top-k blocks and attend only to those blocks
  gathered from the KV cache, plus the active key (``ops.select_blocks_prior_active``,
  ``ops.decode_sparse_prior_active``); dense layers, and sparse layers whose bucket holds at most top-k blocks
  (the indexer would select them all), attend causally over the prior cache (``ops.decode_dense_prior_active``).
  Both steps are ``ops.prefill_step`` / ``ops.decode_step``, the code the reference model and ``test/xla`` run.
* Speculative verify (NxDI's speculation graph, ``speculation_length = k + 1`` tokens per row, each row from its own
  position): the group's step below, whatever the layout (one rank per head: the group of one).
* **Sequence-sharded caches** (``kv_layout="sharded"``, G = ``num_cores_per_group`` > 1 ranks per KV head; and every
  context-encoding call when prompts are prefilled in chunks, ``prefill_chunk``): the step is
  ``ops.sharded_step.rank_attention`` over the rank's shard of the prior caches (decode: NxDI's bucket slice; context
  encoding: the rows' lines from the cache manager, ``M3KVCacheManager.prior``) plus its residue of the call's own
  tokens, with the KV group's collectives (``nxd_compat.KVGroupOps``): the group's query heads gathered so each
  selected block is read once for all of them, the block selection exact over the shards, the softmax merged by
  log-sum-exp. Causality comes from positions: a call starts at ``position_ids[:, 0]``.
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
from ..ops import sharded_step
from ..ops.prefill import PREFILL_CHUNKS, PREFILL_MAX_CHUNK
from . import nxd_compat
from .config import prefill_in_calls
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
        self.chunks = getattr(config, "prefill_chunks", PREFILL_CHUNKS)  # the rule `minimax-m3 plan` models
        self.max_chunk = getattr(config, "prefill_max_chunk", PREFILL_MAX_CHUNK)
        self.selection = ops.Selection.of(c)
        self._index = None
        self.call_context = None  # (kv_mgr, layer, seq_ids, position_ids) of the current call
        self.group = config.num_cores_per_group if getattr(config, "kv_layout", "replicated") == "sharded" else 1
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
        # the CTE attention kernel), else the chunked causal path below. Sparse layers on sharded caches, and every
        # call of a prompt prefilled in several, run the group's step (each gathered block shared by its heads)
        dense_alone = not self.sparse and not self.chunked
        if dense_alone and self.get_flash_attention_strategy(q_len, attention_mask is not None) \
                != FlashAttentionStrategy.NONE:
            return super().perform_prefill(Q, K, V, q_len, bsz, attention_mask)  # NxDI's flash kernel (device)
        if not dense_alone and (self.group > 1 or self.chunked):
            return self.prefill_call(Q, K, V), FlashAttentionStrategy.NONE
        chunk = ops.chunk_for(q_len, self.chunks, self.m3.index_block_size, self.max_chunk)
        if self.sparse:
            iq, ik, _, _ = self._index
            out = ops.prefill_step(Q, K, V, self.scale, chunk, self.selection, iq, ik, topk_fn=_topk_fn())
        else:
            out = ops.prefill_step(Q, K, V, self.scale, chunk)
        return out, FlashAttentionStrategy.NONE

    # ---- decode -----------------------------------------------------------------------------------
    def attention_tokengen(self, Q, K, V, attention_mask, position_ids, past_key_value, active_mask, **kwargs):
        kc, vc = past_key_value[0], past_key_value[1]  # the bucket's prior cache, read only
        q_pos = position_ids[:, 0]
        if self.group > 1 or position_ids.shape[-1] > 1:
            # the rank's shard of the bucket's lines (all of them with one rank per head); the step's tokens are
            # active where the rank owns them. A speculative verify step (k + 1 tokens per row from each row's own
            # position, NxDI's speculation graph) takes this path whatever the layout
            rank, t = self.group_rank(), position_ids.shape[-1]
            q_pos = position_ids.to(torch.int64)
            iq, ik = (self._index[0], self._index[1]) if self.sparse else (None, None)
            act = sharded_step.token_active(K.to(kc.dtype), V.to(vc.dtype), None if ik is None else ik.to(kc.dtype),
                                            q_pos, rank, self.group)
            return sharded_step.rank_attention(Q, kc, vc, act, q_pos, q_pos[:, 0], rank, self.group_ops(),
                                               self.scale, self.selection if self.sparse else None, iq,
                                               past_key_value[2] if self.sparse else None, _topk_fn(),
                                               one_gather=t < sharded_step.ONE_GATHER_TOKENS)
        if not self.sparse:
            return ops.decode_step(Q, kc, vc, K.to(kc.dtype), V.to(vc.dtype), q_pos, self.scale)
        iq, ik, _, ikc = self._index  # validate_config keeps token-generation buckets block-aligned
        return ops.decode_step(Q, kc, vc, K.to(kc.dtype), V.to(vc.dtype), q_pos, self.scale, self.selection, iq, ikc,
                               ik.to(ikc.dtype))

    # ---- the sharded / chunked step ------------------------------------------------------------------------
    def group_rank(self):
        return torch.remainder(self.rank_util.get_rank(), self.group).to(torch.int64) if self.group > 1 else 0

    def group_ops(self):
        return nxd_compat.KVGroupOps(self.group) if self.group > 1 else sharded_step.Alone()

    def prefill_call(self, Q, K, V):
        """A context-encoding call of ``T`` tokens from ``start = position_ids[:, 0]`` over the rows' prior lines
        (what earlier calls wrote) plus the call's own keys (the rank's residue)."""
        kv_mgr, layer, seq_ids, position_ids = self.call_context
        b, t = Q.shape[0], Q.shape[2]
        prior = kv_mgr.prior(layer, seq_ids.view(-1).to(torch.int64) if self.continuous_batching else None, b)
        start = position_ids[:, 0].to(torch.int64)
        q_pos = start.view(-1, 1) + torch.arange(t, device=Q.device).view(1, -1)
        rank = self.group_rank()
        iq, ik = (self._index[0], self._index[1].to(prior[0].dtype)) if self.sparse else (None, None)
        act = sharded_step.chunk_active(K.to(prior[0].dtype), V.to(prior[1].dtype), ik, start, rank, self.group)
        return sharded_step.rank_attention(Q, prior[0], prior[1], act, q_pos, start, rank, self.group_ops(), self.scale,
                                           self.selection if self.sparse else None, iq,
                                           prior[2] if self.sparse else None, _topk_fn())


def _topk_fn():
    """The SDK's top-k op on device, NxD's own choice (``neuronx_distributed.operators.topk``), rather than the full
    ``sort`` ``torch.topk`` lowers to; ``torch.topk`` in CPU mode. Any order and index dtype: ``ops.select_blocks``
    takes the k winners as a set."""
    if cpu_mode():
        return None
    from torch_neuronx.xla_impl.ops import TopK

    return lambda x, k, dim=-1: TopK.apply(x, k, dim=dim)
