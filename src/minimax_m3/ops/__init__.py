"""The model's math, once: pure, stateless, XLA-safe functions the reference model and the Neuron port call.

The attention step of every layer, path and cache layout is :func:`step.attention_step`; :mod:`.layout` holds the
sequence-sharded cache layout's rules; the rest are the layer's other pieces (norms, RoPE, MLP, MoE, sampling).
"""

from .attention import causal_keep, combine, combine_weights, masked_attention, partial_softmax
from .cache import write_positions
from .indexer import (
    block_keep_mask, force_blocks, index_block_scores, local_candidates, merge_candidates, select_blocks, top_blocks,
)
from .mlp import swiglu_mlp, swiglu_oai
from .moe import combine_matrix, expert_ffn, moe_all_experts, route
from .norm import rms_norm
from .prefill import (
    MAX_PREFILL_CALL, PREFILL_MAX_TILE, PREFILL_TILES, call_tokens, prefill_blocks, select_tile, tile_for,
)
from .rope import apply_rope, apply_rope_tables, rope_cos_sin, rope_inv_freq, rope_tables
from .sampling import filter_logits, sample
from .step import Active, Alone, Group, QuerySplit, Selection, attention_step, call_active, token_active
from . import layout, step

__all__ = [
    "MAX_PREFILL_CALL", "PREFILL_MAX_TILE", "PREFILL_TILES", "Active", "Alone", "Group", "QuerySplit", "Selection",
    "apply_rope", "apply_rope_tables", "attention_step", "block_keep_mask", "call_active", "call_tokens",
    "causal_keep", "combine", "combine_matrix", "combine_weights", "expert_ffn", "filter_logits", "force_blocks",
    "index_block_scores", "layout", "local_candidates", "masked_attention", "merge_candidates", "moe_all_experts",
    "partial_softmax", "prefill_blocks", "rms_norm", "rope_cos_sin", "rope_inv_freq", "rope_tables", "route",
    "sample", "select_blocks", "select_tile", "step", "swiglu_mlp", "swiglu_oai", "tile_for", "token_active",
    "top_blocks", "write_positions",
]
