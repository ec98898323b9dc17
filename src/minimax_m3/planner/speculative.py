"""Speculative decoding's projection: tokens per second per sequence with an EAGLE3 draft in NxDI's fused graph (the
port's ``--fused-speculation``, ``neuron.eagle``), against plain decode.

A step's time, per rank: ``max(bytes / HBM, FLOPs / peak) + collectives x 25 µs`` (the figures of :mod:`.cost`;
the decode floor of :func:`.cost.decode_floor_ms` plus the fixed latency of the step's collectives, which the floor
leaves out and which a step cannot overlap).

* plain decode at batch b: :func:`.cost.decode_minimum_bytes` for b tokens, their FLOPs (:func:`step_flops`) and
  :func:`.cost.collectives` of b tokens (host sampling: the logits all-gathered); one token per sequence.
* a fused step at batch b with k drafts, the parts the traced fused graph has (``test/hlo/test_fused_graph.py``,
  docs/speculative.md "The fused graph at real widths"):

  - the target's verify of ``b`` rows x ``k + 1`` tokens (:func:`target_step` with ``tokens = k + 1``:
    :func:`.cost.decode_minimum_bytes`, the weights read once for all of them, each row's dense K/V and index keys
    once for its ``k + 1`` queries, the selected K/V blocks per query; its FLOPs per token; the verify's
    :func:`.cost.collectives` with on-device sampling: no logits all-gather, the sampler's distributed top-k
    instead, :data:`SAMPLER_COLLECTIVES`);
  - the draft (:func:`draft_part`): ``k`` one-token steps in sequence, each reading the whole draft layer and its
    head (fc only in the first: later steps feed the draft's own state) and its K/V cache over the whole context
    bucket, then a catch-up over the ``k + 1`` verified tokens reading fc, k, v and the input and hidden norms
    (:data:`CATCH_UP`; it writes the draft's K/V, reads no cache); the target states, one ``3 x hidden`` row per
    sequence; the embedding rows. The head is the FULL vocabulary (``V x H`` and a bias, sharded over TP): the port
    folds a reduced draft vocabulary into it (``neuron.eagle``), so ``draft_vocab_size`` costs nothing here. The
    attention heads as NxDI shards them (:func:`draft_heads`). Collectives: :data:`DRAFT_STEP_COLLECTIVES` per draft
    step and :data:`DRAFT_EXTRA_COLLECTIVES` per fused step.

  It yields the acceptance length ``a`` (1 <= a <= k + 1) tokens per sequence.

tokens/s/sequence = ``a / (target + draft)`` against ``1 / plain``. Nothing here ran on Trainium: arithmetic from the
config, the published figures and an assumed draft (:data:`M3_DRAFT`) unless a draft's config is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import parallel
from ..config.draft import DraftConfig
from ..config.m3 import M3Config
from .cost import COLLECTIVE_LATENCY_S, PEAK_FLOPS_PER_S, Itl, _per_token_flops, collectives, decode_minimum_bytes, \
    step_itl
from .base import BF16, HBM_BYTES_PER_S, PORT_LAYOUT, _heads, cache_tokens

# An assumed draft for MiniMax-M3 when none is given: the published EAGLE3 head is a one-layer Llama fed by the
# target's hidden size with MHA attention (docs/notes/m3_model_and_formats.md §3.4); its heads, MLP width and draft
# vocabulary are assumptions here (64 x 128, 16384, 32000). The draft vocabulary does not enter the projection: the
# port folds it into a full-vocabulary head (module docstring).
M3_DRAFT = DraftConfig(hidden_size=6144, num_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=16384,
                       vocab_size=200064, draft_vocab_size=32000, target_hidden_size=6144)
ACCEPTANCE = (1.5, 2.0, 2.5, 3.0, 3.5)
ITL_K, ITL_ACCEPTANCE = 3, 2.5  # the fused step of `minimax-m3 plan`'s ITL line: 3 drafts, 2.5 accepted on average
BATCHES = (1, 2, 4, 8, 16, 32)
# the fused graph's collectives as traced (test/hlo/test_fused_graph.py, TP 64, 2026-12-02). Per draft step: the
# embedding all-gather, the attention and MLP all-reduces, NxD's distributed argmax (each rank's max and index,
# 2 all-gathers)
DRAFT_STEP_COLLECTIVES = 5
DRAFT_EXTRA_COLLECTIVES = 3  # per fused step: fc's output all-gather in the first step and in the catch-up, the
#                              catch-up's embedding all-gather
# the target's on-device sampler: NxD's 3-stage distributed top-k, (values, ids) all-gathered per stage (traced with
# NxD's TopK path, the stand-in for the NKI top-k kernel, whose collectives on trn2 may differ)
SAMPLER_COLLECTIVES = 6
CATCH_UP = ("fc", "k", "v", "input norm", "hidden norm")  # the draft tensors the catch-up reads (its K/V side)


@dataclass(frozen=True)
class StepCost:
    """One forward per rank: bytes read, FLOPs, collectives (each at ``latency_s``)."""
    bytes: int
    flops: int
    collectives: int
    latency_s: float = COLLECTIVE_LATENCY_S

    @property
    def seconds(self) -> float:
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / PEAK_FLOPS_PER_S) + self.collectives * self.latency_s


def step_flops(c: M3Config, tp: int, ep: int, tokens: int, bucket: int) -> int:
    """Dot FLOPs per rank of a decode-like step over ``tokens`` tokens each attending to a ``bucket``-token context:
    the per-token projections (:func:`.cost._per_token_flops`), the routed experts (``top_k`` of them, spread over
    the ``tp`` ranks), sparse attention over ``topk x block`` keys and dense attention over the context
    (``x head_dim x 4`` per query head), the indexer's scores over the context, and the LM head."""
    q, iq = _heads(c, c.num_heads, tp), _heads(c, c.index_heads, tp)
    n_sparse, n_moe = sum(c.sparse_layers), sum(c.moe_layers)
    keys = n_sparse * min(c.index_topk * c.index_block_size, bucket) + (c.num_layers - n_sparse) * bucket
    per_token = (_per_token_flops(c, tp) + c.top_k * 6 * c.hidden_size * c.intermediate_size * n_moe // tp
                 + q * c.head_dim * 4 * keys + iq * bucket * c.index_head_dim * 2 * n_sparse
                 + 2 * c.hidden_size * -(-c.vocab_size // tp))
    return tokens * per_token


def target_step(c: M3Config, tp: int, ep: int, batch: int, seq: int, weights: str = "bf16", kv_dtype: str = "bf16",
                layout: str = PORT_LAYOUT, tokens: int = 1, sampler: bool = False,
                latency_s: float = COLLECTIVE_LATENCY_S) -> StepCost:
    """A target forward over ``batch`` rows of ``tokens`` tokens each (plain decode: 1; a verify step: ``k + 1``);
    ``sampler``: with on-device sampling (the fused graph's): the logits all-gather replaced by the sampler's
    :data:`SAMPLER_COLLECTIVES`."""
    bucket = cache_tokens(c, tp, seq, layout)
    b = decode_minimum_bytes(c, tp, ep, batch, bucket, weights, kv_dtype, layout=layout, tokens=tokens)
    rows = collectives(c, tp, ep, batch * tokens, layout, row_tokens=tokens)
    n = sum(r["count"] for r in rows if not (sampler and r["name"] == "LM head logits"))
    return StepCost(sum(b.values()), step_flops(c, tp, ep, batch * tokens, bucket),
                    n + (SAMPLER_COLLECTIVES if sampler else 0), latency_s)


def draft_heads(dc: DraftConfig, tp: int) -> tuple[int, int]:
    """Query and KV heads per rank as NxDI's GQA module shards the draft's attention: the query heads padded to a
    multiple of ``tp``; the KV heads of an MHA draft as the queries; of a GQA draft ``kv / tp`` where ``tp`` divides
    them, one where they divide ``tp`` (REPLICATE_TO_TP_DEGREE), else as the padded queries (CONVERT_TO_MHA). 48 MHA
    heads at TP 64: one of each per rank (the traced graph's)."""
    q, kv = -(-dc.num_heads // tp), parallel.heads_per_rank(dc.num_kv_heads, tp)
    return (q, q) if dc.num_kv_heads == dc.num_heads or not kv else (q, kv)


def draft_tensors(dc: DraftConfig, tp: int) -> dict[str, int]:
    """Elements per rank of each draft tensor as the fused graph holds them (the embedding aside: read by rows):
    fc ``[H / tp, 3 x target hidden]``; q, k, v ``[heads x d, 2H]``; o ``[H, q x d]``; gate, up, down over
    ``I / tp``; 4 norms ``[H]``; the full-vocabulary head ``[V / tp, H]`` and its bias (the folded ``d2t``)."""
    h, d = dc.hidden_size, dc.head_dim
    q, kv = draft_heads(dc, tp)
    rows = -(-dc.vocab_size // tp)
    return {"fc": -(-h // tp) * 3 * dc.target_hidden_size, "q": q * d * 2 * h, "k": kv * d * 2 * h,
            "v": kv * d * 2 * h, "o": h * q * d, "mlp": 3 * h * -(-dc.intermediate_size // tp), "input norm": h,
            "hidden norm": h, "post-attention norm": h, "final norm": h, "lm_head": rows * h, "lm_head bias": rows}


def draft_reads(dc: DraftConfig, tp: int, batch: int, bucket: int, k: int) -> dict[str, int]:
    """Bytes the draft reads per rank and fused step (bf16): ``weights``: every tensor but fc in each of the ``k``
    steps, fc in the first, :data:`CATCH_UP` in the catch-up, the embedding's rows (``H / tp`` wide) of ``k x batch``
    + ``(k + 1) x batch`` tokens; ``kv``: K and V of the whole ``bucket`` in each step; ``states``: one
    ``3 x target hidden`` target state per row."""
    t = draft_tensors(dc, tp)
    elements = k * sum(v for n, v in t.items() if n != "fc") + t["fc"] + sum(t[n] for n in CATCH_UP)
    rows = (k * batch + (k + 1) * batch) * -(-dc.hidden_size // tp)
    return {"weights": (elements + rows) * BF16,
            "kv": k * batch * 2 * draft_heads(dc, tp)[1] * dc.head_dim * bucket * BF16,
            "states": batch * 3 * dc.target_hidden_size * BF16}


def draft_flops(dc: DraftConfig, tp: int, batch: int, bucket: int, k: int) -> int:
    """Dot FLOPs per rank of the draft per fused step (2 x tokens x a weight's elements): each step's q, k, v, o, MLP
    and head for ``batch`` tokens and its attention over the bucket and its own key (``x head_dim x 4`` per query
    head), fc in the first step, fc, k and v for the catch-up's ``batch x (k + 1)`` tokens (RoPE's angles aside)."""
    t, q = draft_tensors(dc, tp), draft_heads(dc, tp)[0]
    step = 2 * batch * sum(t[n] for n in ("q", "k", "v", "o", "mlp", "lm_head")) + \
        batch * q * dc.head_dim * 4 * (bucket + 1)
    return k * step + 2 * batch * t["fc"] + 2 * batch * (k + 1) * (t["fc"] + t["k"] + t["v"])


def draft_part(dc: DraftConfig, tp: int, batch: int, bucket: int, k: int, latency_s: float = COLLECTIVE_LATENCY_S
               ) -> StepCost:
    """The draft's part of one fused step for ``batch`` sequences over a ``bucket``-token context: ``k`` draft steps
    and the catch-up (:func:`draft_reads`, :func:`draft_flops`, the collectives as traced)."""
    return StepCost(sum(draft_reads(dc, tp, batch, bucket, k).values()), draft_flops(dc, tp, batch, bucket, k),
                    k * DRAFT_STEP_COLLECTIVES + DRAFT_EXTRA_COLLECTIVES, latency_s)


@dataclass(frozen=True)
class Projection:
    batch: int
    plain: StepCost
    verify: StepCost  # the fused step's target part
    draft: StepCost  # the fused step's draft part: k draft steps and the catch-up
    k: int

    @property
    def plain_tokens_per_s(self) -> float:
        return 1.0 / self.plain.seconds

    def tokens_per_s(self, acceptance: float) -> float | None:
        """Per sequence, at a mean acceptance length (None where ``k`` drafts cannot reach it)."""
        if not 1.0 <= acceptance <= self.k + 1:
            return None
        return acceptance / (self.verify.seconds + self.draft.seconds)


def project(c: M3Config, tp: int, ep: int, seq: int, k: int, weights: str = "bf16", kv_dtype: str = "bf16",
            draft: DraftConfig = M3_DRAFT, batches=BATCHES, layout: str = PORT_LAYOUT,
            latency_s: float = COLLECTIVE_LATENCY_S) -> list[Projection]:
    """Plain and fused speculative steps at each batch, ``latency_s`` per collective."""
    bucket = cache_tokens(c, tp, seq, layout)
    return [Projection(b, target_step(c, tp, ep, b, seq, weights, kv_dtype, layout, latency_s=latency_s),
                       target_step(c, tp, ep, b, seq, weights, kv_dtype, layout, tokens=k + 1, sampler=True,
                                   latency_s=latency_s),
                       draft_part(draft, tp, b, bucket, k, latency_s), k) for b in batches]


def fused_itl(c: M3Config, tp: int, ep: int, batch: int, seq: int, k: int = ITL_K, weights: str = "bf16",
              kv_dtype: str = "bf16", draft: DraftConfig = M3_DRAFT, layout: str = PORT_LAYOUT,
              latency_s: float = COLLECTIVE_LATENCY_S) -> Itl:
    """The ITL estimate of one fused step (:func:`.cost.step_itl`, the plain step's formula): the bytes of the
    target's verify of ``batch`` rows x ``k + 1`` tokens and of the draft's part (:func:`draft_reads`); the verify's
    :func:`.cost.collectives` but the logits all-gather (on-device sampling), each the larger of ``latency_s`` and
    its link time; the sampler's and the draft's collectives (:data:`SAMPLER_COLLECTIVES`,
    :data:`DRAFT_STEP_COLLECTIVES` per draft step, :data:`DRAFT_EXTRA_COLLECTIVES`; buffers of ``batch`` to
    ``batch x (k + 1)`` rows) at ``latency_s``. A sequence gains its mean acceptance length per step: ms per token =
    ``total_s`` / that length."""
    v = target_step(c, tp, ep, batch, seq, weights, kv_dtype, layout, tokens=k + 1, sampler=True)
    d = draft_part(draft, tp, batch, cache_tokens(c, tp, seq, layout), k)
    rows = [r for r in collectives(c, tp, ep, batch * (k + 1), layout, row_tokens=k + 1)
            if r["name"] != "LM head logits"]
    return step_itl(v.bytes + d.bytes, rows, latency_s, SAMPLER_COLLECTIVES + d.collectives)


def format_projection(rows: list[Projection], seq: int, weights: str, acceptance=ACCEPTANCE) -> str:
    k = rows[0].k
    head = "".join(f"{f'a={a}':>14}" for a in acceptance)
    lines = [f"speculative decoding, k={k} drafts, {seq} tokens, {weights} experts: tokens/s per sequence (x plain) "
             "at mean acceptance length a",
             f"(per rank: step = max(HBM, FLOP) + collectives x {rows[0].plain.latency_s * 1e6:g} us; NxDI's fused "
             f"step: the target verifies b x {k + 1} tokens, reading the weights once and each row's dense K/V and "
             f"index keys once, sampling on device; the draft runs {k} steps, each its layer, a full-vocabulary head "
             "(a draft vocabulary folded in) and its K/V of the whole bucket, and a catch-up)",
             f"{'batch':>5} {'plain ms':>9} {'verify ms':>9} {'draft ms':>8} {'plain t/s':>9}{head}"]
    for r in rows:
        cells = ""
        for a in acceptance:
            t = r.tokens_per_s(a)
            cells += f"{'-':>14}" if t is None else f"{t:8.1f} ({t / r.plain_tokens_per_s:.2f}x)"
        lines.append(f"{r.batch:>5} {r.plain.seconds * 1e3:9.2f} {r.verify.seconds * 1e3:9.2f} "
                     f"{r.draft.seconds * 1e3:8.2f} {r.plain_tokens_per_s:9.1f}{cells}")
    return "\n".join(lines)
