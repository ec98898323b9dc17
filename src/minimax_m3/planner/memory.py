"""Per-rank HBM of a TP x EP layout: weights, caches, prefill working memory, reserve (what ``plan()`` returns).

Three cache layouts (``LAYOUTS``); G = ``tp / num_kv_heads`` is the group of ranks that share a KV head
(``parallel.kv_group_size``; 16 for M3 at TP 64):

* ``replicated`` (the port's ``kv_layout="replicated"``, NxDI's GQA layout): each KV head's K and V stored whole
  on the G ranks of its group, the single index-K head on every rank; a prompt prefilled in ONE call whose attention
  walks query tiles of ``ops.prefill.tile_for`` (the port's rule), so its working memory grows with the prompt.
* ``sharded`` (docs/long_context_port.md; what the port runs, ``PORT_LAYOUT``, its ``kv_layout`` default):
  token p of a group lives on group rank ``p mod G`` at slot
  ``p div G``, so K/V and index-K take 1/G per rank; a prompt is prefilled in calls of C tokens (the chunk, a
  multiple of ``lcm(block, G)``, at most the context bucket), each attending to the cache the earlier calls wrote:
  its working memory is that of ONE chunk at any context.
* ``paged`` (the vLLM Neuron model, ``minimax_m3.vllm_neuron``; docs/vllm_neuron_model.md): vLLM's paged caches,
  named so after vLLM's own term for them. Per rank the same bytes per token as ``replicated`` (each KV head's K/V on
  the G ranks of its group, the index keys on every rank: stored as two halves in an index spec's K and V pages), in
  pages of one index block (128 tokens) that the running requests share: ``batch x seq`` is the tokens summed over
  them, each request rounded up to whole pages. A prompt is prefilled one request per forward in segments of C tokens
  (vLLM Neuron's ``max_num_batched_tokens``: one of its segment sizes, :func:`segment_problems`), each reading the
  pages the earlier ones wrote: the working memory of ONE segment at any context, unlike ``replicated``'s one call
  of the whole prompt. bf16 or fp8 routed experts (the plugin's ``quantization: "fp8"``), bf16 pages only (what the
  model serves today). With vLLM's decode context parallelism (``dcp``, ``--decode-context-parallel-size``: dcp
  divides G, ``parallel.dcp_problems``) the pages of every request are dealt by whole blocks over dcp ranks (block n
  on rank n mod dcp): each request in whole virtual blocks of ``block x dcp`` tokens, 1/dcp of them per rank.

Terms, per rank (b batch, S context rounded up to the cache multiple, d head_dim, di index_head_dim, q / kv / iq
query / KV / index heads of the rank, qg = ``q_per_kv x kv`` query heads of the rank's KV groups, B block, K top-k,
kB = ceil(B / G) keys per block per rank, k' = min(K, ceil(S / B)) selected blocks, n = ceil(S / B) blocks):

* weights (:func:`weight_bytes`), the same for every layout;
* KV cache ``b x S / G' x L x 2 x kv x d`` and index-K ``b x S / G' x L_sparse x di`` (cache dtype), G' = 1
  replicated and paged (S in whole pages per request; with DCP in whole ``block x dcp`` and G' = dcp), G sharded
  (:func:`cache_bytes`);
* prefill, replicated (T = ctx_batch x S tokens): persistent ``[T, hidden]`` x 4 activations, projections and
  logits (:func:`prefill_persistent_bytes`) plus the larger of one attention query tile
  (:func:`attention_tile_bytes`) and the MoE (:func:`prefill_phases`);
* prefill, paged (T = C, one request per segment): the same persistent terms for C tokens plus the larger of the
  MoE for C tokens (:func:`static_moe_bytes`: the model's own static formulation, with the experts' weight slices
  it copies per block) and the segment's attention: one query tile of the model's ``attention_tile``
  (:data:`PAGED_TILE`; a dense read's tile capped as ``ops.step`` caps it, :func:`dense_tile`) against the pages
  up to S (:func:`attention_tile_bytes`, the replicated layout's tile terms) plus the line it lays end to end
  (:func:`paged_line_bytes`); with DCP the keys a rank scores and reads densely, and its line, are its own
  S / dcp, the pooled block scores the whole line's, and the candidates of its dcp ranks gathered. A decode step's
  lines (``b x S`` x the same width: for M3 512 of the pages' 45,312 bytes per token) stay below a segment's
  working memory wherever the pages fit a 24 GiB rank: not counted;
* prefill, sharded (T = C, one request per call): the same persistent terms for C tokens plus the larger of the
  MoE for C tokens (:func:`moe_bytes`) and the attention of the chunk's C queries against keys up to S
  (:func:`sharded_attention_bytes`): a sparse layer's group queries ``C x qg x d`` (bf16, all-gathered), gathered
  K and V ``2 x C x kv x k' x kB x d`` (bf16), fp32 scores and probabilities ``C x qg x k' x kB x 2``, fp32 partial
  outputs with their max and sum ``C x qg x (d + 2)``, the indexer's fp32 scores of one key tile ``C x iq x T_k``
  (T_k = ceil(min(S, K x B) / G) keys; pooled as they are made), its fp32 partial block scores ``C x iq x n``, the
  local top-K (fp32 score + int64 id) ``C x iq x k' x 12``, the gathered candidates (score and id as fp32)
  ``C x iq x G x k' x 2 x 4`` and the selection ``C x iq x k'`` (int64); a dense layer (online softmax over key
  tiles of T_k keys) group queries, the K/V tile ``2 x kv x T_k x d`` (bf16), fp32 scores and probabilities
  ``C x qg x T_k x 2``, partial outputs and statistics as above and the causal mask ``C x T_k`` (bool);
* a runtime reserve (scratchpad, instructions, runtime; an assumption, 3 GiB unless told).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import parallel
from ..config.m3 import M3Config
from ..ops.moe import static_strategy
from ..ops.prefill import PREFILL_TILES, PREFILL_MAX_TILE
from .base import (BF16, FP8, FP32, GIB, HBM_PER_RANK_GIB, LAYOUTS, MAX_CHUNK, PAGED, PAGED_SEGMENTS,
                   PAGED_SINGLE_SHOT, PAGED_TILE, PORT_LAYOUT, SHARD_ON_I_MULTIPLE, ChunkError, PlanError, _heads,
                   cache_multiple, cache_tokens, dcp_tokens)
from .working import (attention_tile_bytes, dense_tile, moe_bytes, paged_line_bytes, prefill_persistent_bytes,
                      prefill_phases, prefill_tile, sharded_attention_bytes, static_moe_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank HBM of one TP x EP layout (bytes by category) and whether it fits; what ``plan()`` returns."""
    tp: int
    ep: int
    batch: int
    seq: int
    ctx_batch: int
    weights: str
    kv_dtype: str
    weight_bytes: int
    kv_bytes: int
    index_k_bytes: int
    prefill_bytes: int
    reserve_bytes: int
    hbm_bytes: int
    notes: tuple[str, ...] = ()
    chunk: int = 0  # replicated: the port's attention query tile; sharded: tokens per prefill call; paged: segment
    phases: tuple[tuple[str, int], ...] = ()  # the two prefill phases (attention, MoE), the larger counted
    layout: str = "replicated"
    group: int = 1  # G: ranks sharing a KV head (the sharded caches are split G ways)
    decode_experts: str = "ep"  # "tp": decode reads a second copy of the routed experts split over all ranks
    dcp: int = 1  # paged: vLLM's decode_context_parallel_size (each request's pages dealt by block over dcp ranks)

    @property
    def decode_ep(self) -> int:
        """The expert-parallel degree the decode graphs read the experts at (``parallel.decode_ep``)."""
        return parallel.decode_ep(self.ep, self.decode_experts)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.index_k_bytes + self.prefill_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes


def _segment_unit(dcp: int, block: int) -> int:
    """What a paged prefill segment is a multiple of: ``dcp x block`` under decode context parallelism (B@0), else
    any size."""
    return block * dcp if dcp > 1 else 1


def segment_problems(seq: int, chunk: int, dcp: int = 1, block: int = 128) -> list[str]:
    """Why the paged layout cannot prefill a ``seq``-token context in segments of ``chunk`` tokens (empty: it can).
    vLLM Neuron segments a prompt when ``max_num_batched_tokens`` (the segment) is below ``max_model_len``, and then
    only in one of its segment sizes; a context of at most the single-shot limit may instead be one call (the
    ``compile --dry-run --route vllm-neuron`` rule). With ``dcp`` > 1 a prefill bucket is a multiple of ``dcp x
    block`` (each DCP rank writes whole blocks), the single call the prompt rounded up to it."""
    unit = _segment_unit(dcp, block)
    whole = -(-seq // unit) * unit
    if chunk % unit == 0 and (chunk in PAGED_SEGMENTS or chunk == whole <= PAGED_SINGLE_SHOT):
        return []
    if dcp > 1:
        fits = [s for s in PAGED_SEGMENTS if s % unit == 0]
        return [f"prefill segment (--chunk) {chunk}: with --dcp {dcp} (vLLM's --decode-context-parallel-size) "
                f"vLLM Neuron's prefill buckets are multiples of dcp x block = {dcp} x {block} = {unit} tokens (each "
                f"DCP rank writes whole blocks): one of {', '.join(map(str, fits)) or 'none of its segments'}, or a "
                f"whole prompt of at most {PAGED_SINGLE_SHOT} tokens in one call, --seq rounded up to {unit}"
                + (f" (--chunk {whole})" if whole <= PAGED_SINGLE_SHOT else "")]
    return [f"prefill segment (--chunk) {chunk}: the paged layout prefills in vLLM Neuron's segments of "
            f"max_num_batched_tokens tokens, one of {', '.join(map(str, PAGED_SEGMENTS))}, or a whole prompt of at "
            f"most {PAGED_SINGLE_SHOT} tokens in one call (--chunk = --seq); without --chunk: {PAGED_SEGMENTS[-1]}, "
            "or --seq when shorter"]


def segment_tokens(seq: int, chunk: int | None = None, dcp: int = 1, block: int = 128) -> int:
    """The paged layout's prefill segment: ``chunk`` where :func:`segment_problems` has none (else one
    :class:`ChunkError`); by default the largest segment, or the whole prompt when ``seq`` is shorter (with ``dcp``
    > 1 rounded up to ``dcp x block``)."""
    if chunk is None:
        unit = _segment_unit(dcp, block)
        return min(-(-seq // unit) * unit, PAGED_SEGMENTS[-1])
    problems = segment_problems(seq, chunk, dcp, block)
    if problems:
        raise ChunkError(problems)
    return chunk


def weight_bytes(c: M3Config, tp: int, ep: int, weights: str = "bf16", decode_experts: str = "ep"
                 ) -> tuple[int, dict[str, int]]:
    """Per-rank weight bytes and their breakdown: embedding and LM head sharded over TP (vocab padded to a multiple
    of TP); attention with ``num_heads / tp`` query heads and the KV heads split or replicated to TP; the indexer's
    query projection like the KV heads and its single index-key head on every rank; dense MLPs and the shared
    expert TP-sharded; routers (fp32, every rank); routed experts ``num_experts / ep`` per rank, each sharded over
    ``moe_tp``. ``fp8``: routed experts in NxD's expert-wise per-channel e4m3 layout (1 byte per weight + an fp32
    scale per output channel of each local expert), everything else bf16. ``decode_experts="tp"``: a second copy of
    the routed experts for the decode graphs, split over all ``tp`` ranks (``parallel.decode_tp_experts``)."""
    problems = parallel.parallel_layout_problems(c, tp, ep)
    if problems:
        raise PlanError(problems)
    moe_tp = parallel.moe_tp(tp, ep)
    h, d, di = c.hidden_size, c.head_dim, c.index_head_dim
    q = parallel.heads_per_rank(c.num_heads, tp)
    kv = parallel.heads_per_rank(c.num_kv_heads, tp)
    iq = parallel.heads_per_rank(c.index_heads, tp)
    n_moe = sum(c.moe_layers)
    n_sparse = sum(c.sparse_layers)
    vocab = -(-c.vocab_size // tp) * tp

    def experts_of(local: int, i_rank: int) -> int:
        n = n_moe * local * 3 * h * i_rank * (FP8 if weights == "fp8" else BF16)
        if weights == "fp8":  # scales [E, 1, 2I/moe_tp] (gate/up, sharded with its columns) and [E, 1, H] (down)
            n += n_moe * local * (2 * i_rank + h) * FP32
        return n

    experts = experts_of(parallel.local_experts(c.num_experts, ep), c.intermediate_size // moe_tp)
    parts = {
        "embedding + lm_head": 2 * vocab // tp * h * BF16,
        "attention": c.num_layers * (2 * q * d * h + 2 * kv * d * h + 2 * d) * BF16,
        "indexer": n_sparse * ((iq + 1) * di * h + 2 * di) * BF16,
        "norms": (2 * c.num_layers + 1) * h * BF16,
        "dense MLPs": (c.num_layers - n_moe) * 3 * h * c.dense_intermediate_size // tp * BF16,
        "shared experts": n_moe * 3 * h * c.shared_intermediate_size // tp * BF16,
        "routers (fp32)": n_moe * (c.num_experts * h + c.num_experts) * FP32,
        "routed experts": experts,
    }
    if decode_experts == "tp":
        parts["decode expert copy"] = experts_of(c.num_experts, c.intermediate_size // tp)
    return sum(parts.values()), parts


def cache_bytes(c: M3Config, tp: int, batch: int, seq: int, layout: str = PORT_LAYOUT, kv_dtype: str = "bf16",
                dcp: int = 1) -> tuple[int, int]:
    """Per-rank (KV, index-K) cache bytes for ``batch`` sequences of ``seq`` tokens (rounded up to the bucket; paged
    with ``dcp``: 1/dcp of each request's virtual blocks)."""
    s = cache_tokens(c, tp, seq, layout, dcp)
    per_rank = s // parallel.kv_group_size(c, tp, layout) // dcp
    kvb = BF16 if kv_dtype == "bf16" else 1
    kv = _heads(c, c.num_kv_heads, tp)
    return (batch * per_rank * c.num_layers * 2 * kv * c.head_dim * kvb,
            batch * per_rank * sum(c.sparse_layers) * c.index_head_dim * kvb)


def chunk_problems(c: M3Config, tp: int, seq: int, chunk: int) -> list[str]:
    """Why the sharded layout cannot prefill in calls of ``chunk`` tokens for a ``seq``-token context, with the
    sizes that would work (empty: it can)."""
    m, bucket = cache_multiple(c, tp, "sharded"), cache_tokens(c, tp, seq, "sharded")
    g = parallel.kv_group_size(c, tp)
    out = []
    if chunk < 1 or chunk % m:
        lo, hi = max(m, chunk // m * m), max(m, chunk // m * m + m)
        near = sorted({n for n in (lo, hi) if n <= bucket} or {m})
        out.append(f"prefill chunk {chunk} is not a multiple of lcm(index block {c.index_block_size}, KV group "
                   f"{g}) = {m}: each rank writes chunk / {g} tokens and chunks start on block boundaries; nearest "
                   f"that work: {' or '.join(map(str, near))}")
    if chunk > bucket:
        pow2 = [m << j for j in range(64) if m << j <= bucket][-3:]
        out.append(f"prefill chunk {chunk} is larger than the context bucket {bucket}: use at most {bucket} "
                   f"(e.g. {', '.join(map(str, reversed(pow2)))})")
    return out


def _plan(c: M3Config, tp: int, ep: int, batch: int, seq: int, weights: str, kv_dtype: str, ctx_batch: int,
          tiles: int, max_tile: int, moe_block: int, reserve: int, hbm: int, layout: str, decode_experts: str,
          chunk: int, dcp: int = 1) -> MemoryPlan:
    w, _ = weight_bytes(c, tp, ep, weights, decode_experts)
    kv_cache, index_k = cache_bytes(c, tp, batch, seq, layout, kv_dtype, dcp)
    if layout == "sharded":
        tokens = chunk
        phases = {"attention": sum(sharded_attention_bytes(c, tp, seq, chunk).values()),
                  "MoE": moe_bytes(c, tp, ep, chunk, moe_block)}
    elif layout == PAGED:
        tokens, s, own = chunk, cache_tokens(c, tp, seq, layout, dcp), dcp_tokens(c, seq, dcp)
        tile = min(PAGED_TILE, chunk)
        attention = attention_tile_bytes(c, tp, s, 1, tile, dense_tile(c, tp, own, tile), dcp)
        phases = {"attention tile": sum(attention.values()) + paged_line_bytes(c, tp, 1, own, kv_dtype),
                  "MoE": static_moe_bytes(c, tp, ep, chunk, weights)}
    else:
        tokens, chunk = ctx_batch * seq, prefill_tile(c, seq, tiles, max_tile)
        phases = prefill_phases(c, tp, ep, seq, ctx_batch, chunk, moe_block)
    prefill = sum(prefill_persistent_bytes(c, tp, tokens, ctx_batch).values()) + max(phases.values())
    notes, g = [], parallel.kv_group_size(c, tp)
    i_tp = c.intermediate_size // parallel.moe_tp(tp, ep)
    if layout != PAGED and parallel.moe_tp(tp, ep) > 1 and i_tp % SHARD_ON_I_MULTIPLE:
        padded = -(-i_tp // SHARD_ON_I_MULTIPLE) * SHARD_ON_I_MULTIPLE
        notes.append(f"shard-on-I MoE kernels would pad I/moe_tp from {i_tp} to {padded} (not counted above)")
    if layout == "replicated" and tp > c.num_kv_heads:
        notes.append(f"each KV head is replicated on {g} ranks and the index-K cache on all {tp}")
    if layout == "sharded":
        notes.append(f"K/V and index-K split {g} ways (token p on group rank p mod {g}); prompts prefilled in "
                     f"calls of {chunk} tokens")
    if layout == PAGED:
        per_token = sum(cache_bytes(c, tp, 1, c.index_block_size, layout, kv_dtype)) // c.index_block_size
        s = cache_tokens(c, tp, seq, layout, dcp)
        notes.append(f"vLLM Neuron's pages of {c.index_block_size} tokens, shared by the running requests: "
                     f"{per_token:,} bytes per token per rank (K/V of {_heads(c, c.num_kv_heads, tp)} KV head per "
                     f"rank{f', each on {g} ranks' if g > 1 else ''}, index keys as two halves); {batch} x {s:,} = "
                     f"{batch * s:,} tokens of pages")
        if dcp > 1:
            notes.append(f"decode context parallelism {dcp} (vLLM's --decode-context-parallel-size): each request's "
                         f"pages dealt by whole blocks over {dcp} ranks, in virtual blocks of "
                         f"{c.index_block_size * dcp} tokens: 1/{dcp} per rank ({batch * s // dcp:,} tokens); "
                         f"prefill buckets multiples of {c.index_block_size * dcp}")
        n_local = parallel.local_experts(c.num_experts, ep)
        notes.append(f"prompts prefilled one request per forward in segments of {chunk} tokens "
                     f"(max_num_batched_tokens); a segment's MoE as the model's static formulation computes it "
                     f"({static_strategy(chunk, c.top_k, n_local)}, ops.moe)")
    return MemoryPlan(tp, ep, batch, seq, ctx_batch, weights, kv_dtype, w, kv_cache, index_k, prefill, reserve,
                      hbm, tuple(notes), chunk, tuple(phases.items()), layout, g, decode_experts, dcp)


def chunk_choices(c: M3Config, tp: int, seq: int, cap: int = MAX_CHUNK) -> list[int]:
    """The default chunk's candidates, largest first (``parallel.prefill_chunk_choices``, whose first is the engine
    spec's default): the bucket when it is at most ``cap``, then ``lcm(block, G) x 2^j`` up to both."""
    return parallel.prefill_chunk_choices(c, tp, seq, cap)


def plan(c: M3Config, tp: int, ep: int, batch: int, seq: int, weights: str = "bf16", kv_dtype: str = "bf16",
         ctx_batch: int | None = None, tiles: int = PREFILL_TILES, max_tile: int = PREFILL_MAX_TILE,
         moe_block: int = 512, reserve_gib: float = 3.0, hbm_gib: float = HBM_PER_RANK_GIB,
         layout: str = PORT_LAYOUT, chunk: int | None = None, decode_experts: str = "ep", dcp: int = 1) -> MemoryPlan:
    """Per-rank HBM for serving ``batch`` sequences of up to ``seq`` tokens on a ``tp`` x ``ep`` layout.

    ``replicated``: the prefill's query chunk follows ``chunks`` / ``max_tile`` (the port's ``prefill_tiles`` /
    ``prefill_max_tile``); ``ctx_batch`` sequences per prefill (1: continuous batching). ``sharded``: prompts
    are prefilled one request per call in calls of ``chunk`` tokens (refused with :class:`ChunkError` when the
    layout cannot use it); ``None`` picks the largest of :func:`chunk_choices` that fits (else the smallest).
    ``paged`` (the vLLM Neuron model): ``chunk`` is the prefill segment (:func:`segment_tokens`: one of the plugin's
    segment sizes, default the largest or the whole prompt below it; else :class:`ChunkError`); bf16 or fp8
    experts, bf16 pages only, one request per prefill, the vocabulary split evenly (what the model serves; else
    :class:`PlanError`). ``decode_experts="tp"``: the port's decode copy of the routed experts
    (``--decode-experts tp``), counted in the weights. ``dcp``: vLLM's ``--decode-context-parallel-size`` (paged
    only; ``parallel.dcp_problems``): the pages of each request dealt by block over dcp ranks."""
    if weights not in ("bf16", "fp8") or kv_dtype not in ("bf16", "fp8"):
        raise PlanError("weights and kv dtype are bf16 or fp8")
    if decode_experts not in parallel.DECODE_EXPERTS:
        raise PlanError(f"decode experts {decode_experts!r} is one of {', '.join(parallel.DECODE_EXPERTS)}")
    if layout not in LAYOUTS:
        raise PlanError(f"layout {layout!r} is one of {', '.join(LAYOUTS)}")
    if min(tp, ep, batch, seq, tiles, max_tile, moe_block) < 1:
        raise PlanError("tp, ep, batch, seq, tiles, max_tile and moe_block must be positive")
    if dcp != 1 and layout != PAGED:
        raise PlanError(f"--dcp {dcp}: decode context parallelism is the paged layout's (vLLM's "
                        f"--decode-context-parallel-size); the {layout} layout has none: plan it with --layout paged")
    ctx_batch = 1 if ctx_batch is None else ctx_batch  # what NeuronEngine runs: one request per prefill
    if layout == "replicated" and chunk is not None:
        raise PlanError("a prefill chunk (tokens per call) is the sharded and paged layouts'; the replicated "
                        "layout prefills a prompt in one call")
    if layout == "sharded" and ctx_batch != 1:
        raise PlanError("the sharded layout prefills one request per call (ctx_batch 1)")
    if layout == PAGED:
        problems = [f"{p} (the vLLM Neuron model's tp {tp} / ep_degree {ep})"
                    for p in parallel.parallel_layout_problems(c, tp, ep, even_vocab=True)]
        if kv_dtype != "bf16":
            problems.append(f"--kv-dtype {kv_dtype}: the vLLM Neuron model keeps its pages in the model's dtype "
                            "(vLLM's --kv-cache-dtype auto); plan it with --kv-dtype bf16")
        if decode_experts != "ep":
            problems.append("--decode-experts tp is the NxDI port's (NxD's hybrid sharding); the vLLM Neuron model "
                            "reads its experts one way: plan it with --decode-experts ep")
        if ctx_batch != 1:
            problems.append(f"--ctx-batch {ctx_batch}: vLLM Neuron prefills one request per forward (its scheduler's "
                            "max_prefills_per_batch is 1); leave --ctx-batch unset")
        problems += parallel.dcp_problems(c, tp, dcp)
        if problems:
            raise PlanError(problems)
    _heads(c, c.num_heads, tp)
    args = (c, tp, ep, batch, seq, weights, kv_dtype, ctx_batch, tiles, max_tile, moe_block,
            int(reserve_gib * GIB), int(hbm_gib * GIB), layout, decode_experts)
    if layout == "replicated":
        return _plan(*args, 0)
    if layout == PAGED:
        return _plan(*args, segment_tokens(seq, chunk, dcp, c.index_block_size), dcp)
    if chunk is not None:
        problems = chunk_problems(c, tp, seq, chunk)
        if problems:
            raise ChunkError(problems)
        return _plan(*args, chunk)
    tried = [_plan(*args, n) for n in chunk_choices(c, tp, seq)]
    return next((p for p in tried if p.fits), tried[-1])
