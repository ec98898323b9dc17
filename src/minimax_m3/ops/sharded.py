"""The sequence-sharded cache layout (issue 23): the per-rank math the Neuron port runs between its collectives.

**Layout** (NxDI's flash-decoding layout). The ``G`` ranks of a KV group share its caches: token ``p`` lives on
group rank ``p mod G`` at slot ``p div G`` (:func:`owner`). A rank's shard of a ``[B, H, S, D]`` cache is
``[B, H, S/G, D]``; of the index keys ``[B, S, Di]``, ``[B, S/G, Di]`` (each group holds one full copy, sharded
``G`` ways, so a group's selection never leaves the group). ``G`` must divide the index block (:func:`check_layout`):
every rank then holds ``block/G`` keys of every block (slots ``j*block/G ..`` of block ``j``), so any selection is
balanced. A prefill call of ``T`` tokens starts on a block boundary and ``T`` is a multiple of ``lcm(block, G)``
(:func:`check_chunk`): each rank writes ``T/G`` tokens (:func:`write_chunk`); decode writes one token per row on the
rank that owns it (:func:`write_token`). Every rank may be passed as an int or a 0-d tensor (one SPMD graph for all
ranks).

**Selection, exact** (sparse layers). Each rank max-pools ITS keys of each block (:func:`partial_block_scores`:
``-inf`` where it has no key of the block the query may see), applies the forced/causal rule of
``indexer.select_blocks`` and keeps its local top-``K`` candidates (:func:`local_candidates`, score and id); the group
all-gathers them and every rank takes the global top-``K`` of the ``G x K`` candidates, a block's score the max over
the ranks that proposed it (:func:`merge_candidates`). Exact: a block of the global top-``K`` has at most ``K - 1``
better blocks, so the rank holding its maximum proposes it with its true score; a block outside is never
over-scored. Ties: the lower block id wins on every rank, in the merge and in ``select_blocks`` (``top_blocks``), so
the ids equal ``select_blocks(index_block_scores(...))`` on the unsharded cache, ties included (tested).

**Attention** ("flash" style, decode and prefill alike). Each rank attends the ``R`` query heads of its group (an
all-gather of the queries) to ITS keys: of the selected blocks (``sharded_step.partial_attention`` with ``blocks``:
one gather of ``K x block/G`` keys per query, shared by the ``R`` heads), or of the whole shard (dense layers), and
returns the normalised partial output with its softmax max and sum; :func:`combine_weights` turns the group's
statistics into each rank's exact weight (log-sum-exp merge), and the weighted partials summed over the ranks are
the attention (:func:`combine`). Gathered K/V bytes per rank and sparse layer: ``T x K x (block/G) x D x 2 (K and
V) x dtype bytes`` for ``T`` queries (M3, bf16, G = 16: ``T/16`` MiB, against ``T`` MiB per rank when every head
gathers for itself).

**The step** the port runs (prior + active keys, the partial attention, its collectives: 2 per decode layer, one
all-gather and one all-to-all) is :func:`minimax_m3.ops.sharded_step.rank_attention`, built on these functions;
``sharded_step.COLLECTIVES`` lists the collectives. :func:`shard` and :func:`sharded_select` cut an unsharded cache
and merge a selection over simulated ranks for the tests. Everything here is XLA-safe (static shapes, no host
synchronisation; ``test/xla/test_sharded_xla.py``).
"""

from __future__ import annotations

import math

import torch

from ..errors import M3Error
from .cache import write_positions
from .indexer import force_blocks, index_block_scores, top_blocks


class LayoutError(M3Error, ValueError):
    """A group size or prefill chunk the sequence-sharded layout cannot use (the message names sizes that work)."""


def check_layout(block_size: int, group: int) -> None:
    """Every rank of a group must hold the same number of keys of every block: ``group`` divides ``block_size``."""
    if group < 1 or block_size % group:
        fits = [g for g in range(1, block_size + 1) if block_size % g == 0]
        raise LayoutError(f"a KV group of {group} ranks cannot shard {block_size}-token index blocks evenly; "
                          f"group sizes that divide the block: {fits}")


def check_chunk(chunk: int, block_size: int, group: int = 1) -> None:
    """A prefill call writes ``chunk / group`` tokens per rank and the next call starts on a block boundary:
    ``chunk`` must be a positive multiple of ``lcm(block_size, group)``. Refused with the nearest sizes that work."""
    unit = math.lcm(block_size, group)
    if chunk < 1 or chunk % unit:
        lo, hi = chunk // unit * unit, -(-max(chunk, 1) // unit) * unit
        near = [n for n in dict.fromkeys((lo, hi)) if n > 0]
        raise LayoutError(f"prefill chunk of {chunk} tokens: it must be a multiple of {unit} (the lcm of the index "
                          f"block, {block_size}, and the KV group size, {group}); nearest that work: {near}")


def owner(positions: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group rank, slot)`` of each position: ``(p mod G, p div G)``."""
    return positions % group, positions // group


def _rank(rank, device) -> torch.Tensor:
    return torch.as_tensor(rank, dtype=torch.int64, device=device).reshape(1)


def last_slot(q_pos: torch.Tensor, rank, group: int) -> torch.Tensor:
    """The last slot of ``rank``'s shard a query at ``q_pos`` may read (causal: key position ``<= q_pos``):
    slot ``i`` holds position ``i*G + rank``, so ``i <= floor((q_pos - rank) / G)`` (``-1``: none)."""
    return torch.div(q_pos - _rank(rank, q_pos.device), group, rounding_mode="floor")


def write_chunk(shard: torch.Tensor, new: torch.Tensor, start, rank, group: int, seq_dim: int) -> torch.Tensor:
    """Write ``rank``'s tokens of a chunk into its shard, in place: ``new`` holds ``T`` tokens (``T`` a multiple of
    ``G``) at positions ``start .. start+T-1`` along ``seq_dim``; ``start`` (int, or ``[B]`` per row) is a multiple
    of ``G``, so the rank's tokens are ``new[rank::G]`` and go to slots ``start/G .. start/G + T/G - 1``."""
    t = new.shape[seq_dim]
    if t % group or (isinstance(start, int) and start % group):
        raise LayoutError(f"a chunk of {t} tokens at position {start} does not split over a group of {group} ranks: "
                          f"both must be multiples of {group}")
    mine = new.unflatten(seq_dim, (t // group, group)).index_select(seq_dim + 1, _rank(rank, new.device))
    start = torch.as_tensor(start, device=new.device).view(-1, 1)
    slots = (start // group + torch.arange(t // group, device=new.device).view(1, -1)).expand(new.shape[0], -1)
    return write_positions(shard, mine.squeeze(seq_dim + 1).to(shard.dtype), slots, seq_dim)


def write_token(shard: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, rank, group: int,
                seq_dim: int) -> torch.Tensor:
    """Decode: write one token per row (``new`` with ``1`` along ``seq_dim``, at positions ``pos [B]``) into the
    shard, in place, where ``rank`` owns it (``pos mod G == rank``); the other rows keep their slot's value."""
    b = new.shape[0]
    shape = [1] * new.dim()
    shape[0] = b
    index = (pos // group).view(shape).expand_as(new)
    owned = (pos % group == _rank(rank, pos.device)).view(shape)
    return shard.scatter_(seq_dim, index, torch.where(owned, new.to(shard.dtype), torch.gather(shard, seq_dim, index)))


# ---- selection -----------------------------------------------------------------------------------------------


def partial_block_scores(iq: torch.Tensor, ik_shard: torch.Tensor, q_pos: torch.Tensor, block_size: int, rank,
                         group: int) -> torch.Tensor:
    """``[B, H, Tq, nblk]`` (float32): ``iq [B, H, Tq, Di]`` against ``rank``'s index keys ``ik_shard [B, S/G, Di]``,
    max-pooled over the rank's ``block/G`` keys of each block, ``-inf`` where it has no key the query may see.
    The same products and pooling as ``indexer.index_block_scores`` (called with the rank's slots as keys)."""
    return index_block_scores(iq, ik_shard, last_slot(q_pos, rank, group), block_size // group)


def local_candidates(partial: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
                     local_blocks: int = 1, topk_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's candidates ``(scores, ids)``, ``[B, H, Tq, min(topk, nblk)]`` each: the forced/causal rule of
    ``select_blocks`` on its partial scores, then its top-k (equal scores: lower id first; ``-1`` for ``-inf``)."""
    scores = force_blocks(partial, q_pos, block_size, init_blocks, local_blocks)
    return top_blocks(scores, min(topk, scores.shape[-1]), topk_fn)


def merge_candidates(scores: torch.Tensor, ids: torch.Tensor, nblk: int, topk: int, topk_fn=None) -> torch.Tensor:
    """The global top-k block ids ``[B, H, Tq, min(topk, nblk)]`` from every rank's candidates (the all-gather,
    ``[G, B, H, Tq, K]`` each): a block's score is the max over the ranks that proposed it (one scatter-max into
    ``nblk`` columns), then ``top_blocks`` (lower id first on ties, ``-1`` for an empty slot)."""
    s = scores.movedim(0, -2).flatten(-2).float()
    i = ids.movedim(0, -2).flatten(-2).to(torch.int64)
    i = torch.where(i < 0, nblk, i)  # empty candidates land in a throwaway column
    table = torch.full((*s.shape[:-1], nblk + 1), float("-inf"), device=s.device)
    table = table.scatter_reduce(-1, i, s, reduce="amax", include_self=True)[..., :nblk]
    return top_blocks(table, min(topk, nblk), topk_fn)[1]


# ---- attention ---------------------------------------------------------------------------------------------------


def _partial_softmax(scores: torch.Tensor, keep: torch.Tensor):
    """Probabilities over this rank's keys, with their max and sum (float32); a row without a key: all zero,
    max ``-inf``, sum 0 (its weight in :func:`combine_weights` is 0)."""
    s = scores.float().masked_fill(~keep, float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(top == float("-inf"), 0.0, top))
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, 1.0), top.squeeze(-1), total.squeeze(-1)


def gathered_kv_bytes(tokens: int, topk: int, block_size: int, group: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes one rank gathers for ``tokens`` queries of one KV head in a sparse layer (per batch row):
    ``tokens x topk x (block/G) x D x 2 x dtype bytes`` (what ``sharded_step.partial_attention`` reads with
    ``blocks``)."""
    return tokens * topk * (block_size // group) * head_dim * 2 * dtype_bytes


def combine_weights(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Each rank's weight ``[G, ...]`` from the group's statistics ``maxes, sums [G, ...]`` (the all-gather):
    ``exp(max_r - M) sum_r / sum_s exp(max_s - M) sum_s`` with ``M`` the max over ranks (log-sum-exp merge; the
    weights of a row sum to 1). Rank ``r`` scales its partial output by its weight; the sum over the ranks (a
    reduce-scatter, each rank keeping its own head) is the attention."""
    top = maxes.amax(dim=0, keepdim=True)
    w = torch.exp(maxes - torch.where(top == float("-inf"), 0.0, top)) * sums
    total = w.sum(dim=0, keepdim=True)
    return w / torch.where(total > 0, total, 1.0)


def combine(outs: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """The attention ``[B, Hq, Tq, D]`` from every rank's partials ``outs [G, B, Hq, Tq, D]``, ``maxes, sums
    [G, B, Hq, Tq]`` (summed in float32, returned in ``outs``' dtype)."""
    w = combine_weights(maxes, sums).unsqueeze(-1)
    return (w * outs.float()).sum(dim=0).to(outs.dtype)


# ---- simulated ranks (tests: an unsharded cache cut into shards, a selection merged over them) ---------------------


def shard(cache: torch.Tensor, group: int, seq_dim: int) -> list[torch.Tensor]:
    """The ``G`` shards of an unsharded cache (rank ``r``: positions ``r, r+G, ...``), contiguous copies."""
    s = cache.shape[seq_dim]
    return [cache.index_select(seq_dim, torch.arange(r, s, group, device=cache.device)) for r in range(group)]


def sharded_select(iq: torch.Tensor, ik_shards: list[torch.Tensor], q_pos: torch.Tensor, sel,
                   topk_fn=None) -> torch.Tensor:
    """The merged selection ``[B, H, Tq, K]`` of the queries ``iq [B, H, Tq, Di]`` at ``q_pos [B, Tq]`` over the
    index-key shards (``sel``: an ``ops.Selection``): local candidates per rank, stacked (the all-gather), merged."""
    group = len(ik_shards)
    cands = [local_candidates(partial_block_scores(iq, ik, q_pos, sel.block_size, r, group), q_pos, sel.block_size,
                              sel.topk, sel.init_blocks, sel.local_blocks, topk_fn)
             for r, ik in enumerate(ik_shards)]
    nblk = ik_shards[0].shape[1] * group // sel.block_size
    return merge_candidates(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]), nblk, sel.topk,
                            topk_fn)
