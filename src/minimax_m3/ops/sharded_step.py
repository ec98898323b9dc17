"""The attention step ONE rank of a KV group runs on the sequence-sharded caches (issue 23): what the Neuron port
calls, with its collectives passed in (:class:`Group`), so the same code runs under NxD's collectives and under the
tests' simulated group.

**Prior + active.** The caches are read, never written, here (the cache manager writes the step's tokens once, after
the layer, as NxDI does): a call of ``T`` tokens at positions ``start .. start+T-1`` (a prefill chunk, ``start`` a
multiple of ``G``), one token per row at ``q_pos`` (decode, ``start = q_pos``) or ``k + 1`` tokens per row from its
own position (a speculative verify step, ``start = q_pos[:, 0]``, any residue) attends to

* the PRIOR keys: the rank's shard slots of positions ``< start`` (:func:`ops.sharded.last_slot`), and
* the ACTIVE keys: the call's own tokens this rank will own (:func:`chunk_active`: tokens ``start + j*G + rank``;
  :func:`token_active`: a decode or verify step's tokens where ``q_pos mod G == rank``, elsewhere none).

Every rank of the group computes the call's K/V/index-K for all ``T`` tokens (NxDI replicates the KV head over the
group), keeps its residue and so reads ``1/G`` of every block.

**Step** (:func:`rank_attention`), per layer: sparse layers first score the rank's prior and active index keys per block
and keep their local top-k candidates (no query heads needed); an all-gather brings every rank the group's query heads
(each rank then attends ``R = G x local heads``, the heads sharing each gathered block) and, sparse, the group's
candidates, merged exactly (``ops.sharded.merge_candidates``, lower id wins ties) — in decode (and a speculative verify
step) ONE all-gather carries both (queries widened to float32, ids as float32: exact below 2**24 blocks); the partial
softmax over the rank's keys of the selected blocks (prior: one gather of ``K x block/G`` keys per query; active: the
call's residue, masked to the selected blocks); then ONE all-to-all by head hands each rank every rank's partial output,
maximum and sum for its own heads, merged by log-sum-exp (``ops.sharded.combine``). Collectives per layer
(``COLLECTIVES``): 2 in decode and verify, 3 in a sparse prefill call (query heads and candidates gathered apart: the
queries stay in their dtype), 2 in a dense one. With ``G = 1`` (the replicated layout, or a prefill chunk at TP <= KV
heads) the group ops are identities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .indexer import index_block_scores
from .sharded import _partial_softmax, _rank, combine, last_slot, local_candidates, merge_candidates

# what one layer adds per call, in order (kind, payload): the graph report lists these
_MERGE = ("all-to-all", "partial outputs + softmax max and sum by head (f32)")
COLLECTIVES = {
    "sparse decode": (("all-gather", "query heads + selection candidates (f32)"), _MERGE),  # and a verify step
    "sparse prefill": (("all-gather", "query heads"), ("all-gather", "selection candidates (f32 score, id)"), _MERGE),
    "dense": (("all-gather", "query heads"), _MERGE),
}
# a decode or verify call of fewer tokens per row than this packs its query heads and selection candidates into ONE
# all-gather (queries widened to float32): the port passes ``one_gather`` by it, the planner counts collectives by it
ONE_GATHER_TOKENS = 16
# score elements one query tile may hold (float32: 64 MiB): dense prefill over a long prior is tiled by queries
TILE_ELEMENTS = 2 ** 24


class Group(Protocol):
    """The KV group's collectives, in group order (rank ``i`` of the group is ``global rank mod G``)."""

    size: int

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in group order."""

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """All-to-all along dim 0: ``x [G, ...]``, part ``j`` for group rank ``j``; returns ``y [G, ...]`` with
        ``y[j]`` the part rank ``j`` sent this rank."""


class Alone:
    """The group of one rank: every collective is the identity."""

    size = 1

    def all_gather(self, x, dim):
        return x

    def exchange(self, x):
        return x


@dataclass
class Active:
    """The rank's active keys: ``k, v [B, H, A, D]`` at positions ``pos [B, A]`` (a position after every query
    when the rank owns none), index keys ``ik [B, A, Di]`` on sparse layers."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    ik: torch.Tensor | None = None


def residue(x: torch.Tensor, rank, group: int, seq_dim: int) -> torch.Tensor:
    """``x``'s tokens ``rank, rank + G, ...`` along ``seq_dim`` (length a multiple of ``G``)."""
    t = x.shape[seq_dim]
    mine = x.unflatten(seq_dim, (t // group, group)).index_select(seq_dim + 1, _rank(rank, x.device))
    return mine.squeeze(seq_dim + 1)


def chunk_active(k, v, ik, start: torch.Tensor, rank, group: int) -> Active:
    """A prefill chunk's active keys on ``rank``: its residue of the chunk's ``k, v [B, H, T, D]`` and index keys
    ``ik [B, T, Di]`` (or ``None``), at positions ``start + j*G + rank`` (``start [B]``, a multiple of ``G``)."""
    a = k.shape[2] // group
    pos = start.view(-1, 1) + torch.arange(a, device=k.device).view(1, -1) * group + _rank(rank, k.device)
    return Active(residue(k, rank, group, 2), residue(v, rank, group, 2), pos,
                  None if ik is None else residue(ik, rank, group, 1))


def token_active(k, v, ik, q_pos: torch.Tensor, rank, group: int) -> Active:
    """Decode and verify: row ``b``'s ``T`` tokens ``k, v [B, H, T, D]`` (index keys ``ik [B, T, Di]``) at
    positions ``q_pos [B, T]`` (consecutive from any start; ``[B]`` for one token) are active on the rank that owns
    each position; elsewhere a token's position is set past the row's last query (masked)."""
    q_pos = q_pos.view(q_pos.shape[0], -1)
    own = q_pos % group == _rank(rank, q_pos.device)
    return Active(k, v, torch.where(own, q_pos, q_pos[:, -1:] + 1), ik)


def block_scores(iq: torch.Tensor, ik_prior: torch.Tensor, act: Active, q_pos: torch.Tensor, start: torch.Tensor,
                 block_size: int, rank, group: int) -> torch.Tensor:
    """``[B, H, T, nblk]`` float32: the rank's partial block scores, ``iq [B, H, T, Di]`` against its prior index
    keys (``ik_prior [B, S/G, Di]``, positions ``< start``) and its active ones, max-pooled into the ``S/block``
    blocks of the whole line (``-inf`` where it holds no key the query may see)."""
    b, h, t, _ = iq.shape
    limit = last_slot(start.view(-1, 1) - 1, rank, group).expand(b, t)
    scores = index_block_scores(iq, ik_prior, limit, block_size // group)
    nblk = scores.shape[-1]
    act_s = torch.matmul(iq, act.ik.unsqueeze(1).transpose(-1, -2)).float()  # [B, H, T, A], as index_block_scores
    act_s = act_s.masked_fill(act.pos.view(b, 1, 1, -1) > q_pos.view(b, 1, t, 1), float("-inf"))
    blk = (act.pos // block_size).clamp(max=nblk - 1).view(b, 1, 1, -1).expand_as(act_s)
    return scores.scatter_reduce(-1, blk, act_s, reduce="amax", include_self=True)


def partial_attention(q: torch.Tensor, k_prior: torch.Tensor, v_prior: torch.Tensor, act: Active,
                      q_pos: torch.Tensor, start: torch.Tensor, rank, group: int, scale: float,
                      blocks: torch.Tensor | None = None, block_size: int | None = None):
    """The rank's share: ``(out [B, Hq, T, D] normalised over its keys, max, sum [B, Hq, T] float32)``.

    ``q [B, Hq, T, D]`` at ``q_pos [B, T]``, the group's query heads over the rank's prior shard ``k_prior, v_prior
    [B, H, S/G, D]`` (slots of positions ``< start``) and its active keys. With ``blocks [B, H, T, K]`` (``-1``
    empty) the prior is read block by block (one gather of ``K x block/G`` keys per query and KV head, shared by its
    query heads) and active keys count only in a selected block; without, every valid key (dense layers; the
    queries are tiled so a tile's scores stay under ``TILE_ELEMENTS``)."""
    b, hq, t, d = q.shape
    h, slots = k_prior.shape[1], k_prior.shape[2]
    r = hq // h
    limit = last_slot(start.view(-1, 1) - 1, rank, group)  # [B, 1]: the last prior slot
    act_keep = act.pos.view(b, 1, -1) <= q_pos.view(b, t, 1)  # [B, T, A]
    if blocks is not None:
        return _sparse(q, k_prior, v_prior, act, act_keep, limit, blocks, block_size // group, block_size, scale)
    tile = max(1, min(t, TILE_ELEMENTS // max(1, r * (slots + act.pos.shape[1]))))
    outs = [_dense(q[:, :, i:i + tile], k_prior, v_prior, act, act_keep[:, i:i + tile], limit, scale)
            for i in range(0, t, tile)]
    return tuple(torch.cat(x, dim=2) for x in zip(*outs)) if len(outs) > 1 else outs[0]


def _dense(q, k, v, act: Active, act_keep, limit, scale):
    b, hq, t, d = q.shape
    h, slots, a = k.shape[1], k.shape[2], act.k.shape[2]
    r = hq // h
    qg = q.reshape(b, h, r * t, d)
    prior = torch.matmul(qg, k.transpose(-1, -2)).view(b, h, r, t, slots)
    active = torch.matmul(qg, act.k.transpose(-1, -2)).view(b, h, r, t, a)
    keep = torch.cat([(torch.arange(slots, device=q.device).view(1, slots) <= limit).view(b, 1, 1, 1, slots)
                      .expand(b, 1, 1, t, slots), act_keep.view(b, 1, 1, t, a)], dim=-1)
    p, top, total = _partial_softmax(torch.cat([prior, active], dim=-1) * scale, keep)
    p = p.to(v.dtype)
    out = torch.matmul(p[..., :slots].reshape(b, h, r * t, slots), v) \
        + torch.matmul(p[..., slots:].reshape(b, h, r * t, a), act.v)
    return out.view(b, hq, t, d), top.view(b, hq, t), total.view(b, hq, t)


def _sparse(q, k, v, act: Active, act_keep, limit, blocks, per, block_size, scale):
    b, hq, t, d = q.shape
    h, slots, a = k.shape[1], k.shape[2], act.k.shape[2]
    r, nblk, kk = hq // h, slots // per, blocks.shape[-1]
    base = (torch.arange(b * h, device=q.device) * nblk).view(b, h, 1, 1)
    rows = (base + blocks.clamp(min=0)).reshape(-1)  # one row per selected block: [B, H, T, K]
    kg = k.reshape(b * h * nblk, per, d).index_select(0, rows).view(b, h, t, kk * per, d)
    vg = v.reshape(b * h * nblk, per, d).index_select(0, rows).view(b, h, t, kk * per, d)
    slot = blocks.clamp(min=0).unsqueeze(-1) * per + torch.arange(per, device=q.device)  # [B, H, T, K, per]
    prior_keep = ((blocks >= 0).unsqueeze(-1) & (slot <= limit.view(b, 1, 1, 1, 1))).view(b, h, t, 1, kk * per)
    picked = ((act.pos // block_size).view(b, 1, 1, 1, a) == blocks.unsqueeze(-1)).any(dim=-2)  # [B, H, T, A]
    active_keep = (picked & act_keep.view(b, 1, t, a)).view(b, h, t, 1, a)
    qg = q.reshape(b, h, r, t, d).transpose(2, 3)  # [B, H, T, r, D]: the heads share the gather
    prior = torch.matmul(qg, kg.transpose(-1, -2))  # [B, H, T, r, K*per]
    active = torch.matmul(qg, act.k.transpose(-1, -2).unsqueeze(2))  # [B, H, T, r, A]
    keep = torch.cat([prior_keep.expand(b, h, t, r, kk * per), active_keep.expand(b, h, t, r, a)], dim=-1)
    p, top, total = _partial_softmax(torch.cat([prior, active], dim=-1) * scale, keep)
    p = p.to(v.dtype)
    out = torch.matmul(p[..., :kk * per], vg) + torch.matmul(p[..., kk * per:], act.v.unsqueeze(2))
    return (out.transpose(2, 3).reshape(b, hq, t, d), top.transpose(2, 3).reshape(b, hq, t),
            total.transpose(2, 3).reshape(b, hq, t))


def rank_attention(q_local: torch.Tensor, k_prior: torch.Tensor, v_prior: torch.Tensor, act: Active,
                   q_pos: torch.Tensor, start: torch.Tensor, rank, group: Group, scale: float, sel=None,
                   iq: torch.Tensor | None = None, ik_prior: torch.Tensor | None = None,
                   topk_fn=None, one_gather: bool | None = None) -> torch.Tensor:
    """One rank's attention output ``[B, Hl, T, D]`` for its own query heads ``q_local [B, Hl, T, D]``.

    ``rank`` is the rank's index in the group (an int or a 0-d/1-element tensor: one SPMD graph for all ranks);
    ``sel`` (an ``ops.Selection``) with the group's index queries ``iq [B, H, T, Di]`` (the same on every rank of the
    group) and the prior index keys ``ik_prior [B, S/G, Di]`` makes the layer sparse; a line of at most ``topk``
    blocks is attended densely (the indexer would select every block). ``one_gather`` (default: ``T == 1``, decode)
    sends the query heads and the candidates in one all-gather (queries widened to float32: a verify step's few
    tokens per row; a prefill call keeps its queries in their dtype, two all-gathers)."""
    g, (b, hl, t, d) = group.size, q_local.shape
    one_gather = t == 1 if one_gather is None else one_gather
    nblk = k_prior.shape[2] * g // sel.block_size if sel is not None else 0
    cands = None
    if sel is not None and nblk > sel.topk:
        partial = block_scores(iq, ik_prior, act, q_pos, start, sel.block_size, rank, g)
        scores, ids = local_candidates(partial, q_pos, sel.block_size, sel.topk, sel.init_blocks, sel.local_blocks,
                                       topk_fn)
        cands = torch.stack([scores, ids.float()], dim=-1)  # [B, H, T, K, 2]
    if cands is not None and one_gather:  # decode, verify: one all-gather carries the query heads and candidates
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
    blocks = None
    if cands is not None:
        blocks = merge_candidates(cands[..., 0], cands[..., 1].to(torch.int64), nblk, sel.topk, topk_fn)
    out, top, total = partial_attention(q, k_prior, v_prior, act, q_pos, start, rank, g, scale, blocks,
                                        None if sel is None else sel.block_size)
    part = torch.cat([out.float(), top.unsqueeze(-1), total.unsqueeze(-1)], dim=-1)  # [B, G * Hl, T, D + 2]
    got = group.exchange(part.view(b, g, hl, t, d + 2).transpose(0, 1).contiguous())  # [G, B, Hl, T, D + 2]
    return combine(got[..., :d], got[..., d], got[..., d + 1]).to(q_local.dtype)
