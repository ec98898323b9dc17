"""Capacity planner: per-rank HBM for a TP x EP layout, before anyone spends two hours compiling.

``minimax-m3 plan --tp 64 --ep 64 --batch 32 --seq 8192 [--weights bf16|fp8]`` prints, for one rank (a logical
NeuronCore; trn2.48xlarge at LNC=2 has 64 of them with 24 GiB HBM each), the bytes of

* **weights**: embedding and LM head sharded over TP (vocab padded to a multiple of TP); attention with
  ``num_heads / tp`` query heads and the KV heads split or replicated to TP (NxDI's ``REPLICATE_TO_TP_DEGREE``:
  at TP=64 every rank holds one of the 4 KV heads); the indexer's query projection like the KV heads (rank r
  needs only index head r // 16) and its single index-key head on every rank; dense MLPs and the shared expert
  TP-sharded; routers (fp32, on every rank); routed experts ``num_experts / ep`` per rank, each sharded over
  ``moe_tp = tp / ep``. ``--weights fp8`` stores routed experts in NxD's expert-wise per-channel e4m3 layout
  (``checkpoint.fp8_experts``: 1 byte per weight + one fp32 scale per output channel of each local expert),
  everything else bf16.
* **KV cache**: ``batch x seq`` tokens (seq rounded up to the indexer block) x layers x K and V of this rank's
  KV heads.
* **index-K cache**: ``batch x seq`` tokens x sparse layers x one index key (replicated on every rank).
* **prefill working memory**, the peak of one context-encoding pass of ``ctx_batch x seq`` tokens (``ctx_batch``
  1 by default: the neuron engine prefills one request per call, continuous batching at any batch; ``--ctx-batch
  B`` models static batching, ``continuous_batching=False``): hidden
  states (4 live copies, replicated without sequence parallelism), this rank's projections and the prefill
  logits, plus the larger of the two phases a layer runs one after the other (:func:`prefill_phases`):
  **attention**, one query chunk of exactly the port's prefill (``ops.prefill.chunk_for`` with the port's
  ``PREFILL_CHUNKS`` / ``PREFILL_MAX_CHUNK``; memory O(chunk x S), never O(S^2)), and **MoE**, router scores and
  NxDI's blockwise-MoE buffers (``ceil(T k / block) + local_experts - 1`` blocks of ``block`` rows: gathered
  tokens, gate/up, output).
* a **runtime reserve** (scratchpad, instructions, runtime; an assumption, 3 GiB unless told).

It is arithmetic from the config, not a measurement: nothing here has run on Trainium. Pure Python/torch; it
imports nothing from NxDI.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .config import sharding
from .config.m3 import M3Config
from .errors import M3Error
from .ops.prefill import PREFILL_CHUNKS, PREFILL_MAX_CHUNK, chunk_for

GIB = 1024 ** 3
HBM_PER_RANK_GIB = 24.0  # trn2 at LNC=2: one logical core's share of HBM
BF16, FP32 = 2, 4
INT64 = 8  # block ids of the selection
FP8 = 1  # e4m3 routed-expert weight; plus an fp32 scale per expert and output channel (checkpoint.fp8_experts)
HBM_BYTES_PER_S = 725e9  # one logical core's share of trn2 HBM bandwidth at LNC=2 (docs/perf_anchors.md)
SHARD_ON_I_MULTIPLE = 256  # NxDI SHARD_ON_INTERMEDIATE_DIMENSION_PER_TP (pads I/moe_tp with shard-on-I kernels)


class PlanError(M3Error, ValueError):
    """A layout the model cannot be sharded into."""


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
    chunk: int = 0  # queries per prefill chunk (what the port's attention runs at this length)
    phases: tuple[tuple[str, int], ...] = ()  # prefill_phases(): attention chunk and MoE bytes, the larger counted

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.index_k_bytes + self.prefill_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes


def _heads(c: M3Config, heads: int, tp: int) -> int:
    """Heads per rank (``sharding.heads_per_rank``); a split that does not fit is one PlanError with every problem."""
    n = sharding.heads_per_rank(heads, tp)
    if not n:
        raise PlanError(sharding.model_problems(c, tp, 1) or [f"{heads} heads do not fit tp {tp}"])
    return n


def weight_bytes(c: M3Config, tp: int, ep: int, weights: str = "bf16") -> tuple[int, dict[str, int]]:
    """Per-rank weight bytes and their breakdown."""
    problems = sharding.layout_problems(c, tp, ep)
    if problems:
        raise PlanError(problems)
    moe_tp = sharding.moe_tp(tp, ep)
    h, d, di = c.hidden_size, c.head_dim, c.index_head_dim
    q = sharding.heads_per_rank(c.num_heads, tp)
    kv = sharding.heads_per_rank(c.num_kv_heads, tp)
    iq = sharding.heads_per_rank(c.index_heads, tp)
    n_moe = sum(c.moe_layers)
    n_sparse = sum(c.sparse_layers)
    vocab = -(-c.vocab_size // tp) * tp
    i_rank = c.intermediate_size // moe_tp
    local = sharding.local_experts(c.num_experts, ep)
    experts = n_moe * local * 3 * h * i_rank * (FP8 if weights == "fp8" else BF16)
    if weights == "fp8":  # scales [E, 1, 2I/moe_tp] (gate/up, sharded with its columns) and [E, 1, H] (down)
        experts += n_moe * local * (2 * i_rank + h) * FP32
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
    return sum(parts.values()), parts


def prefill_chunk(c: M3Config, seq: int, chunks: int = PREFILL_CHUNKS, max_chunk: int = PREFILL_MAX_CHUNK) -> int:
    """Queries per chunk of a ``seq``-token prefill: the port's own rule (``ops.prefill.chunk_for``)."""
    return chunk_for(seq, chunks, c.index_block_size, max_chunk)


def attention_chunk_bytes(c: M3Config, tp: int, seq: int, ctx_batch: int = 1, chunk: int | None = None
                          ) -> dict[str, int]:
    """Per-rank bytes one query chunk of the prefill creates (its last chunk, whose keys reach ``seq``), as
    ``ops.prefill_step`` builds it, all counted live at once.

    Sparse layers (when ``seq`` holds more than ``index_topk`` blocks; fewer and every chunk is dense causal):
    the gathered K and V, ``chunk x topk x block x head_dim`` per KV head (bf16 each); the fp32 scores and
    probabilities, ``chunk x topk x block`` per query head; the indexer's chunk-by-keys scores, ``chunk x S``
    (keys padded to whole blocks) per index head in fp32; the pooled block scores ``chunk x S / block`` (fp32) and
    the selection ``chunk x topk`` (int64). Dense layers (NxDI's chunked causal path, no flash kernel): fp32 scores
    and probabilities ``chunk x S`` per query head and the boolean causal mask ``chunk x S``. Returns the terms
    of the larger of the two (key "layer": "sparse" or "dense" says which)."""
    chunk = prefill_chunk(c, seq) if chunk is None else chunk
    b, bs, k = ctx_batch, c.index_block_size, c.index_topk
    q, kv, iq = _heads(c, c.num_heads, tp), _heads(c, c.num_kv_heads, tp), _heads(c, c.index_heads, tp)
    nblk = -(-seq // bs)
    dense = {"scores and probabilities": b * q * chunk * seq * 2 * FP32, "causal mask": b * chunk * seq}
    if not any(c.sparse_layers) or nblk <= k:
        return dense
    sparse = {
        "gathered K and V": 2 * b * kv * chunk * k * bs * c.head_dim * BF16,
        "scores and probabilities": b * q * chunk * k * bs * 2 * FP32,
        "index scores": b * iq * chunk * nblk * bs * FP32,
        "pooled block scores": b * iq * chunk * nblk * FP32,
        "selection": b * iq * chunk * k * INT64,
    }
    if all(c.sparse_layers) or sum(sparse.values()) >= sum(dense.values()):
        return sparse
    return dense


def prefill_phases(c: M3Config, tp: int, ep: int, seq: int, ctx_batch: int = 1, chunk: int | None = None,
                   moe_block: int = 512) -> dict[str, int]:
    """Per-rank bytes of the two phases of a layer's prefill, which run one after the other (the MoE reads the
    attention's output; the next layer's attention the MoE's), so only the larger is live: one attention chunk
    (:func:`attention_chunk_bytes`; the chunks of a layer are assumed to run one at a time) and the MoE (fp32
    router logits and scores, NxDI's blockwise buffers: tokens in, gate/up, out)."""
    t = ctx_batch * seq
    rows = (-(-t * c.top_k // moe_block) + sharding.local_experts(c.num_experts, ep) - 1) * moe_block
    moe_tp = sharding.moe_tp(tp, ep)
    return {
        "attention chunk": sum(attention_chunk_bytes(c, tp, seq, ctx_batch, chunk).values()),
        "MoE": 2 * t * c.num_experts * FP32 + rows * (2 * c.hidden_size + 2 * c.intermediate_size // moe_tp) * BF16,
    }


def plan(c: M3Config, tp: int, ep: int, batch: int, seq: int, weights: str = "bf16", kv_dtype: str = "bf16",
         ctx_batch: int | None = None, chunks: int = PREFILL_CHUNKS, max_chunk: int = PREFILL_MAX_CHUNK,
         moe_block: int = 512, reserve_gib: float = 3.0, hbm_gib: float = HBM_PER_RANK_GIB) -> MemoryPlan:
    """Per-rank HBM for serving ``batch`` sequences of up to ``seq`` tokens on a ``tp`` x ``ep`` layout; the
    prefill's query chunk follows ``chunks`` / ``max_chunk`` (the port's ``prefill_chunks`` /
    ``prefill_max_chunk``)."""
    if weights not in ("bf16", "fp8") or kv_dtype not in ("bf16", "fp8"):
        raise PlanError("weights and kv dtype are bf16 or fp8")
    if min(tp, ep, batch, seq, chunks, max_chunk, moe_block) < 1:
        raise PlanError("tp, ep, batch, seq, chunks, max_chunk and moe_block must be positive")
    ctx_batch = 1 if ctx_batch is None else ctx_batch  # what NeuronEngine runs: one request per prefill
    w, _ = weight_bytes(c, tp, ep, weights)
    h, d, di = c.hidden_size, c.head_dim, c.index_head_dim
    q = _heads(c, c.num_heads, tp)
    kv = _heads(c, c.num_kv_heads, tp)
    iq = _heads(c, c.index_heads, tp)
    cache_len = -(-seq // c.index_block_size) * c.index_block_size
    kvb = BF16 if kv_dtype == "bf16" else 1
    kv_cache = batch * cache_len * c.num_layers * 2 * kv * d * kvb
    index_k = batch * cache_len * sum(c.sparse_layers) * di * kvb

    t = ctx_batch * seq
    moe_tp = sharding.moe_tp(tp, ep)
    chunk = prefill_chunk(c, seq, chunks, max_chunk)
    phases = prefill_phases(c, tp, ep, seq, ctx_batch, chunk, moe_block)
    prefill = (
        4 * t * h * BF16  # residual, normed input, attention output, MLP output
        + t * (2 * q + 2 * kv) * d * BF16 + t * (iq + 1) * di * BF16  # q, k, v, attention out; index q, k
        + max(phases.values())  # one attention chunk or the MoE, whichever is larger
        + ctx_batch * (-(-c.vocab_size // tp)) * FP32  # last-token logits
    )
    notes = []
    i_tp = c.intermediate_size // moe_tp
    if moe_tp > 1 and i_tp % SHARD_ON_I_MULTIPLE:
        padded = -(-i_tp // SHARD_ON_I_MULTIPLE) * SHARD_ON_I_MULTIPLE
        notes.append(f"shard-on-I MoE kernels would pad I/moe_tp from {i_tp} to {padded} (not counted above)")
    if tp > c.num_kv_heads:
        notes.append(f"each KV head is replicated on {tp // c.num_kv_heads} ranks and the index-K cache on all {tp}")
    return MemoryPlan(tp, ep, batch, seq, ctx_batch, weights, kv_dtype, w, kv_cache, index_k, prefill,
                      int(reserve_gib * GIB), int(hbm_gib * GIB), tuple(notes), chunk, tuple(phases.items()))


def _causal_keys(s: int, cap: int) -> int:
    """Sum over query positions 0..s-1 of the keys each attends to, ``min(i + 1, cap)``."""
    if s <= cap:
        return s * (s + 1) // 2
    return cap * (cap + 1) // 2 + (s - cap) * cap


def decode_minimum_bytes(c: M3Config, tp: int, ep: int, batch: int, bucket: int, weights: str = "bf16",
                         kv_dtype: str = "bf16", dtype_bytes: int = BF16) -> dict[str, int]:
    """Bytes one token-generation step over caches of ``bucket`` tokens must read per rank.

    * weights: every per-rank weight of :func:`weight_bytes`, except the embedding (``batch`` rows of this
      rank's vocabulary shard) and the routed experts (a rank touches at most ``batch x top_k`` of its
      ``num_experts / ep`` local experts);
    * sparse layers' K/V: the selected blocks, ``batch x min(topk x block, bucket) x kv_heads x head_dim x 2``;
    * index-K: ``batch x bucket x index_head_dim`` per sparse layer;
    * dense layers' K/V: ``batch x bucket x kv_heads x head_dim x 2`` per dense layer.

    ``dtype_bytes`` is the model's element size (4 for a float32 trace): it scales every bf16 weight and, with
    ``kv_dtype="bf16"``, the caches (fp32 routers and fp8 experts keep their size).
    """
    _, parts = weight_bytes(c, tp, ep, weights)
    for name in parts:
        if name != "routers (fp32)" and not (name == "routed experts" and weights == "fp8"):
            parts[name] = parts[name] * dtype_bytes // BF16
    vocab_rank = -(-c.vocab_size // tp)
    local = sharding.local_experts(c.num_experts, ep)
    parts["embedding + lm_head"] = (vocab_rank + min(batch, vocab_rank)) * c.hidden_size * dtype_bytes
    parts["routed experts"] = parts["routed experts"] * min(local, batch * c.top_k) // local
    kvb = dtype_bytes if kv_dtype == "bf16" else 1
    kv = _heads(c, c.num_kv_heads, tp)
    n_sparse = sum(c.sparse_layers)
    per_token_kv = kv * c.head_dim * 2 * kvb
    return {
        "weights": sum(parts.values()),
        "kv_sparse": batch * min(c.index_topk * c.index_block_size, bucket) * per_token_kv * n_sparse,
        "index_k": batch * bucket * c.index_head_dim * kvb * n_sparse,
        "kv_dense": batch * bucket * per_token_kv * (c.num_layers - n_sparse),
    }


def decode_floor_ms(c: M3Config, tp: int, ep: int, batch: int, bucket: int, weights: str = "bf16",
                    kv_dtype: str = "bf16") -> float:
    """The HBM floor of one token-generation step: :func:`decode_minimum_bytes` at 725 GB/s per logical core."""
    return sum(decode_minimum_bytes(c, tp, ep, batch, bucket, weights, kv_dtype).values()) / HBM_BYTES_PER_S * 1e3


def prefill_flops(c: M3Config, tp: int, ep: int, batch: int, seq: int) -> dict[str, int]:
    """Useful dot FLOPs of one context-encoding pass of ``batch x seq`` tokens, per rank.

    * attention: sparse layers ``sum_i min(i + 1, topk x block)`` keys per query, dense layers every causal
      key, ``x head_dim x 4`` (scores and values) per query head of this rank;
    * indexer: all keys, ``seq^2 x index_head_dim x 2`` per index head of this rank and sparse layer;
    * routed experts: ``tokens x top_k x 6 x hidden x intermediate`` shared by the ``tp`` ranks that hold the
      experts (``ep`` expert groups x ``tp / ep`` shards; = "/ EP ranks" at tp = ep);
    * rest: this rank's projections (q, k, v, o; index q and k), dense MLP and shared-expert shards, the fp32
      router (every rank), and the LM head for the last token of each sequence.
    """
    h, d, di = c.hidden_size, c.head_dim, c.index_head_dim
    q = _heads(c, c.num_heads, tp)
    kv = _heads(c, c.num_kv_heads, tp)
    iq = _heads(c, c.index_heads, tp)
    n_sparse, n_moe = sum(c.sparse_layers), sum(c.moe_layers)
    t = batch * seq
    keys = n_sparse * _causal_keys(seq, c.index_topk * c.index_block_size) + (c.num_layers - n_sparse) * (
        _causal_keys(seq, seq))
    per_token = (c.num_layers * 2 * h * (2 * q + 2 * kv) * d + n_sparse * 2 * h * (iq + 1) * di
                 + (c.num_layers - n_moe) * 6 * h * c.dense_intermediate_size // tp
                 + n_moe * (6 * h * c.shared_intermediate_size // tp + 2 * h * c.num_experts))
    return {
        "attention": batch * q * d * 4 * keys,
        "indexer": batch * iq * seq * seq * di * 2 * n_sparse,
        "routed_experts": t * c.top_k * 6 * h * c.intermediate_size * n_moe // tp,
        "rest": t * per_token + batch * 2 * h * (-(-c.vocab_size // tp)),
    }


def format_plan(p: MemoryPlan, c: M3Config, parts: dict[str, int] | None = None) -> str:
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    lines = [f"MiniMax-M3 on tp={p.tp} ep={p.ep} (moe_tp={sharding.moe_tp(p.tp, p.ep)}), batch={p.batch}, seq={p.seq}, "
             f"prefill batch={p.ctx_batch}, weights {p.weights}, KV {p.kv_dtype}; per rank:"]
    lines.append(f"  weights              {gib(p.weight_bytes)}")
    for name, n in (parts or {}).items():
        lines.append(f"    {name:<19}{gib(n)}")
    lines += [
        f"  KV cache             {gib(p.kv_bytes)}",
        f"  index-K cache        {gib(p.index_k_bytes)}",
        f"  prefill working mem  {gib(p.prefill_bytes)}  (activations + the larger of:)",
        *(f"    {name + (f' ({p.chunk} queries)' if name == 'attention chunk' else ''):<30}{gib(n)}"
          for name, n in p.phases),
        f"  runtime reserve      {gib(p.reserve_bytes)}  (assumed)",
        f"  total                {gib(p.total_bytes)}  of {p.hbm_bytes / GIB:.2f} GiB per logical core",
    ]
    free = p.hbm_bytes - p.total_bytes
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: {'headroom' if p.fits else 'short by'} {abs(free) / GIB:.2f} GiB")
    floor = decode_floor_ms(c, p.tp, p.ep, p.batch, -(-p.seq // c.index_block_size) * c.index_block_size,
                            p.weights, p.kv_dtype)
    lines.append(f"decode HBM floor at batch {p.batch}, {p.seq} tokens: {floor:.2f} ms per step "
                 f"(bytes a step must read / {HBM_BYTES_PER_S / 1e9:.0f} GB/s)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tp", type=int, default=sharding.TRN2["tp"], help="tensor-parallel degree (ranks; default: "
                    "trn2.48xlarge's %(default)s)")
    ap.add_argument("--ep", type=int, default=sharding.TRN2["ep"], help="expert-parallel degree for the MoE (default: "
                    "%(default)s)")
    ap.add_argument("--batch", type=int, required=True, help="sequences decoded together")
    ap.add_argument("--seq", type=int, required=True, help="maximum tokens per sequence (prompt + output)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="routed-expert weight format")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="KV and index-K cache dtype")
    ap.add_argument("--ctx-batch", type=int, default=None,
                    help="sequences prefilled together (default 1: the engine's continuous batching; B: static)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="runtime/scratchpad reserve (default 3)")
    ap.add_argument("--hbm-gib", type=float, default=HBM_PER_RANK_GIB, help="HBM per rank (default 24)")
    ap.add_argument("--config", default=None, help="config.json or checkpoint folder (default: the M3 release)")


def run(args: argparse.Namespace) -> int:
    c = M3Config.from_pretrained(args.config) if args.config else M3Config.preset("m3")
    try:
        p = plan(c, args.tp, args.ep, args.batch, args.seq, args.weights, args.kv_dtype, args.ctx_batch,
                 reserve_gib=args.reserve_gib, hbm_gib=args.hbm_gib)
    except PlanError as e:
        print(f"minimax-m3 plan: {e}")
        return 2
    print(format_plan(p, c, weight_bytes(c, args.tp, args.ep, args.weights)[1]))
    return 0 if p.fits else 1


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``minimax-m3`` command; the handler is ``args.func(args)`` → exit code."""
    ap = subparsers.add_parser("plan", help="per-rank HBM budget of a TP x EP layout on trn2 (no Neuron SDK)",
                               description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.set_defaults(func=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minimax-m3 plan")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
