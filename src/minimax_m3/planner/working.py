"""Per-rank prefill working memory: what one prefill call (a query tile of the replicated layout's one call, a
sharded call, a paged segment) holds live beside the persistent terms, phase by phase (attention, MoE); the terms
are listed in :mod:`.memory`'s docstring, where :func:`~.memory.plan` adds them up."""

from __future__ import annotations

from ..config import parallel
from ..config.m3 import M3Config
from ..ops.moe import blocks_capacity, static_strategy
from ..ops.prefill import PREFILL_TILES, PREFILL_MAX_TILE, tile_for
from ..ops.step import TILE_ELEMENTS
from .base import BF16, FP8, FP32, INT64, _heads, cache_tokens, dcp_tokens

def dense_tile(c: M3Config, tp: int, seq: int, tile: int) -> int:
    """Paged layout: queries per tile of a dense read over ``seq`` keys, ``ops.step.partial_attention``'s rule: at
    most ``tile``, and the scores of a tile (query heads per KV head x keys) within :data:`ops.step.TILE_ELEMENTS`."""
    r = _heads(c, c.num_heads, tp) // _heads(c, c.num_kv_heads, tp)
    return min(tile, max(1, TILE_ELEMENTS // max(1, r * seq)))


def paged_line_bytes(c: M3Config, tp: int, rows: int, seq: int, kv_dtype: str = "bf16") -> int:
    """Paged layout: per-rank bytes a call lays end to end per layer for ``rows`` rows of ``seq`` keys (one layer at a
    time, the larger of): a sparse layer's index keys, its two halves read through the block table and scored apart
    (``rows x seq x index_head_dim``); a dense layer's K and V lines (``2 x rows x seq x kv x head_dim``:
    ``ops.paged.Pages.lines``); in the cache dtype. For M3 at TP 64: 256 and 512 bytes per key and row."""
    kvb = BF16 if kv_dtype == "bf16" else 1
    index = rows * seq * c.index_head_dim * kvb if any(c.sparse_layers) else 0
    dense = 2 * rows * seq * _heads(c, c.num_kv_heads, tp) * c.head_dim * kvb if not all(c.sparse_layers) else 0
    return max(index, dense)


def prefill_tile(c: M3Config, seq: int, tiles: int = PREFILL_TILES, max_tile: int = PREFILL_MAX_TILE) -> int:
    """Queries per tile of a ``seq``-token prefill call: the port's own rule (``ops.prefill.tile_for``)."""
    return tile_for(seq, tiles, c.index_block_size, max_tile)


def attention_tile_bytes(c: M3Config, tp: int, seq: int, ctx_batch: int = 1, chunk: int | None = None,
                         dense_chunk: int | None = None, dcp: int = 1) -> dict[str, int]:
    """Replicated layout: per-rank bytes one query tile of a one-call prefill creates (its last tile, whose keys
    reach ``seq``), as ``ops.attention_step`` builds it (``tile=chunk`` queries), all counted live at once.

    Sparse layers (when ``seq`` holds more than ``index_topk`` blocks; fewer and every chunk is dense causal):
    the gathered K and V, ``chunk x topk x block x head_dim`` per KV head (bf16 each); the fp32 scores and
    probabilities, ``chunk x topk x block`` per query head; the indexer's chunk-by-keys scores, ``chunk x S``
    (keys padded to whole blocks) per index head in fp32; the pooled block scores ``chunk x S / block`` (fp32) and
    the selection ``chunk x topk`` (int64). Dense layers (NxDI's chunked causal path, no flash kernel): fp32 scores
    and probabilities ``chunk x S`` per query head and the boolean causal mask ``chunk x S`` (``dense_chunk``
    queries where the dense tile is smaller: the paged layout's, :func:`dense_tile`). Returns the terms of the
    larger of the two. ``dcp`` > 1 (paged): the index and dense scores over the rank's own blocks, ``seq / dcp``
    keys, the pooled block scores the whole line's, and the dcp ranks' candidates gathered (fp32 score and id)."""
    chunk = prefill_tile(c, seq) if chunk is None else chunk
    dc = chunk if dense_chunk is None else dense_chunk
    b, bs, k = ctx_batch, c.index_block_size, c.index_topk
    q, kv, iq = _heads(c, c.num_heads, tp), _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    nblk = -(-seq // bs)
    keys = dcp_tokens(c, seq, dcp) if dcp > 1 else seq  # the keys a rank holds: its own blocks
    dense = {"scores and probabilities": b * q * dc * keys * 2 * FP32, "causal mask": b * dc * keys}
    if not any(c.sparse_layers) or nblk <= k:
        return dense
    sparse = {
        "gathered K and V": 2 * b * kv * chunk * k * bs * c.head_dim * BF16,
        "scores and probabilities": b * q * chunk * k * bs * 2 * FP32,
        "index scores": b * iq * chunk * -(-keys // bs) * bs * FP32,
        "pooled block scores": b * iq * chunk * nblk * FP32,
        "selection": b * iq * chunk * k * INT64,
    }
    if dcp > 1:
        sparse["gathered candidates"] = b * iq * chunk * dcp * k * 2 * FP32
    if all(c.sparse_layers) or sum(sparse.values()) >= sum(dense.values()):
        return sparse
    return dense


def sharded_attention_bytes(c: M3Config, tp: int, seq: int, chunk: int) -> dict[str, int]:
    """Sharded layout: per-rank bytes of one prefill call's attention, its ``chunk`` queries against the keys of a
    ``seq``-token context (the module docstring lists each term); the larger of a sparse and a dense layer's."""
    g, bs, k, d = parallel.kv_group_size(c, tp), c.index_block_size, c.index_topk, c.head_dim
    kv, iq = _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    qg = c.q_per_kv * kv  # the query heads of the rank's KV groups, all-gathered within the group
    s = cache_tokens(c, tp, seq, "sharded")
    nblk, kb = -(-s // bs), -(-bs // g)
    ksel = min(k, nblk)
    tile = -(-min(s, k * bs) // g)  # keys per rank of one tile (indexer scores, dense online softmax)
    shared = {"group queries": chunk * qg * d * BF16, "partial outputs and statistics": chunk * qg * (d + 2) * FP32}
    sparse = {
        **shared,
        "gathered K and V": 2 * chunk * kv * ksel * kb * d * BF16,
        "scores and probabilities": chunk * qg * ksel * kb * 2 * FP32,
        "index scores (one key tile)": chunk * iq * tile * FP32,
        "partial block scores": chunk * iq * nblk * FP32,
        "local top-k": chunk * iq * ksel * (FP32 + INT64),
        "gathered candidates": chunk * iq * g * ksel * 2 * FP32,
        "selection": chunk * iq * ksel * INT64,
    }
    dense = {
        **shared,
        "K and V tile": 2 * kv * tile * d * BF16,
        "scores and probabilities": chunk * qg * tile * 2 * FP32,
        "causal mask": chunk * tile,
    }
    if not any(c.sparse_layers):
        return dense
    if all(c.sparse_layers) or sum(sparse.values()) >= sum(dense.values()):
        return sparse
    return dense


def moe_bytes(c: M3Config, tp: int, ep: int, tokens: int, moe_block: int = 512) -> int:
    """Per-rank MoE bytes of a prefill of ``tokens`` tokens: fp32 router logits and scores, and NxDI's blockwise
    buffers (``ceil(T k / block) + local_experts - 1`` blocks of ``block`` rows: tokens in, gate/up, out)."""
    rows = (-(-tokens * c.top_k // moe_block) + parallel.local_experts(c.num_experts, ep) - 1) * moe_block
    return (2 * tokens * c.num_experts * FP32
            + rows * (2 * c.hidden_size + 2 * c.intermediate_size // parallel.moe_tp(tp, ep)) * BF16)


def static_moe_bytes(c: M3Config, tp: int, ep: int, tokens: int, weights: str = "bf16") -> int:
    """Per-rank MoE bytes of the vLLM Neuron model's ``static`` formulation (``ops.moe.static_strategy``, what it
    compiles) for a call of ``tokens`` tokens: fp32 router logits and scores, and the tensors the chosen formulation
    materializes, summed (a bound on what is live at once), bf16 unless said:

    * ``gather`` (``T k <= E_local``): each row's expert weights gathered ``T k x 3 h i``, its input, gate/up,
      activation and output;
    * ``dense``: every local expert on every token, ``E_local x T x (2i + i + h)``;
    * ``blocks`` (``ops.moe.blocks_capacity``: n blocks of b rows): the placed rows ``(n b + 1) x h``, each block's
      expert weights gathered ``n x 3 h i`` (a copy per block, not a view), gate/up, activation and output ``n b x
      (3i + h)``, and the rows read back ``T k x h`` in fp32 and in bf16.

    ``fp8`` experts (``quantization: "fp8"``): each gathered weight is an e4m3 copy and its bf16 widening (3 bytes a
    weight, and the gathered fp32 scales); ``dense`` widens every local expert once."""
    h, k = c.hidden_size, c.top_k
    n_local = parallel.local_experts(c.num_experts, ep)
    i = c.intermediate_size // parallel.moe_tp(tp, ep)
    rows, strategy = tokens * k, static_strategy(tokens, k, n_local)
    fp8 = weights == "fp8"
    per_weight = FP8 + BF16 if fp8 else BF16  # a gathered weight: its copy (and, fp8, the widened one)
    scales = (2 * i + h) * FP32 if fp8 else 0  # a gathered expert's scales
    if strategy == "gather":
        work = rows * (3 * h * i * per_weight + scales) + rows * (2 * h + 3 * i) * BF16
    elif strategy == "dense":
        work = n_local * tokens * (3 * i + h) * BF16 + (n_local * 3 * h * i * BF16 if fp8 else 0)
    else:
        n, b = blocks_capacity(rows, n_local)
        work = (n * (3 * h * i * per_weight + scales) + ((n * b + 1) * h + n * b * (3 * i + h)) * BF16
                + rows * h * (FP32 + BF16))
    return 2 * tokens * c.num_experts * FP32 + work


def prefill_phases(c: M3Config, tp: int, ep: int, seq: int, ctx_batch: int = 1, chunk: int | None = None,
                   moe_block: int = 512) -> dict[str, int]:
    """Replicated layout: per-rank bytes of the two phases of a layer's prefill, which run one after the other (the
    MoE reads the attention's output; the next layer's attention the MoE's), so only the larger is live: one
    attention tile (:func:`attention_tile_bytes`; the tiles of a layer run one at a time) and the MoE."""
    return {
        "attention tile": sum(attention_tile_bytes(c, tp, seq, ctx_batch, chunk).values()),
        "MoE": moe_bytes(c, tp, ep, ctx_batch * seq, moe_block),
    }


def prefill_persistent_bytes(c: M3Config, tp: int, tokens: int, ctx_batch: int = 1) -> dict[str, int]:
    """What a prefill of ``tokens`` tokens (``ctx_batch`` sequences) keeps live through a layer, per rank: hidden
    states (residual, normed input, attention output, MLP output; replicated without sequence parallelism), this
    rank's projections (q, k, v, attention output; index q and k) and the last-token logits (fp32)."""
    q, kv, iq = _heads(c, c.num_heads, tp), _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    return {
        "activations": 4 * tokens * c.hidden_size * BF16,
        "projections": tokens * (2 * q + 2 * kv) * c.head_dim * BF16 + tokens * (iq + 1) * c.index_head_dim * BF16,
        "logits": ctx_batch * (-(-c.vocab_size // tp)) * FP32,
    }
