"""Speculative decoding's projection: tokens per second per sequence with an EAGLE3 draft, against plain decode.

A step's time, per rank: ``max(bytes / HBM, FLOPs / peak) + collectives x 25 µs`` (the figures of :mod:`.cost`;
the decode floor of :func:`.cost.decode_floor_ms` plus the fixed latency of the step's collectives, which the floor
leaves out and which a step cannot overlap).

* plain decode at batch b: :func:`.cost.decode_minimum_bytes` for b tokens, their FLOPs (:func:`step_flops`) and
  :func:`.cost.collectives` of b tokens; one token per sequence.
* a speculative step at batch b with k drafts: ONE verify step of ``b`` rows x ``k + 1`` tokens
  (:func:`.cost.decode_minimum_bytes` with ``tokens = k + 1``: the weights read once for all of them, each row's
  dense K/V and index keys once for its ``k + 1`` queries, the selected K/V blocks per query; its FLOPs per token;
  :func:`.cost.collectives` of ``b x (k + 1)`` tokens, 2 per layer in the KV group as in decode: the graph's, in
  ``test/hlo/test_verify_graph.py``) plus ``k`` draft steps (:func:`draft_step`: the draft layer's weights and its
  KV cache of the context, 3 collectives each); it yields the acceptance length ``a`` (1 <= a <= k + 1) tokens per
  sequence.

tokens/s/sequence = ``a / (verify + k x draft)`` against ``1 / plain``. Nothing here ran on Trainium: arithmetic from
the config, the published figures and an assumed draft (:data:`M3_DRAFT`) unless a draft's config is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import sharding
from ..config.draft import DraftConfig
from ..config.m3 import M3Config
from .cost import COLLECTIVE_LATENCY_S, PEAK_FLOPS_PER_S, _per_token_flops, collectives, decode_minimum_bytes
from .memory import BF16, HBM_BYTES_PER_S, PORT_LAYOUT, _heads, cache_tokens

# An assumed draft for MiniMax-M3 when none is given: the published EAGLE3 head is a one-layer Llama fed by the
# target's hidden size with MHA attention (docs/m3_model_and_formats.md §3.4); its heads, MLP width and draft
# vocabulary are assumptions here (64 x 128, 16384, 32000). Its weights are 0.4 % of a rank's fp8 weights at TP 64.
M3_DRAFT = DraftConfig(hidden_size=6144, num_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=16384,
                       vocab_size=200064, draft_vocab_size=32000, target_hidden_size=6144)
ACCEPTANCE = (1.5, 2.0, 2.5, 3.0, 3.5)
BATCHES = (1, 2, 4, 8, 16, 32)
DRAFT_COLLECTIVES = 3  # per draft step: the attention and MLP all-reduces, the logits all-gather


@dataclass(frozen=True)
class StepCost:
    """One forward per rank: bytes read, FLOPs, collectives."""
    bytes: int
    flops: int
    collectives: int

    @property
    def seconds(self) -> float:
        return max(self.bytes / HBM_BYTES_PER_S, self.flops / PEAK_FLOPS_PER_S) + self.collectives * \
            COLLECTIVE_LATENCY_S


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
                layout: str = PORT_LAYOUT, tokens: int = 1) -> StepCost:
    """A target forward over ``batch`` rows of ``tokens`` tokens each (plain decode: 1; a verify step: ``k + 1``)."""
    bucket = cache_tokens(c, tp, seq, layout)
    b = decode_minimum_bytes(c, tp, ep, batch, bucket, weights, kv_dtype, layout=layout, tokens=tokens)
    n = sum(r["count"] for r in collectives(c, tp, ep, batch * tokens, layout, row_tokens=tokens))
    return StepCost(sum(b.values()), step_flops(c, tp, ep, batch * tokens, bucket), n)


def draft_step(dc: DraftConfig, tp: int, batch: int, seq: int) -> StepCost:
    """One draft forward for ``batch`` sequences: the draft layer's weights sharded over ``tp`` (fc, q/k/v over
    2 x hidden, o, the MLP, its lm_head; the embedding rows of the batch), its bf16 KV cache of ``seq`` positions
    per sequence, and ``DRAFT_COLLECTIVES`` collectives."""
    h, d, i = dc.hidden_size, dc.head_dim, dc.intermediate_size
    q, kv = sharding.heads_per_rank(dc.num_heads, tp) or 1, sharding.heads_per_rank(dc.num_kv_heads, tp) or 1
    params = (3 * dc.target_hidden_size * h // tp + 2 * h * (q + 2 * kv) * d + q * d * h + 3 * h * i // tp
              + -(-dc.draft_vocab_size // tp) * h)
    state = batch * seq * 2 * kv * d * BF16
    flops = batch * (2 * params + q * d * 4 * seq)
    return StepCost(params * BF16 + batch * h * BF16 + state, flops, DRAFT_COLLECTIVES)


@dataclass(frozen=True)
class Projection:
    batch: int
    plain: StepCost
    verify: StepCost
    draft: StepCost
    k: int

    @property
    def plain_tokens_per_s(self) -> float:
        return 1.0 / self.plain.seconds

    def tokens_per_s(self, acceptance: float) -> float | None:
        """Per sequence, at a mean acceptance length (None where ``k`` drafts cannot reach it)."""
        if not 1.0 <= acceptance <= self.k + 1:
            return None
        return acceptance / (self.verify.seconds + self.k * self.draft.seconds)


def project(c: M3Config, tp: int, ep: int, seq: int, k: int, weights: str = "bf16", kv_dtype: str = "bf16",
            draft: DraftConfig = M3_DRAFT, batches=BATCHES, layout: str = PORT_LAYOUT) -> list[Projection]:
    """Plain and speculative steps at each batch."""
    return [Projection(b, target_step(c, tp, ep, b, seq, weights, kv_dtype, layout),
                       target_step(c, tp, ep, b, seq, weights, kv_dtype, layout, tokens=k + 1),
                       draft_step(draft, tp, b, seq), k) for b in batches]


def format_projection(rows: list[Projection], seq: int, weights: str, acceptance=ACCEPTANCE) -> str:
    k = rows[0].k
    head = "".join(f"{f'a={a}':>14}" for a in acceptance)
    lines = [f"speculative decoding, k={k} drafts, {seq} tokens, {weights} experts: tokens/s per sequence (x plain) "
             "at mean acceptance length a",
             f"(per rank: step = max(HBM, FLOP) + collectives x {COLLECTIVE_LATENCY_S * 1e6:.0f} us; a verify step "
             f"reads the weights once for b x {k + 1} tokens, each row's dense K/V and index keys once)",
             f"{'batch':>5} {'plain ms':>9} {'verify ms':>9} {'draft ms':>8} {'plain t/s':>9}{head}"]
    for r in rows:
        cells = ""
        for a in acceptance:
            t = r.tokens_per_s(a)
            cells += f"{'-':>14}" if t is None else f"{t:8.1f} ({t / r.plain_tokens_per_s:.2f}x)"
        lines.append(f"{r.batch:>5} {r.plain.seconds * 1e3:9.2f} {r.verify.seconds * 1e3:9.2f} "
                     f"{k * r.draft.seconds * 1e3:8.2f} {r.plain_tokens_per_s:9.1f}{cells}")
    return "\n".join(lines)
