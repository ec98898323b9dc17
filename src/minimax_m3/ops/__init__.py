"""The model's math, once: pure, stateless, XLA-safe functions that both backends call."""

from .attention import (
    attend_prior_active, causal_keep, decode_attention_dense, decode_attention_sparse, decode_dense_prior_active,
    decode_sparse_prior_active, gather_blocks, masked_attention,
)
from .cache import write_positions
from .indexer import (
    block_keep_mask, force_blocks, index_block_scores, select_blocks, select_blocks_for_queries,
    select_blocks_prior_active, top_blocks,
)
from .mlp import swiglu_mlp, swiglu_oai
from .moe import combine_matrix, expert_ffn, moe_all_experts, route
from .norm import rms_norm
from .prefill import (
    MAX_PREFILL_CALL, attend_blocks, call_tokens, chunk_for, prefill_attention, prefill_blocks, select_chunk,
)
from .rope import apply_rope, apply_rope_tables, rope_cos_sin, rope_inv_freq, rope_tables
from .sampling import filter_logits, sample
from .step import Selection, decode_step, prefill_step
from . import sharded, sharded_step  # the sequence-sharded layout: ops.sharded.*, the per-rank step

__all__ = [
    "MAX_PREFILL_CALL", "Selection", "apply_rope", "apply_rope_tables", "attend_blocks", "attend_prior_active",
    "block_keep_mask", "call_tokens", "causal_keep", "chunk_for", "combine_matrix", "decode_attention_dense",
    "decode_attention_sparse", "decode_dense_prior_active", "decode_sparse_prior_active", "decode_step",
    "expert_ffn", "filter_logits", "force_blocks", "gather_blocks", "index_block_scores", "masked_attention",
    "moe_all_experts", "prefill_attention", "prefill_blocks", "prefill_step", "rms_norm", "rope_cos_sin",
    "rope_inv_freq", "rope_tables", "route", "sample", "select_blocks", "select_blocks_for_queries",
    "select_blocks_prior_active", "select_chunk", "sharded", "sharded_step", "swiglu_mlp", "swiglu_oai", "top_blocks",
    "write_positions",
]
