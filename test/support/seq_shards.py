"""Simulated ranks of a KV group for the tests, built on the one attention step (``ops.attention_step``).

* :class:`ThreadGroup` / :func:`run_group`: every rank of a group runs as a thread; each collective exchanges every
  member's tensor through a barrier (the ``ops.Group`` protocol), and the group records the collectives' kinds.
* :func:`shard`: an unsharded cache cut into the ranks' shards (rank ``r``: positions ``r, r+G, ...``).
* :func:`write_call`: a prefill call's tokens written into one rank's shard, as the Neuron port's cache manager
  writes them (the rank's residue, ``ops.step.residue``, at slots ``start/G ..``).
* :func:`partial_block_scores`, :func:`sharded_select`: the selection over the shards (local candidates on each
  rank, stacked as the all-gather stacks them, merged), as the step runs it.
* :func:`gathered_kv_bytes`: K and V bytes one rank gathers per sparse layer, by hand.

Test-only: no backend imports this module.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from minimax_m3.config.parallel import LayoutError
from minimax_m3.ops import write_positions
from minimax_m3.ops.indexer import index_block_scores, local_candidates, merge_candidates
from minimax_m3.ops.layout import last_slot
from minimax_m3.ops.step import residue


class ThreadGroup:
    """A KV group of ``size`` ranks as threads: each collective exchanges every member's tensor through a barrier."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size
        self.calls = []

    def member(self, i: int):
        return _Member(self, i)


class _Member:
    def __init__(self, grp: ThreadGroup, i: int):
        self.grp, self.i, self.size = grp, i, grp.size

    def _exchange(self, x, kind):
        self.grp.slots[self.i] = x.clone()
        self.grp.barrier.wait()
        got = list(self.grp.slots)
        if self.i == 0:
            self.grp.calls.append(kind)
        self.grp.barrier.wait()
        return got

    def all_gather(self, x, dim):
        return torch.cat(self._exchange(x, "all-gather"), dim=dim)

    def exchange(self, x):
        return torch.stack([part[self.i] for part in self._exchange(x, "all-to-all")])


def run_group(group: int, fn):
    """``fn(rank, member)`` on every rank of a group of ``group`` threads: ``(outputs by rank, collectives)``."""
    grp = ThreadGroup(group)
    with ThreadPoolExecutor(group) as pool:
        outs = list(pool.map(lambda i: fn(i, grp.member(i)), range(group)))
    return outs, grp.calls


def shard(cache: torch.Tensor, group: int, seq_dim: int) -> list[torch.Tensor]:
    """The ``G`` shards of an unsharded cache (rank ``r``: positions ``r, r+G, ...``), contiguous copies."""
    s = cache.shape[seq_dim]
    return [cache.index_select(seq_dim, torch.arange(r, s, group, device=cache.device)) for r in range(group)]


def write_call(shard_: torch.Tensor, new: torch.Tensor, start, rank, group: int, seq_dim: int) -> torch.Tensor:
    """Write ``rank``'s tokens of a call into its shard, in place: ``new`` holds ``T`` tokens (``T`` a multiple of
    ``G``) at positions ``start .. start+T-1`` along ``seq_dim``, ``start`` (an int, or ``[B]`` per row) a multiple of
    ``G``."""
    t = new.shape[seq_dim]
    if t % group or (isinstance(start, int) and start % group):
        raise LayoutError(f"a chunk of {t} tokens at position {start} does not split over a group of {group} ranks: "
                          f"both must be multiples of {group}")
    start = torch.as_tensor(start, device=new.device).view(-1, 1)
    slots = (start // group + torch.arange(t // group, device=new.device).view(1, -1)).expand(new.shape[0], -1)
    return write_positions(shard_, residue(new, rank, group, seq_dim).to(shard_.dtype), slots, seq_dim)


def partial_block_scores(iq: torch.Tensor, ik_shard: torch.Tensor, q_pos: torch.Tensor, block_size: int, rank,
                         group: int) -> torch.Tensor:
    """``[B, H, Tq, nblk]``: ``iq`` against ``rank``'s index keys, max-pooled over its ``block/G`` keys of each block
    (``-inf`` where it has no key the query may see)."""
    return index_block_scores(iq, ik_shard, last_slot(q_pos, rank, group), block_size // group)


def sharded_select(iq: torch.Tensor, ik_shards: list[torch.Tensor], q_pos: torch.Tensor, sel,
                   topk_fn=None) -> torch.Tensor:
    """The merged selection ``[B, H, Tq, K]`` of the queries ``iq`` at ``q_pos [B, Tq]`` over the index-key shards
    (``sel``: an ``ops.Selection``): local candidates per rank, stacked (the all-gather), merged."""
    group = len(ik_shards)
    cands = [local_candidates(partial_block_scores(iq, ik, q_pos, sel.block_size, r, group), q_pos, sel.block_size,
                              sel.topk, sel.init_blocks, sel.local_blocks, topk_fn)
             for r, ik in enumerate(ik_shards)]
    nblk = ik_shards[0].shape[1] * group // sel.block_size
    return merge_candidates(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]), nblk, sel.topk,
                            topk_fn)


def gathered_kv_bytes(tokens: int, topk: int, block_size: int, group: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes one rank gathers for ``tokens`` queries of one KV head in a sparse layer (per batch row):
    ``tokens x topk x (block/G) x D x 2 x dtype bytes``."""
    return tokens * topk * (block_size // group) * head_dim * 2 * dtype_bytes
