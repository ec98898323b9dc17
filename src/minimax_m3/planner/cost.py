"""Time floors per rank: the decode HBM floor, the decode ITL estimate, the prefill's FLOPs and bytes, the collectives,
a TTFT estimate.

Figures (trn2.48xlarge at LNC 2, one logical core = two NeuronCore-v3; ``docs/notes/perf_anchors.md``):

* HBM 725 GB/s per logical core (46.4 TB/s / 64; §0, §1.3);
* dense BF16 167 TFLOP/s per logical core: 10.7 PFLOPS per instance / 64 logical cores (= 667 TFLOPS per chip / 4;
  §1.1, §1.2). Every matmul is counted at the BF16 rate, fp8 experts included (weight-only fp8, dequantized);
* NeuronLink-v3 256 GB/s per logical core (1,024 GB/s per chip within the instance / 4; §1.1), collectives moved
  by ring algorithms: an all-gather or reduce-scatter sends ``(n - 1) / n`` of its full buffer per rank, an
  all-reduce twice that (an assumption: intra-chip hops are counted at the same rate);
* a fixed 25 µs per collective whatever its size (§5.5 (a): 20-25 µs per collective in a DeepSeek-V3 TP 64
  profile; an assumption to replace by ``nccom-test`` on the target; ``minimax-m3 plan --collective-latency-us``
  takes another, every function here a ``latency_s``).

TTFT of a prompt of S tokens = sum over its prefill calls of max(FLOP time, HBM time, link time) (each a floor, the
three overlapped) + collectives x 25 µs. Sharded: ceil(S / C) calls of C tokens, call k attending to the keys
< its end; replicated: one call of S tokens. The decode ITL estimate of a step (:func:`step_itl`) = its bytes / HBM
+ for each collective the larger of 25 µs and the link time of its bytes. Nothing here ran on Trainium.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import parallel
from ..config.m3 import M3Config
from ..ops.step import ONE_GATHER_TOKENS, QuerySplit
from .base import BF16, FP32, HBM_BYTES_PER_S, PAGED, PORT_LAYOUT, _heads, cache_tokens, dcp_tokens, PlanError
from .memory import weight_bytes
from .working import prefill_tile

PEAK_FLOPS_PER_S = 10.7e15 / 64  # dense BF16 per logical core at LNC 2 (perf_anchors §1.1: 10.7 PF per instance)
LINK_BYTES_PER_S = 1024e9 / 4  # NeuronLink-v3 per logical core (1,024 GB/s per chip within the instance, §1.1)
COLLECTIVE_LATENCY_S = 25e-6  # fixed cost per collective (perf_anchors §5.5 (a)); an assumption


def _causal_keys(s: int, cap: int) -> int:
    """Sum over query positions 0..s-1 of the keys each attends to, ``min(i + 1, cap)``."""
    if s <= cap:
        return s * (s + 1) // 2
    return cap * (cap + 1) // 2 + (s - cap) * cap


def weights_read(c: M3Config, tp: int, ep: int, tokens: int, weights: str = "bf16", dtype_bytes: int = BF16
                 ) -> dict[str, int]:
    """Weight bytes one step over ``tokens`` tokens reads per rank: every weight of :func:`weight_bytes`, except the
    embedding (``tokens`` rows of this rank's vocabulary shard) and the routed experts (at most ``tokens x top_k``
    of the ``num_experts / ep`` local experts)."""
    _, parts = weight_bytes(c, tp, ep, weights)
    for name in parts:
        if name != "routers (fp32)" and not (name == "routed experts" and weights == "fp8"):
            parts[name] = parts[name] * dtype_bytes // BF16
    vocab_rank, local = -(-c.vocab_size // tp), parallel.local_experts(c.num_experts, ep)
    parts["embedding + lm_head"] = (vocab_rank + min(tokens, vocab_rank)) * c.hidden_size * dtype_bytes
    parts["routed experts"] = parts["routed experts"] * min(local, tokens * c.top_k) // local
    return parts


def decode_minimum_bytes(c: M3Config, tp: int, ep: int, batch: int, bucket: int, weights: str = "bf16",
                         kv_dtype: str = "bf16", dtype_bytes: int = BF16, layout: str = PORT_LAYOUT, tokens: int = 1,
                         dcp: int = 1) -> dict[str, int]:
    """Bytes one token-generation step over caches of ``bucket`` tokens must read per rank: ``batch`` rows of
    ``tokens`` tokens each (1: a decode step; ``k + 1``: a speculative verify step, NxDI's speculation graph).

    * weights: :func:`weights_read` for ``batch x tokens`` tokens (read once for all of them);
    * sparse layers' K/V: the selected blocks, ``batch x tokens x min(topk x block, bucket) / G' x kv_heads x
      head_dim x 2`` (each query selects its own blocks: the queries of a row gather theirs apart);
    * index-K: ``batch x bucket / G' x index_head_dim`` per sparse layer (once per row: its queries share the keys);
    * dense layers' K/V: ``batch x bucket / G' x kv_heads x head_dim x 2`` per dense layer (once per row);

    G' = 1 for the ``replicated`` and ``paged`` layouts, G (each rank reads its 1/G of every block and key, rounded
    up) for ``sharded`` (the port's). ``paged`` with ``dcp`` > 1 (vLLM's decode context parallelism): each rank scores
    its own blocks and reads its own dense lines, ``ceil(bucket / (block x dcp)) x block`` keys, but gathers all the
    selected blocks (a static ``K`` per query, those another rank holds masked: the same bytes). The graph report
    compares each traced graph against its own layout's.
    ``dtype_bytes`` is the model's element size (4 for a float32 trace): it scales every bf16 weight and, with
    ``kv_dtype="bf16"``, the caches (fp32 routers and fp8 experts keep their size). The one home of the verify
    step's minimum: the graph report's and the speculative projection's (:func:`.speculative.target_step`)."""
    w = sum(weights_read(c, tp, ep, batch * tokens, weights, dtype_bytes).values())
    g = parallel.kv_group_size(c, tp, layout)
    kvb = dtype_bytes if kv_dtype == "bf16" else 1
    per_token_kv = _heads(c, c.num_kv_heads, tp) * c.head_dim * 2 * kvb
    n_sparse = sum(c.sparse_layers)
    keys = dcp_tokens(c, bucket, dcp) if dcp > 1 else -(-bucket // g)
    return {
        "weights": w,
        "kv_sparse": batch * tokens * -(-min(c.index_topk * c.index_block_size, bucket) // g) * per_token_kv
        * n_sparse,
        "index_k": batch * keys * c.index_head_dim * kvb * n_sparse,
        "kv_dense": batch * keys * per_token_kv * (c.num_layers - n_sparse),
    }


def decode_floor_ms(c: M3Config, tp: int, ep: int, batch: int, bucket: int, weights: str = "bf16",
                    kv_dtype: str = "bf16", layout: str = PORT_LAYOUT, dcp: int = 1) -> float:
    """The HBM floor of one token-generation step: :func:`decode_minimum_bytes` at 725 GB/s per logical core."""
    b = decode_minimum_bytes(c, tp, ep, batch, bucket, weights, kv_dtype, layout=layout, dcp=dcp)
    return sum(b.values()) / HBM_BYTES_PER_S * 1e3


@dataclass(frozen=True)
class Itl:
    """A decode latency estimate of one step per rank: ``hbm_s`` = ``bytes`` / 725 GB/s, plus ``collective_s`` =
    each of the step's ``collectives`` at the larger of the fixed latency and the link time of its bytes."""
    bytes: int
    hbm_s: float
    collectives: int
    collective_s: float

    @property
    def total_s(self) -> float:
        return self.hbm_s + self.collective_s


def step_itl(nbytes: int, rows: list[dict], latency_s: float = COLLECTIVE_LATENCY_S, fixed: int = 0) -> Itl:
    """THE inter-token latency formula of a token-generation step per rank: ``nbytes`` read at
    ``HBM_BYTES_PER_S``, then the collectives one after the other (a step cannot overlap them), each row of
    :func:`collectives` ``count`` times ``max(latency_s, link_seconds(row))``, and ``fixed`` more collectives at
    ``latency_s`` (those counted but not modelled as rows: buffers of a few rows, far below the latency on the link).
    FLOP time is left out: a decode step's is a few percent of its HBM time (the speculative projection's
    :class:`.speculative.StepCost` takes the larger)."""
    coll = sum(r["count"] * max(latency_s, link_seconds(r)) for r in rows) + fixed * latency_s
    return Itl(nbytes, nbytes / HBM_BYTES_PER_S, sum(r["count"] for r in rows) + fixed, coll)


def decode_itl(c: M3Config, tp: int, ep: int, batch: int, bucket: int, weights: str = "bf16", kv_dtype: str = "bf16",
               layout: str = PORT_LAYOUT, latency_s: float = COLLECTIVE_LATENCY_S, dcp: int = 1) -> Itl:
    """The ITL estimate of a plain decode step at ``batch`` over caches of ``bucket`` tokens (host sampling):
    :func:`step_itl` of :func:`decode_minimum_bytes` (the HBM floor, :func:`decode_floor_ms`) and the step's
    :func:`collectives` (``dcp``: the paged layout's decode context parallelism)."""
    b = decode_minimum_bytes(c, tp, ep, batch, bucket, weights, kv_dtype, layout=layout, dcp=dcp)
    return step_itl(sum(b.values()), collectives(c, tp, ep, batch, layout, dcp=dcp), latency_s)


def _per_token_flops(c: M3Config, tp: int) -> int:
    """Dot FLOPs per token per rank outside attention, the indexer's scores and the routed experts: q, k, v, o and
    index q, k projections, dense MLP and shared-expert shards, the fp32 router."""
    h, d, di = c.hidden_size, c.head_dim, c.index_head_dim
    q, kv, iq = _heads(c, c.num_heads, tp), _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    n_sparse, n_moe = sum(c.sparse_layers), sum(c.moe_layers)
    return (c.num_layers * 2 * h * (2 * q + 2 * kv) * d + n_sparse * 2 * h * (iq + 1) * di
            + (c.num_layers - n_moe) * 6 * h * c.dense_intermediate_size // tp
            + n_moe * (6 * h * c.shared_intermediate_size // tp + 2 * h * c.num_experts))


def prefill_flops(c: M3Config, tp: int, ep: int, batch: int, seq: int) -> dict[str, int]:
    """Useful dot FLOPs of one context-encoding pass of ``batch x seq`` tokens from position 0, per rank (the
    replicated layout: the whole prompt in one call).

    * attention: sparse layers ``sum_i min(i + 1, topk x block)`` keys per query, dense layers every causal
      key, ``x head_dim x 4`` (scores and values) per query head of this rank;
    * indexer: all keys, ``seq^2 x index_head_dim x 2`` per index head of this rank and sparse layer;
    * routed experts: ``tokens x top_k x 6 x hidden x intermediate`` shared by the ``tp`` ranks that hold the
      experts (``ep`` expert groups x ``tp / ep`` shards; = "/ EP ranks" at tp = ep);
    * rest: :func:`_per_token_flops` per token and the LM head for the last token of each sequence.
    """
    q, iq = _heads(c, c.num_heads, tp), _heads(c, c.index_heads, tp)
    n_sparse = sum(c.sparse_layers)
    keys = n_sparse * _causal_keys(seq, c.index_topk * c.index_block_size) + (c.num_layers - n_sparse) * (
        _causal_keys(seq, seq))
    return {
        "attention": batch * q * c.head_dim * 4 * keys,
        "indexer": batch * iq * seq * seq * c.index_head_dim * 2 * n_sparse,
        "routed_experts": batch * seq * c.top_k * 6 * c.hidden_size * c.intermediate_size * sum(c.moe_layers) // tp,
        "rest": batch * seq * _per_token_flops(c, tp) + batch * 2 * c.hidden_size * (-(-c.vocab_size // tp)),
    }


def chunk_flops(c: M3Config, tp: int, ep: int, start: int, chunk: int, seq: int) -> dict[str, int]:
    """Sharded layout: dot FLOPs per rank of the prefill call of ``chunk`` tokens at positions ``start..`` of a
    ``seq``-token prompt (end ``e = min(start + chunk, seq)``). Linear layers run all ``chunk`` rows (the graph's
    size); attention counts the real queries' causal keys (as :func:`prefill_flops`) for the rank's ``qg`` group
    heads against its 1/G of the keys (= its own heads against all keys); the indexer scores the ``chunk``
    queries against the rank's 1/G of the keys ``< e``."""
    g, kv, iq = parallel.kv_group_size(c, tp), _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    qg, e, n_sparse = c.q_per_kv * kv, min(start + chunk, seq), sum(c.sparse_layers)
    cap = c.index_topk * c.index_block_size
    keys = (n_sparse * (_causal_keys(e, cap) - _causal_keys(start, cap))
            + (c.num_layers - n_sparse) * (_causal_keys(e, e) - _causal_keys(start, start)))
    return {
        "attention": qg * c.head_dim * 4 * keys // g,
        "indexer": iq * chunk * -(-e // g) * c.index_head_dim * 2 * n_sparse,
        "routed_experts": chunk * c.top_k * 6 * c.hidden_size * c.intermediate_size * sum(c.moe_layers) // tp,
        "rest": chunk * _per_token_flops(c, tp) + 2 * c.hidden_size * (-(-c.vocab_size // tp)),
    }


def _moe_rows_read(c: M3Config, ep: int, tokens: int, moe_block: int = 512) -> int:
    """Rows of the blockwise MoE buffers a rank reads on average: its share of the ``tokens x top_k`` assignments
    (balanced routing) plus, per local expert, up to one partly filled block."""
    local = parallel.local_experts(c.num_experts, ep)
    return tokens * c.top_k * local // c.num_experts + local * moe_block


def chunk_bytes(c: M3Config, tp: int, ep: int, start: int, chunk: int, seq: int, weights: str = "bf16",
                kv_dtype: str = "bf16", layout: str = "sharded", moe_block: int = 512) -> dict[str, int]:
    """HBM bytes one prefill call reads per rank: queries ``start..start+chunk`` of a ``seq``-token prompt.

    * weights: :func:`weights_read` for ``chunk`` tokens (once per call);
    * index-K: the keys ``< e`` (e = the call's end), the rank's 1/G' of them, per sparse layer, once per query
      chunk (replicated: the port's query chunks each read the keys before their end);
    * gathered K/V: per sparse layer and query, ``min(topk, blocks < e)`` blocks of ``block / G'`` keys, K and V
      (sharded: once per group, shared by its G heads; replicated: each rank its own head's, in the query chunks
      whose keys span more than ``topk`` blocks: ``ops.prefill`` attends the others densely);
    * dense K/V: the keys ``< e`` (1/G'), K and V, per dense layer and query chunk (replicated: also per sparse layer
      in the query chunks it attends densely);
    * activations: 4 ``[chunk, hidden]`` bf16 copies per layer (residual, normed input, attention output, MLP
      output), and per MoE layer the blockwise rows the rank's experts get (:func:`_moe_rows_read`), tokens in,
      gate/up, out. G' = 1 replicated, G sharded."""
    g = parallel.kv_group_size(c, tp, layout)
    kvb = BF16 if kv_dtype == "bf16" else 1
    kv, bs, n_sparse = _heads(c, c.num_kv_heads, tp), c.index_block_size, sum(c.sparse_layers)
    e = min(start + chunk, seq)
    qc = chunk if layout == "sharded" else prefill_tile(c, seq)
    index_k = gathered = dense = 0
    for t0 in range(start, e, qc):  # the port's query chunks (one for a sharded call)
        t1 = min(t0 + qc, e)
        index_k += -(-t1 // g) * c.index_head_dim * kvb * n_sparse
        keys = -(-t1 // g) * 2 * kv * c.head_dim * kvb  # K and V of the keys < t1, this rank's share
        if layout == "replicated" and -(-t1 // bs) <= c.index_topk:  # every block selected: attended densely
            dense += keys * c.num_layers
            continue
        gathered += (t1 - t0) * min(c.index_topk, -(-t1 // bs)) * -(-bs // g) * 2 * kv * c.head_dim * kvb * n_sparse
        dense += keys * (c.num_layers - n_sparse)
    moe_width = 2 * c.hidden_size + 2 * c.intermediate_size // parallel.moe_tp(tp, ep)
    return {
        "weights": sum(weights_read(c, tp, ep, chunk, weights).values()),
        "index-K": index_k,
        "gathered K/V": gathered,
        "dense K/V": dense,
        "activations": (4 * chunk * c.hidden_size * BF16 * c.num_layers
                        + _moe_rows_read(c, ep, chunk, moe_block) * moe_width * BF16 * sum(c.moe_layers)),
    }


def collectives(c: M3Config, tp: int, ep: int, tokens: int, layout: str = "sharded", logit_rows: int | None = None,
                phase: str = "decode", chunked: bool = True, row_tokens: int = 1, dcp: int = 1) -> list[dict]:
    """The collectives of one forward pass over ``tokens`` tokens (a decode step at batch b: b, ``phase="decode"``;
    a speculative verify step: ``b x (k + 1)`` with ``row_tokens = k + 1``, ``phase="decode"``; a sharded prefill
    call: C, ``phase="prefill"``), one row each: ``name``, ``kind``, ``ranks`` (the group it runs over), ``dtype``,
    ``bytes`` (the full buffer on each rank: an all-gather's output, a reduce-scatter's input, an all-reduce's
    buffer, an all-to-all's input) and ``count`` (how many run per pass: the layers it runs in).

    The port's layouts (``sharded``, ``replicated``): the embedding's all-gather (NxD's embedding is sharded along
    the hidden size), bf16 ``[T, hidden]``, once per pass; the attention output projection's all-reduce and the
    MLP's (experts + shared expert, or the dense MLP) over all ``tp`` ranks, bf16 ``[T, hidden]``; the LM head's
    logits all-gather, bf16 (the model's dtype: the cast to fp32 comes after it) ``[logit_rows, vocab padded to
    tp]``, once per pass (``logit_rows`` defaults to ``tokens``: a verify step returns every token's logits; a
    prefill call's is its rows' last tokens). As the traced graphs have them (``test/hlo/test_sharded_graphs.py``,
    ``test/hlo/test_verify_graph.py``).
    ``paged`` (the vLLM Neuron model: the reference's layers, ``reference.parallel``'s collectives): the same two
    all-reduces per layer; the vocabulary-parallel embedding's all-reduce (bf16 ``[T, hidden]``) instead of an
    all-gather, and the logits gathered in fp32 (``M3Model.logits`` casts before it gathers) for ``logit_rows`` rows
    (the forward computes them for vLLM's ``sampling_positions`` only); KV heads replicated per group, so
    a prefill segment's index selection is split by query over a group's G ranks and the block ids all-gathered
    (int64 ``[T / G, K]`` from each of the ``tp`` ranks) in each sparse layer (``ops.QuerySplit``).
    Sharded, per attention layer, within the G ranks of a KV group (the port's step, ``ops.attention_step``, whose
    ``COLLECTIVES`` names them): the group's query heads all-gathered (bf16 ``[T, qg, d]``), in a decode or verify
    step's sparse layers (fewer than ``ops.step.ONE_GATHER_TOKENS`` tokens per row) packed with the
    selection candidates into ONE fp32 all-gather (``[G, T, qg/G * d + iq * K * 2]``); a prefill call's sparse
    layers (and a step of more tokens per row) gather the candidates apart (fp32 ``[G, T, iq, K, 2]``: local top-K
    scores and block ids, exact below 2^24); then one all-to-all by head of the partial outputs with their softmax
    max and sum (fp32 ``[T, qg, d + 2]``). The index queries need none: every rank of a group projects its group's
    index head. A prefill call of a prompt taken in one call (``chunked=False``) runs its dense layers on the rank
    alone (the call's own keys: NxDI's flash kernel), without the group's collectives.
    ``paged`` with ``dcp`` > 1 (vLLM's decode context parallelism: ``dcp`` ranks of a KV head, each holding whole
    blocks of its pages): the sharded layout's group collectives (``ops.step.COLLECTIVES``) over those ``dcp`` ranks,
    ``qg`` their query heads, in every attention layer of a decode step or prefill segment (every key in the pages),
    and no query split of a segment's selection (the model runs none under DCP)."""
    n_sparse = sum(c.sparse_layers)
    h, d, L = c.hidden_size, c.head_dim, c.num_layers
    kv, iq, g = _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp), parallel.kv_group_size(c, tp)
    qg = c.q_per_kv * kv
    if layout == PAGED and dcp > 1:  # the group's step over the DCP ranks
        g, qg = dcp, _heads(c, c.num_heads, tp) * dcp
    rows = []
    if (layout == "sharded" or layout == PAGED and dcp > 1) and g > 1:
        queries = dict(name="group queries", kind="all-gather", ranks=g, dtype="bf16", bytes=tokens * qg * d * BF16)
        grouped = L if phase == "decode" or chunked else n_sparse  # layers that run the group's step
        if phase == "decode" and row_tokens < ONE_GATHER_TOKENS:
            rows += [dict(queries, count=L - n_sparse),
                     dict(name="group queries + selection candidates", kind="all-gather", ranks=g, dtype="fp32",
                          bytes=tokens * (qg * d + g * iq * c.index_topk * 2) * FP32, count=n_sparse)]
        else:
            rows += [dict(queries, count=grouped),
                     dict(name="selection candidates", kind="all-gather", ranks=g, dtype="fp32",
                          bytes=tokens * iq * g * c.index_topk * 2 * FP32, count=n_sparse)]
        rows.append(dict(name="partial outputs + max + sum", kind="all-to-all", ranks=g, dtype="fp32",
                         bytes=tokens * qg * (d + 2) * FP32, count=grouped))
    paged = layout == PAGED
    if paged and dcp == 1 and phase == "prefill" and QuerySplit.splits(tokens, g):
        # a segment's index selection split by query over the g ranks holding a KV head (ops.QuerySplit): one
        # all-gather of the int64 block ids [T / g, K] per sparse layer, over the TP group
        rows.append(dict(name="selection ids (queries split over a KV head's ranks)", kind="all-gather", ranks=tp,
                         dtype="int64", bytes=tokens // g * iq * c.index_topk * 8 * tp, count=n_sparse))
    logit_bytes = FP32 if paged else BF16
    rows = [dict(name="embedding", kind="all-reduce" if paged else "all-gather", ranks=tp, dtype="bf16",
                 bytes=tokens * h * BF16, count=1),
            *rows,
            dict(name="attention output", kind="all-reduce", ranks=tp, dtype="bf16", bytes=tokens * h * BF16, count=L),
            dict(name="MLP / MoE output", kind="all-reduce", ranks=tp, dtype="bf16", bytes=tokens * h * BF16, count=L),
            dict(name="LM head logits", kind="all-gather", ranks=tp, dtype="fp32" if paged else "bf16",
                 bytes=(tokens if logit_rows is None else logit_rows) * -(-c.vocab_size // tp) * tp * logit_bytes,
                 count=1)]
    return [r for r in rows if r["ranks"] > 1 and r["count"] > 0]


def link_seconds(row: dict) -> float:
    """Link time of one collective of :func:`collectives` (ring algorithm at ``LINK_BYTES_PER_S``)."""
    n = row["ranks"]
    sent = row["bytes"] * (n - 1) / n * (2 if row["kind"] == "all-reduce" else 1)  # all-to-all: (n-1)/n leaves
    return sent / LINK_BYTES_PER_S


@dataclass(frozen=True)
class Ttft:
    """A TTFT estimate: ``calls`` prefill calls of ``chunk`` tokens; the sums over calls of the FLOP, HBM and link
    times and of their per-call maximum (``bound_s``), and ``collectives`` x ``COLLECTIVE_LATENCY_S``."""
    calls: int
    chunk: int
    flop_s: float
    hbm_s: float
    link_s: float
    bound_s: float
    collectives: int
    latency_s: float

    @property
    def total_s(self) -> float:
        return self.bound_s + self.latency_s


def ttft(c: M3Config, tp: int, ep: int, seq: int, layout: str = "sharded", chunk: int | None = None,
         weights: str = "bf16", kv_dtype: str = "bf16", latency_s: float = COLLECTIVE_LATENCY_S) -> Ttft:
    """The TTFT estimate of a ``seq``-token prompt (module docstring). Sharded: ``chunk`` tokens per call (a valid
    chunk, e.g. ``plan(...).chunk``); replicated: one call of the bucket's tokens (the prompt padded to it). Not
    modelled for the paged layout (its segments' FLOPs and bytes: one :class:`PlanError`)."""
    if layout == PAGED:
        raise PlanError("a TTFT estimate is not modelled for the paged layout (the vLLM Neuron model's segments)")
    if layout == "sharded":
        calls = [(k, chunk) for k in range(0, seq, chunk)]
        flops = [sum(chunk_flops(c, tp, ep, k, n, seq).values()) for k, n in calls]
    else:
        s = cache_tokens(c, tp, seq, layout)
        calls, flops = [(0, s)], [sum(prefill_flops(c, tp, ep, 1, s).values())]
        seq, chunk = s, s
    hbm = [sum(chunk_bytes(c, tp, ep, k, n, seq, weights, kv_dtype, layout).values()) / HBM_BYTES_PER_S
           for k, n in calls]
    rows = collectives(c, tp, ep, chunk, layout, logit_rows=1, phase="prefill", chunked=len(calls) > 1)
    link = sum(link_seconds(r) * r["count"] for r in rows)
    times = [(f / PEAK_FLOPS_PER_S, b, link) for f, b in zip(flops, hbm)]
    n_coll = sum(r["count"] for r in rows) * len(calls)
    return Ttft(len(calls), chunk, sum(t[0] for t in times), sum(hbm), link * len(calls),
                sum(max(t) for t in times), n_coll, n_coll * latency_s)
