"""The sequence-sharded cache layout: where each token of a KV group's caches lives, and the rules its sizes follow.

The ``G`` ranks of a KV group share its caches (NxDI's flash-decoding layout): token ``p`` lives on group rank
``p mod G`` at slot ``p div G`` (:func:`owner`). A rank's shard of a ``[B, H, S, D]`` cache is ``[B, H, S/G, D]``;
of the index keys ``[B, S, Di]``, ``[B, S/G, Di]`` (each group holds one full copy, sharded ``G`` ways, so a group's
selection never leaves the group). ``G`` must divide the index block (``check_layout``): every rank then holds
``block/G`` keys of every block (slots ``j*block/G ..`` of block ``j``), so any selection is balanced. A prefill call
of ``T`` tokens starts on a block boundary and ``T`` is a multiple of ``call_unit = lcm(block, G)``
(``check_call``): each rank writes its ``T/G`` tokens (``step.residue``); decode writes one token per row on the
rank that owns it (:func:`write_token`). ``G = 1`` is the replicated layout: every slot on the rank. The size rules
(``G`` divides the block, a call is a multiple of ``lcm(block, G)``) are integer arithmetic with the other
parallel-layout rules in ``config.parallel`` (``check_layout``, ``call_unit``, ``check_call``).

**Block-interleaved** (vLLM's decode context parallelism, whose plugin deals whole blocks): with ``unit`` = the
index block, block ``n`` lives whole on rank ``n mod G``, the rank's local block ``n div G`` (:func:`last_slot`
takes ``unit``). A selected block is then read on one rank only; the step masks the others'.

The attention step over this layout is :func:`minimax_m3.ops.step.attention_step`. Every rank may be passed as an int
or a 0-d tensor (one SPMD graph for all ranks). XLA-safe (``test/xla``).
"""

from __future__ import annotations

import torch


def owner(positions: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group rank, slot)`` of each position: ``(p mod G, p div G)``."""
    return positions % group, positions // group


def rank_index(rank, device) -> torch.Tensor:
    """``rank`` (an int or a 0-d/1-element tensor) as a 1-element int64 tensor."""
    return torch.as_tensor(rank, dtype=torch.int64, device=device).reshape(1)


def last_slot(q_pos: torch.Tensor, rank, group: int, unit: int = 1) -> torch.Tensor:
    """The last slot of ``rank``'s shard a query at ``q_pos`` may read (causal: key position ``<= q_pos``; ``-1``:
    none). Token-interleaved (``unit`` 1): slot ``i`` holds position ``i*G + rank``, so ``i <= floor((q_pos - rank)
    / G)``. Interleaved by ``unit`` tokens (vLLM's decode context parallelism, ``unit`` = its block): slot ``i``
    holds ``(i div unit) * unit * G + rank * unit + i mod unit``; the positions grow with the slot, so the rank
    reads its slots up to this one."""
    r = rank_index(rank, q_pos.device)
    if unit == 1:
        return torch.div(q_pos - r, group, rounding_mode="floor")
    span = unit * group
    lap, off = torch.div(q_pos, span, rounding_mode="floor"), q_pos % span
    owner_ = torch.div(off, unit, rounding_mode="floor")  # the rank that holds q_pos's unit
    within = torch.where(owner_ == r, off % unit, torch.where(owner_ > r, unit - 1, -1))
    return lap * unit + within


def write_token(shard: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, rank, group: int,
                seq_dim: int) -> torch.Tensor:
    """Decode: write one token per row (``new`` with ``1`` along ``seq_dim``, at positions ``pos [B]``) into the
    shard, in place, where ``rank`` owns it (``pos mod G == rank``); the other rows keep their slot's value."""
    b = new.shape[0]
    shape = [1] * new.dim()
    shape[0] = b
    index = (pos // group).view(shape).expand_as(new)
    owned = (pos % group == rank_index(rank, pos.device)).view(shape)
    return shard.scatter_(seq_dim, index, torch.where(owned, new.to(shard.dtype), torch.gather(shard, seq_dim, index)))
