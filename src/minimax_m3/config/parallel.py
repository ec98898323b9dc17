"""The parallel-layout arithmetic of MiniMax-M3: what divides what when the model is split over ``tp`` ranks, ``ep`` of
them expert-parallel groups, and the size rules of the KV caches split over a KV group. The one home of these rules,
used by the reference backend's ``ShardPlan``, the engine spec, the NxDI config's validation, the dry run's layout
check and the capacity planner.

Layout (NxD's, which the reference follows): query heads split over the ``tp`` ranks; KV heads (and the index
heads, one per KV head) split when there are at least ``tp`` of them, else each is replicated on ``tp / heads``
ranks; ``ep`` groups of ``moe_tp = tp / ep`` ranks each hold ``num_experts / ep`` experts, whose intermediate width
splits over the group's ``moe_tp`` ranks; dense MLPs and the shared expert split over all ``tp`` ranks.

Prefill chunk: a prompt is prefilled in calls of at most C tokens, each attending to the cache the earlier calls
wrote. C is a multiple of ``lcm(index block, G)`` (:func:`call_unit`, :func:`chunk_unit`; G = :func:`kv_group_size`,
the ranks sharing one KV head: the sequence-sharded caches put C / G tokens of a call on each of them, and the next
call starts on a block boundary; :func:`check_call` refuses other sizes, :func:`check_layout` a group that does not
divide the block). The default
(:func:`default_prefill_chunk`: the engine spec's for the neuron backends, vLLM's when its config names none, the
planner's first candidate) is the context rounded up to whole units when that is at most :data:`MAX_PREFILL_CHUNK`
tokens (one call per prompt), else the largest power-of-two multiple of the unit up to it. """

from __future__ import annotations

import math

from ..errors import M3Error
from .m3 import M3Config

# trn2.48xlarge: 64 logical NeuronCores (LNC 2: two physical cores each), experts over all 64 ranks (one expert-TP
# rank per group); the neuron backend's default layout and the planner's
TRN2 = {"tp": 64, "ep": 64, "lnc": 2}
MAX_PREFILL_CHUNK = 8192  # the default prefill chunk's cap (tokens per call): what one context-encoding graph holds


def heads_per_rank(heads: int, tp: int) -> int:
    """Heads a rank holds: a slice of ``heads / tp``, or one replicated head when there are fewer heads than
    ranks; 0 when neither divides the other (see :func:`parallel_layout_problems`)."""
    if heads >= tp:
        return 0 if heads % tp else heads // tp
    return 0 if tp % heads else 1


# the NxDI port's KV-cache layouts (the engine spec's ``kv_layout``, ``--kv-layout``): "sharded", each KV head's
# caches split by sequence over the G ranks that hold it (the default: 1M tokens fit); "replicated", NxDI's GQA
# copies, each of the G ranks holding the head's caches whole (no group collectives: 2 per layer in decode, not 4)
KV_LAYOUTS = ("sharded", "replicated")


def kv_group_size(c: M3Config, tp: int, kv_layout: str = KV_LAYOUTS[0]) -> int:
    """G: the ranks sharing one KV head's caches: ``tp / num_kv_heads`` with the sequence-sharded layout (they split
    its K/V and index-K caches, token ``p`` on group rank ``p mod G``); 1 when each rank holds whole KV heads or
    with ``kv_layout="replicated"`` (each rank holds its head's caches whole)."""
    if kv_layout != "sharded":
        return 1
    return tp // c.num_kv_heads if tp > c.num_kv_heads else 1


def dcp_problems(c: M3Config, tp: int, dcp: int) -> list[str]:
    """Why vLLM's ``decode_context_parallel_size`` ``dcp`` cannot shard the pages at ``tp`` (empty: it can). vLLM's
    DCP groups are consecutive TP ranks, and a group shards one KV head's pages by block: ``dcp`` divides the ranks
    that hold each KV head, ``tp / num_kv_heads`` (16 for M3 at TP 64)."""
    if dcp == 1:
        return []
    per_head = kv_group_size(c, tp)
    if dcp > 0 and per_head % dcp == 0:
        return []
    fits = [d for d in range(1, per_head + 1) if per_head % d == 0]
    return [f"--decode-context-parallel-size {dcp}: {per_head} rank(s) hold each of the {c.num_kv_heads} KV heads at "
            f"--tensor-parallel-size {tp}; a DCP group shards one head's pages, so use one of {fits}"]


class LayoutError(M3Error, ValueError):
    """A group size or prefill call size the sequence-sharded layout cannot use (the message names sizes that work)."""


def check_layout(block_size: int, group: int) -> None:
    """Every rank of a KV group must hold the same number of keys of every block: ``group`` divides ``block_size``."""
    if group < 1 or block_size % group:
        fits = [g for g in range(1, block_size + 1) if block_size % g == 0]
        raise LayoutError(f"a KV group of {group} ranks cannot shard {block_size}-token index blocks evenly; "
                          f"group sizes that divide the block: {fits}")


def call_unit(block_size: int, group: int = 1) -> int:
    """What the tokens of a prefill call are a multiple of: ``lcm(index block, G)`` (each rank of the KV group writes
    ``T / G`` of them and the next call starts on a block boundary). The one home of this rule."""
    return math.lcm(block_size, group)


def chunk_unit(c: M3Config, tp: int, kv_layout: str = KV_LAYOUTS[0]) -> int:
    """:func:`call_unit` of the model at ``tp`` ranks (G = :func:`kv_group_size`)."""
    return call_unit(c.index_block_size, kv_group_size(c, tp, kv_layout))


def check_call(tokens: int, block_size: int, group: int = 1) -> None:
    """A prefill call of ``tokens`` must be a positive multiple of :func:`call_unit`; refused with the nearest sizes
    that work."""
    unit = call_unit(block_size, group)
    if tokens < 1 or tokens % unit:
        lo, hi = tokens // unit * unit, -(-max(tokens, 1) // unit) * unit
        near = [n for n in dict.fromkeys((lo, hi)) if n > 0]
        raise LayoutError(f"prefill chunk of {tokens} tokens: it must be a multiple of {unit} (the lcm of the index "
                          f"block, {block_size}, and the KV group size, {group}); nearest that work: {near}")


def prefill_chunk_choices(c: M3Config, tp: int, context: int, cap: int = MAX_PREFILL_CHUNK,
                          kv_layout: str = KV_LAYOUTS[0]) -> list[int]:
    """Prefill chunks for prompts of up to ``context`` tokens, largest first: the context rounded up to a multiple of
    :func:`chunk_unit` when that is at most ``cap``, then the unit times powers of two up to both (the planner keeps
    the largest whose working memory fits)."""
    m = chunk_unit(c, tp, kv_layout)
    whole = -(-max(context, 1) // m) * m
    pow2 = [m << j for j in range(64) if m << j <= min(cap, whole)][::-1] or [m]
    return ([whole] if whole <= cap else []) + [n for n in pow2 if n != whole]


def default_prefill_chunk(c: M3Config, tp: int, context: int, kv_layout: str = KV_LAYOUTS[0]) -> int:
    """The default prefill chunk (module doc): the first of :func:`prefill_chunk_choices`."""
    return prefill_chunk_choices(c, tp, context, kv_layout=kv_layout)[0]


def moe_tp(tp: int, ep: int) -> int:
    """Ranks of one expert-parallel group (they split each expert's intermediate width)."""
    return tp // ep


def local_experts(num_experts: int, ep: int) -> int:
    """Experts one expert-parallel group holds (contiguous: group ``g`` holds ``[g*n, (g+1)*n)``)."""
    return num_experts // ep


# how the decode graphs read the routed experts (the engine spec's ``decode_experts``, the planner's
# ``--decode-experts``): "ep", the prefill's expert-parallel shards; "tp", a second copy split over every rank
DECODE_EXPERTS = ("ep", "tp")


def decode_ep(ep: int, decode_experts: str) -> int:
    """The expert-parallel degree a decode step reads the routed experts at: 1 for the ``tp`` copy (one group of
    every rank), else the prefill's ``ep``. What the planner's decode bytes and the graph report take as ``ep``."""
    return 1 if decode_experts == "tp" else ep


def decode_tp_experts(tp: int, ep: int) -> dict:
    """NxD's hybrid sharding (NxDI's ``hybrid_sharding_config``) of ``--decode-experts tp``: prefill keeps the
    layout above (``ep`` groups of ``moe_tp`` ranks), decode reads a second copy of the routed experts whose
    intermediate width splits over all ``tp`` ranks (one group), so a step gathers only the rows of the experts its
    tokens chose (NxD's selective loading) instead of every local expert whole."""
    return {"moe_cte_tp_degree": moe_tp(tp, ep), "moe_cte_ep_degree": ep, "moe_tkg_tp_degree": tp,
            "moe_tkg_ep_degree": 1}


def decode_experts_problems(c: M3Config, tp: int) -> list[str]:
    """Rules of the decode copy of :func:`decode_tp_experts` (the prefill layout's are :func:`model_problems`')."""
    if tp >= 1 and c.intermediate_size % tp:
        return [f"decode_experts tp: tp {tp} does not divide intermediate_size {c.intermediate_size} (the decode "
                "copy splits each expert over every rank); use --decode-experts ep"]
    return []


def degree_problems(tp: int, ep: int) -> list[str]:
    """Rules on the degrees alone (no model needed)."""
    if min(tp, ep) < 1:
        return [f"tp {tp} and ep {ep} must be >= 1"]
    if ep > tp or tp % ep:
        return [f"ep {ep} must divide tp {tp} (expert parallelism splits the tensor-parallel ranks)"]
    return []


def model_problems(c: M3Config, tp: int, ep: int, even_vocab: bool = False) -> list[str]:
    """Every way the model does not split over ``tp`` ranks in ``ep`` groups, one line each.
    ``even_vocab``: the backend splits the vocabulary in equal slices without padding (the reference backend)."""
    out = []
    if min(tp, ep) < 1:
        return out
    if c.num_heads % tp:
        out.append(f"tp {tp} does not divide the {c.num_heads} attention heads")
    if not heads_per_rank(c.num_kv_heads, tp):
        out.append(f"tp {tp} and {c.num_kv_heads} KV heads: one must divide the other (each rank needs whole KV "
                   "groups, one index head per KV head)")
    for name, size in (("dense_intermediate_size", c.dense_intermediate_size),
                       ("shared_intermediate_size", c.shared_intermediate_size)):
        if size % tp:
            out.append(f"tp {tp} does not divide {name} {size}")
    if even_vocab:
        out += vocab_problems(c, tp)
    if c.num_experts % ep:
        out.append(f"ep {ep} does not divide the {c.num_experts} experts")
    if not degree_problems(tp, ep) and c.intermediate_size % moe_tp(tp, ep):
        out.append(f"tp/ep = {moe_tp(tp, ep)} ranks per expert group do not divide intermediate_size "
                   f"{c.intermediate_size}")
    return out


def vocab_problems(c: M3Config, tp: int) -> list[str]:
    """A vocabulary split in equal slices without padding (the reference backend, the graph harness)."""
    return [f"tp {tp} does not divide the vocabulary {c.vocab_size}"] if c.vocab_size % tp else []


def parallel_layout_problems(c: M3Config, tp: int, ep: int, even_vocab: bool = False) -> list[str]:
    """:func:`degree_problems` and :func:`model_problems` together."""
    return degree_problems(tp, ep) + model_problems(c, tp, ep, even_vocab)
