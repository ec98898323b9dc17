"""The attention step of a decoder layer: ONE function, :func:`attention_step`, that every path calls.

The reference model (prefill calls, decode, speculative verify), the Neuron port (context encoding, token
generation, verify; the replicated and the sequence-sharded cache layouts) and the XLA proofs (``test/xla``) all run
this step; the tests' simulated ranks (``test/support/seq_shards.py``) run it once per rank.

**One rank of a KV group.** The ``G`` ranks of a KV group share its caches, token ``p`` on group rank ``p mod G`` at
slot ``p div G`` (:mod:`.layout`); ``G = 1`` (the replicated layout, the reference model) is the :class:`Alone` group,
whose collectives are identities and which skips the candidate merge and the softmax merge.

**Prior + active.** The caches are read, never written, here (each backend's cache writes the call's tokens once,
after the layer, as NxDI does): a call of ``T`` tokens per row at positions ``q_pos [B, T]`` from ``start`` attends to

* the PRIOR keys: the rank's slots of positions ``< start`` (the cache line; ``None`` when nothing precedes the
  call), and
* the ACTIVE keys, the call's own tokens this rank will own: :func:`call_active` for a call that starts on a block
  boundary (a prefill call; with no prior its keys are read by selected block, the block-sparse minimum; after a
  prior they are scored densely and masked to the selected blocks), :func:`token_active` for a few tokens from any
  position (decode, a speculative verify step; attended densely, masked to the selected blocks).

**Step**, per layer: sparse layers score the rank's prior and active index keys per block (the lightning indexer,
:func:`block_scores`) and keep their local top-k candidates (in query tiles: the index scores of one tile at a
time); an all-gather brings every rank the group's query heads (each rank then attends ``R = G x local heads``, the
heads sharing each gathered block) and, sparse, the group's candidates, merged exactly (``indexer.merge_candidates``,
lower id wins ties) — in decode and verify ONE all-gather carries both (queries widened to float32, ids as float32:
exact below 2**24 blocks); the partial softmax over the rank's keys of the selected blocks, query tile by query tile
(``K x block / G`` keys per query, gathered once for its ``R`` heads); then ONE all-to-all by head hands each rank
every rank's partial output, maximum and sum for its own heads, merged by log-sum-exp (``attention.combine``).
Collectives per layer (:data:`COLLECTIVES`): 2 in decode and verify, 3 in a sparse prefill call, 2 in a dense one;
none with ``G = 1``.

**Ranks that hold whole blocks** (``unit`` = the index block: vLLM Neuron's decode context parallelism deals a KV
head's pages so, :mod:`.layout`): the same step over caches that already hold every key (no active keys); each rank
scores and reads only its own blocks, the candidates merge by a plain scatter (one proposer per block), the same
collectives.

Everything here is XLA-safe: shapes depend only on input shapes, tiles are a static Python loop, no host
synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .attention import combine, partial_softmax
from .indexer import index_block_scores, local_candidates, merge_candidates
from .layout import last_slot, rank_index
from .paged import Pages


@dataclass(frozen=True)
class Selection:
    """The indexer's block selection rule (``M3Config.index_*``)."""

    block_size: int
    topk: int
    init_blocks: int = 0
    local_blocks: int = 1

    @classmethod
    def of(cls, c) -> Selection:
        return cls(c.index_block_size, c.index_topk, c.index_init_blocks, c.index_local_blocks)

    def kwargs(self) -> dict:
        return dict(block_size=self.block_size, topk=self.topk, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks)


# what one layer adds per call on a group of more than one rank, in order (kind, payload): the graph report lists them
_MERGE = ("all-to-all", "partial outputs + softmax max and sum by head (f32)")
COLLECTIVES = {
    "sparse decode": (("all-gather", "query heads + selection candidates (f32)"), _MERGE),  # and a verify step
    "sparse prefill": (("all-gather", "query heads"), ("all-gather", "selection candidates (f32 score, id)"), _MERGE),
    "dense": (("all-gather", "query heads"), _MERGE),
}
# a decode or verify call of fewer tokens per row than this packs its query heads and selection candidates into ONE
# all-gather (queries widened to float32): the port passes ``one_gather`` by it, the planner counts collectives by it
ONE_GATHER_TOKENS = 16
# score elements one query tile of a dense layer may hold (float32: 64 MiB): a long prior is tiled by queries
TILE_ELEMENTS = 2 ** 24


class Group(Protocol):
    """The KV group's collectives, in group order (rank ``i`` of the group is ``global rank mod G``)."""

    size: int

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in group order."""

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """All-to-all along dim 0: ``x [G, ...]``, part ``j`` for group rank ``j``; returns ``y [G, ...]`` with
        ``y[j]`` the part rank ``j`` sent this rank."""


@dataclass(frozen=True)
class QuerySplit:
    """A call's index selection split by query over the ``parts`` ranks that hold the same index queries and keys
    (the vLLM Neuron model's pages: a KV head's pages, and its index head, replicated on ``parts`` ranks): rank
    ``index`` of them selects the blocks of queries ``[index * T / parts, (index + 1) * T / parts)`` only, and
    ``gather(ids [B, H, T / parts, K]) -> [B, H, T, K]`` (one all-gather, parts in order) hands every one of them
    the whole call's selection. Exact: each query's selection is what it would have been. The step takes it for a
    call of at least ``parts`` tokens per row, a multiple of them, whose keys are all in the caches; the vLLM Neuron
    model hands it to prefill segments only (a decode or verify step selects whole)."""

    parts: int
    index: int
    gather: object  # Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def splits(t: int, parts: int) -> bool:
        """Whether a call of ``t`` tokens per row splits over ``parts`` ranks (the planner counts its all-gather by
        this rule too)."""
        return parts > 1 and t >= parts and t % parts == 0

    def applies(self, t: int, act) -> bool:
        return act is None and self.splits(t, self.parts)


class Alone:
    """The group of one rank: every collective is the identity (the step skips them)."""

    size = 1

    def all_gather(self, x, dim):
        return x

    def exchange(self, x):
        return x


@dataclass
class Active:
    """The rank's active keys: ``k, v [B, H, A, D]`` at positions ``pos [B, A]`` (a position after every query when
    the rank owns none), index keys ``ik [B, A, Di]`` on sparse layers. ``blocked``: a call's own keys from a block
    boundary (:func:`call_active`; a query tile sees only those up to its end), otherwise a few tokens."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    ik: torch.Tensor | None = None
    blocked: bool = False


def residue(x: torch.Tensor, rank, group: int, seq_dim: int) -> torch.Tensor:
    """``x``'s tokens ``rank, rank + G, ...`` along ``seq_dim`` (length a multiple of ``G``; ``x`` itself for
    ``G = 1``)."""
    if group == 1:
        return x
    t = x.shape[seq_dim]
    mine = x.unflatten(seq_dim, (t // group, group)).index_select(seq_dim + 1, rank_index(rank, x.device))
    return mine.squeeze(seq_dim + 1)


def call_active(k, v, ik, start: torch.Tensor, rank, group: int) -> Active:
    """A call's active keys on ``rank``: its residue of the call's ``k, v [B, H, T, D]`` and index keys ``ik [B, T,
    Di]`` (or ``None``), at positions ``start + j*G + rank`` (``start [B]`` on a block boundary, a multiple of
    ``G``)."""
    a = k.shape[2] // group
    pos = start.view(-1, 1) + torch.arange(a, device=k.device).view(1, -1) * group + rank_index(rank, k.device)
    return Active(residue(k, rank, group, 2), residue(v, rank, group, 2), pos,
                  None if ik is None else residue(ik, rank, group, 1), blocked=True)


def token_active(k, v, ik, q_pos: torch.Tensor, rank, group: int) -> Active:
    """Decode and verify: row ``b``'s ``T`` tokens ``k, v [B, H, T, D]`` (index keys ``ik [B, T, Di]``) at
    positions ``q_pos [B, T]`` (consecutive from any start; ``[B]`` for one token) are active on the rank that owns
    each position; elsewhere a token's position is set past the row's last query (masked)."""
    q_pos = q_pos.view(q_pos.shape[0], -1)
    own = q_pos % group == rank_index(rank, q_pos.device)
    return Active(k, v, torch.where(own, q_pos, q_pos[:, -1:] + 1), ik)


def _upto(act: Active | None, end: int, group: int) -> Active | None:
    """A blocked call's active keys that a query tile ending at call offset ``end`` may see (``j < ceil(end / G)``;
    a static slice); the whole of a token call's."""
    if act is None or not act.blocked:
        return act
    n = -(-end // group)
    return Active(act.k[:, :, :n], act.v[:, :, :n], act.pos[:, :n], None if act.ik is None else act.ik[:, :n], True)


def _spread(local: torch.Tensor, rank, group: int) -> torch.Tensor:
    """A block-interleaved rank's scores of its local blocks ``[..., n]`` as the line's ``[..., n * G]`` (local
    block ``j`` is block ``j*G + rank``; ``-inf`` on every other rank's blocks)."""
    mine = torch.arange(group, device=local.device) == rank_index(rank, local.device)
    return torch.where(mine, local.unsqueeze(-1), float("-inf")).flatten(-2)


def block_scores(iq: torch.Tensor, ik_prior: torch.Tensor | None, act: Active | None, q_pos: torch.Tensor,
                 start: torch.Tensor, block_size: int, rank, group: int, nblk: int, unit: int = 1) -> torch.Tensor:
    """``[B, H, T, nblk]`` float32: the rank's partial block scores, ``iq [B, H, T, Di]`` against its prior index
    keys (``ik_prior [B, S/G, Di]``, positions ``< start``; ``None``: none) and its active ones, max-pooled into the
    ``nblk`` blocks of the line (``-inf`` where it holds no key the query may see). ``act`` None: the prior already
    holds the call's keys (written first), each query reads its slots up to its own position; ``unit`` (the block,
    block-interleaved ranks: ``ops.layout``) scores the rank's own blocks only."""
    b, h, t, _ = iq.shape
    if act is None and unit > 1:
        own = index_block_scores(iq, ik_prior, last_slot(q_pos, rank, group, unit), block_size)
        return _spread(own, rank, group)
    if act is None:
        return index_block_scores(iq, ik_prior, last_slot(q_pos, rank, group), block_size // group)
    if ik_prior is None:
        scores = torch.full((b, h, t, nblk), float("-inf"), device=iq.device)
    else:
        limit = last_slot(start.view(-1, 1) - 1, rank, group).expand(b, t)
        scores = index_block_scores(iq, ik_prior, limit, block_size // group)
    act_s = torch.matmul(iq, act.ik.unsqueeze(1).transpose(-1, -2)).float()  # [B, H, T, A], as index_block_scores
    act_s = act_s.masked_fill(act.pos.view(b, 1, 1, -1) > q_pos.view(b, 1, t, 1), float("-inf"))
    blk = (act.pos // block_size).clamp(max=nblk - 1).view(b, 1, 1, -1).expand_as(act_s)
    return scores.scatter_reduce(-1, blk, act_s, reduce="amax", include_self=True)


def _tiles(t: int, tile: int | None):
    tile = t if not tile else min(t, tile)
    return [(i, min(t, i + tile)) for i in range(0, t, tile)]


def _select(iq, ik_prior, act: Active, q_pos, start, sel: Selection, rank, group: int, nblk: int, tile, topk_fn,
            unit: int = 1):
    """The rank's local candidates ``(scores, ids)``, ``[B, H, T, K]`` each, query tile by query tile."""
    parts = []
    for i0, i1 in _tiles(q_pos.shape[1], tile):
        partial = block_scores(iq[:, :, i0:i1], ik_prior, _upto(act, i1, group), q_pos[:, i0:i1], start,
                               sel.block_size, rank, group, nblk, unit)
        parts.append(local_candidates(partial, q_pos[:, i0:i1], sel.block_size, sel.topk, sel.init_blocks,
                                      sel.local_blocks, topk_fn))
    return tuple(torch.cat(x, dim=2) for x in zip(*parts)) if len(parts) > 1 else parts[0]


def _gather(table, ids: torch.Tensor, nblk: int) -> torch.Tensor:
    """``table [B, H, nblk * per, D]`` viewed by block (or :class:`Pages`: the rows' pages); ``ids [B, H, T, K]``
    (clamped into ``0 .. nblk-1``) → ``[B, H, T, K * per, D]``: one row per selected block, never one per element."""
    if isinstance(table, Pages):
        return table.gather(ids)
    b, h, slots, d = table.shape
    per = slots // nblk
    rows = ((torch.arange(b * h, device=ids.device) * nblk).view(b, h, 1, 1) + ids).reshape(-1)
    return table.reshape(b * h * nblk, per, d).index_select(0, rows).view(*ids.shape[:3], ids.shape[3] * per, d)


def _by_block(x: torch.Tensor, per: int) -> torch.Tensor:
    """A blocked call's active ``[B, H, A, D]`` padded to whole blocks of ``per`` keys (a ragged last call)."""
    pad = -x.shape[2] % per
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _sparse(q, k, v, act: Active | None, q_pos, start, blocks, block_size: int, rank, group: int, scale: float,
            unit: int = 1):
    """One query tile of a sparse layer: each query reads its ``K`` selected blocks (``K x per`` keys). A call with
    nothing before it (``k`` None; its own keys from a block boundary) gathers them from its own keys; a call whose
    keys the caches already hold (``act`` None) from the caches alone; a later prefill call (its own keys from a
    block boundary, ``act.blocked``) from a copy of the rank's lines with its own keys in their slots (block-sparse
    FLOPs; the copy is the rank's 1/G of the line); decode and verify (a few active tokens at any position) from the
    prior, plus their own few keys scored and masked (``1 + T/(K x per)`` times the block-sparse FLOPs). Ranks
    interleaved by block (``unit`` the block, keys in the caches): each selected block is gathered from the rank's
    local block ``id div G`` and read where ``id mod G`` is the rank (a static ``K`` gathers, the others masked).
    ``(out, max, sum)``."""
    b, hq, t, d = q.shape
    h, kk = (k if act is None else act.k).shape[1], blocks.shape[-1]
    per = block_size // group if unit == 1 else block_size
    r = hq // h
    ids = blocks.clamp(min=0)
    own = blocks >= 0
    if unit == 1:
        key_pos = ((ids * block_size).unsqueeze(-1) + torch.arange(per, device=q.device) * group
                   + rank_index(rank, q.device)).view(b, h, t, kk * per)
    else:  # whole blocks per rank: the block's own positions, the rank's local block of it
        key_pos = ((ids * block_size).unsqueeze(-1) + torch.arange(per, device=q.device)).view(b, h, t, kk * per)
        own = own & (ids % group == rank_index(rank, q.device))
        ids = torch.div(ids, group, rounding_mode="floor")
    qg = q.reshape(b, h, r, t, d).transpose(2, 3)  # [B, H, T, r, D]: the heads share the gather
    if k is None or act is None or act.blocked:  # each selected block gathered whole; each query's keys up to itself
        if act is None:  # the caches, which already hold the call's keys
            n = k.shape[2] // per
            kg, vg = _gather(k, ids.clamp(max=n - 1), n), _gather(v, ids.clamp(max=n - 1), n)
        elif k is None:  # the call's own keys, from position 0
            tk, tv, n = _by_block(act.k, per), _by_block(act.v, per), -(-act.k.shape[2] // per)
            kg, vg = _gather(tk, ids.clamp(max=n - 1), n), _gather(tv, ids.clamp(max=n - 1), n)
        else:  # after a prior: the call's own keys put in their slots of a copy of the rank's lines (what the cache
            # update writes after the forward; a few MiB per layer), then one gather for every selected block
            a, n = act.k.shape[2], k.shape[2] // per
            slot = (start // group).view(b, 1) + torch.arange(a, device=q.device)  # [B, A]: start + j*G + rank
            slot = slot.clamp(max=k.shape[2] - 1).view(b, 1, a, 1).expand(b, h, a, d)  # (calls end in the cache)
            kg = _gather(k.scatter(2, slot, act.k.to(k.dtype)), ids.clamp(max=n - 1), n)
            vg = _gather(v.scatter(2, slot, act.v.to(v.dtype)), ids.clamp(max=n - 1), n)
        keep = own.repeat_interleave(per, dim=-1) & (key_pos <= q_pos.view(b, 1, t, 1))
        scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [B, H, T, r, K * per]
        p, top, total = partial_softmax(scores, keep.unsqueeze(3).expand_as(scores))
        out = torch.matmul(p.to(vg.dtype), vg)
    else:  # decode, verify: the prior's selected blocks, plus the call's own few keys where their block is selected
        a, nblk = act.k.shape[2], k.shape[2] // per
        kg, vg = _gather(k, ids.clamp(max=nblk - 1), nblk), _gather(v, ids.clamp(max=nblk - 1), nblk)
        prior_keep = (blocks >= 0).repeat_interleave(per, dim=-1) & (key_pos < start.view(b, 1, 1, 1))
        picked = ((act.pos // block_size).view(b, 1, 1, 1, a) == blocks.unsqueeze(-1)).any(dim=-2)  # [B, H, T, A]
        act_keep = picked & (act.pos.view(b, 1, 1, a) <= q_pos.view(b, 1, t, 1))
        prior = torch.matmul(qg, kg.transpose(-1, -2))  # [B, H, T, r, K * per]
        active = torch.matmul(qg, act.k.transpose(-1, -2).unsqueeze(2))  # [B, H, T, r, A]
        keep = torch.cat([prior_keep, act_keep], dim=-1).unsqueeze(3).expand(b, h, t, r, kk * per + a)
        p, top, total = partial_softmax(torch.cat([prior, active], dim=-1) * scale, keep)
        p = p.to(v.dtype)
        out = torch.matmul(p[..., :kk * per], vg) + torch.matmul(p[..., kk * per:], act.v.unsqueeze(2))
    return (out.transpose(2, 3).reshape(b, hq, t, d), top.transpose(2, 3).reshape(b, hq, t),
            total.transpose(2, 3).reshape(b, hq, t))


def _dense(q, k, v, act: Active | None, q_pos, start, rank, group: int, scale: float, unit: int = 1):
    """One query tile of a dense layer: every prior slot before ``start`` and every active key up to the query
    (``act`` None: every slot up to the query's position, ``unit`` the ranks' interleave: ``ops.layout``)."""
    b, hq, t, d = q.shape
    if isinstance(k, Pages):
        k, v = k.lines(), v.lines()
    if act is None:
        h, slots = k.shape[1], k.shape[2]
        r = hq // h
        qg = q.reshape(b, h, r * t, d)
        keep = (torch.arange(slots, device=q.device).view(1, 1, slots)
                <= last_slot(q_pos, rank, group, unit).view(b, t, 1)).view(b, 1, 1, t, slots)
        scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, h, r, t, slots)
        p, top, total = partial_softmax(scores * scale, keep.expand(b, 1, r, t, slots))
        out = torch.matmul(p.to(v.dtype).reshape(b, h, r * t, slots), v)
        return out.view(b, hq, t, d), top.reshape(b, hq, t), total.reshape(b, hq, t)
    h, a = act.k.shape[1], act.k.shape[2]
    r = hq // h
    qg = q.reshape(b, h, r * t, d)
    act_keep = (act.pos.view(b, 1, -1) <= q_pos.view(b, t, 1)).view(b, 1, 1, t, a)
    active = torch.matmul(qg, act.k.transpose(-1, -2)).view(b, h, r, t, a)
    if k is None:
        p, top, total = partial_softmax(active * scale, act_keep.expand(b, 1, r, t, a))
        out = torch.matmul(p.to(act.v.dtype).reshape(b, h, r * t, a), act.v)
    else:
        slots = k.shape[2]
        limit = last_slot(start.view(-1, 1) - 1, rank, group)  # [B, 1]: the last prior slot
        prior = torch.matmul(qg, k.transpose(-1, -2)).view(b, h, r, t, slots)
        keep = torch.cat([(torch.arange(slots, device=q.device).view(1, slots) <= limit).view(b, 1, 1, 1, slots)
                          .expand(b, 1, r, t, slots), act_keep.expand(b, 1, r, t, a)], dim=-1)
        p, top, total = partial_softmax(torch.cat([prior, active], dim=-1) * scale, keep)
        p = p.to(v.dtype)
        out = torch.matmul(p[..., :slots].reshape(b, h, r * t, slots), v) \
            + torch.matmul(p[..., slots:].reshape(b, h, r * t, a), act.v)
    return out.view(b, hq, t, d), top.reshape(b, hq, t), total.reshape(b, hq, t)


def partial_attention(q: torch.Tensor, k_prior: torch.Tensor | None, v_prior: torch.Tensor | None, act: Active,
                      q_pos: torch.Tensor, start: torch.Tensor, rank, group: int, scale: float,
                      blocks: torch.Tensor | None = None, block_size: int | None = None, tile: int | None = None,
                      unit: int = 1):
    """The rank's share: ``(out [B, Hq, T, D] normalised over its keys, max, sum [B, Hq, T] float32)``, query tile
    by query tile (``tile`` queries; a dense layer's tile also keeps its scores under :data:`TILE_ELEMENTS`).

    ``q [B, Hq, T, D]`` at ``q_pos [B, T]``, the group's query heads over the rank's prior ``k_prior, v_prior
    [B, H, S/G, D]`` (slots of positions ``< start``; ``None``: nothing precedes the call) and its active keys. With
    ``blocks [B, H, T, K]`` (``-1`` empty) only the selected blocks are read; without, every valid key. ``unit``:
    the ranks' interleave (``ops.layout``; above 1 only with every key in the caches, ``act`` None)."""
    b, hq, t, _ = q.shape
    if blocks is None:
        slots = 0 if k_prior is None else k_prior.shape[2]
        h, a = (k_prior.shape[1], 0) if act is None else (act.k.shape[1], act.pos.shape[1])
        cap = max(1, TILE_ELEMENTS // max(1, hq // h * (slots + a)))
        tile = min(tile or t, cap)
    outs = []
    for i0, i1 in _tiles(t, tile):
        act_i = _upto(act, i1, group)
        # a tile of a call from position 0 whose queries see at most top-k blocks is dense causal (every block it
        # sees would be selected): no gather
        if blocks is None or (k_prior is None and -(-i1 // block_size) <= blocks.shape[-1]):
            outs.append(_dense(q[:, :, i0:i1], k_prior, v_prior, act_i, q_pos[:, i0:i1], start, rank, group, scale,
                               unit))
        else:
            outs.append(_sparse(q[:, :, i0:i1], k_prior, v_prior, act_i, q_pos[:, i0:i1], start, blocks[:, :, i0:i1],
                                block_size, rank, group, scale, unit))
    return tuple(torch.cat(x, dim=2) for x in zip(*outs)) if len(outs) > 1 else outs[0]


def attention_step(q_local: torch.Tensor, k_prior: torch.Tensor | None, v_prior: torch.Tensor | None, act: Active,
                   q_pos: torch.Tensor, start: torch.Tensor, rank, group: Group, scale: float,
                   sel: Selection | None = None, iq: torch.Tensor | None = None,
                   ik_prior: torch.Tensor | None = None, topk_fn=None, one_gather: bool | None = None,
                   tile: int | None = None, split: QuerySplit | None = None, unit: int = 1) -> torch.Tensor:
    """One rank's attention output ``[B, Hl, T, D]`` for its own query heads ``q_local [B, Hl, T, D]`` at ``q_pos
    [B, T]``, over the prior caches (slots of positions ``< start [B]``) and the active keys ``act``.

    ``rank`` is the rank's index in the group (an int or a 0-d/1-element tensor: one SPMD graph for all ranks);
    ``group`` its collectives (:class:`Alone` for one rank). ``sel`` with the group's index queries ``iq [B, H, T,
    Di]`` (the same on every rank of the group) and the prior index keys ``ik_prior [B, S/G, Di]`` (or its parts along
    ``Di``, :func:`~minimax_m3.ops.indexer.index_block_scores`) makes the layer
    sparse; the line's blocks are those of ``ik_prior`` (without a prior, of the call's own keys), and a line of at
    most ``topk`` blocks is attended densely (the indexer would select every block). ``one_gather`` (default:
    ``T == 1``, decode) sends the query heads and the candidates in one all-gather. ``tile``: queries per tile (the
    index scores and the gathered keys of one tile are live at once; default: the whole call). ``topk_fn(x, k,
    dim=-1) -> (values, indices)`` replaces ``torch.topk`` (the Neuron port passes the SDK's top-k op). ``split``
    (:class:`QuerySplit`, with ``G = 1`` and no active keys): the ranks that hold the same index head select a share
    of the call's queries each and all-gather the block ids. ``unit``: how the group's line is dealt over its ranks
    (``ops.layout``): 1, token-interleaved (NxDI's shards), or the index block, whole blocks per rank (vLLM's decode
    context parallelism; every key already in the caches, ``act`` None): each rank then scores its own blocks and
    reads the selected blocks it holds, the candidate merge and the softmax merge as for tokens."""
    g, (b, hl, t, d) = group.size, q_local.shape
    if unit != 1 and (act is not None or (sel is not None and unit != sel.block_size)):
        raise ValueError(f"ranks interleaved by {unit} tokens: the step reads whole index blocks per rank "
                         f"(unit = the index block) with every key in the caches (no active keys)")
    one_gather = t == 1 if one_gather is None else one_gather
    nblk = 0
    if sel is not None:
        prior = ik_prior[0] if isinstance(ik_prior, (tuple, list)) else ik_prior  # a key in parts: their rows
        keys = (prior.shape[1] if prior is not None else act.ik.shape[1]) * g
        nblk = -(-keys // sel.block_size)
    cands = blocks = None
    if sel is not None and nblk > sel.topk and g == 1 and split is not None and split.applies(t, act):
        n = t // split.parts  # this rank's share of the queries, then the whole call's selection in one all-gather
        part = slice(split.index * n, (split.index + 1) * n)
        _, ids = _select(iq[:, :, part], ik_prior, act, q_pos[:, part], start, sel, rank, g, nblk, tile, topk_fn,
                         unit)
        blocks = split.gather(ids)
    elif sel is not None and nblk > sel.topk:
        scores, ids = _select(iq, ik_prior, act, q_pos, start, sel, rank, g, nblk, tile, topk_fn, unit)
        if g == 1:  # the rank's own candidates are the selection
            blocks = ids
        else:
            cands = torch.stack([scores, ids.float()], dim=-1)  # [B, H, T, K, 2]
    if g == 1:
        q = q_local
    elif cands is not None and one_gather:  # decode, verify: one all-gather carries the query heads and candidates
        h, kk = cands.shape[1], cands.shape[3]
        packed = torch.cat([q_local.float().transpose(1, 2).reshape(b, t, hl * d),
                            cands.transpose(1, 2).reshape(b, t, h * kk * 2)], dim=-1)
        got = group.all_gather(packed.unsqueeze(0), 0)  # [G, B, T, W]
        q = got[..., :hl * d].reshape(g, b, t, hl, d).permute(1, 0, 3, 2, 4).reshape(b, g * hl, t, d)
        q = q.to(q_local.dtype)
        cands = got[..., hl * d:].reshape(g, b, t, h, kk, 2).transpose(2, 3)  # [G, B, H, T, K, 2]
    else:
        q = group.all_gather(q_local, 1)  # [B, G * Hl, T, D]: the group's heads, in rank order
        if cands is not None:
            cands = group.all_gather(cands.unsqueeze(0), 0)
    if cands is not None:
        blocks = merge_candidates(cands[..., 0], cands[..., 1].to(torch.int64), nblk, sel.topk, topk_fn, unit > 1)
    out, top, total = partial_attention(q, k_prior, v_prior, act, q_pos, start, rank, g, scale, blocks,
                                        None if sel is None else sel.block_size, tile, unit)
    if g == 1:
        return out.to(q_local.dtype)
    part = torch.cat([out.float(), top.unsqueeze(-1), total.unsqueeze(-1)], dim=-1)  # [B, G * Hl, T, D + 2]
    got = group.exchange(part.view(b, g, hl, t, d + 2).transpose(0, 1).contiguous())  # [G, B, Hl, T, D + 2]
    return combine(got[..., :d], got[..., d], got[..., d + 1]).to(q_local.dtype)
