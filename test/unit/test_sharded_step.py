"""``ops.sharded_step.rank_attention`` (the per-rank step the Neuron port runs on sequence-sharded caches) against the
unsharded ops, every rank of a KV group run as a thread with a simulated group (barrier exchanges standing in for
all-gather and all-to-all).

Oracles: ``ops.decode_step`` (prior caches + active token) and ``ops.prefill_step(start=...)`` over the cache with the
chunk written (both graded against transformers in test_decode_ops / test_prefill_chunks). Every rank's output must
equal its own heads of the unsharded attention within 1e-5 (float32); cache slots at and past each query's position
hold large garbage (any read of them fails the check); small-integer index keys make many block scores tie exactly
(the merged selection must still equal the unsharded ``select_blocks``: lower id wins).
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minimax_m3 import ops
from minimax_m3.ops import sharded as sh
from minimax_m3.ops import sharded_step as ss

TOL = dict(rtol=0, atol=1e-5)
B, HL, D, DI, BS, S = 2, 2, 16, 8, 16, 128  # local query heads per rank, head dims, index block, cache length
GARBAGE = 1e3


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


def _rand(*shape, seed, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:
        return torch.randint(-2, 3, shape, generator=g).float()
    return torch.randn(*shape, generator=g)


def _run(group: int, fn):
    grp = ThreadGroup(group)
    with ThreadPoolExecutor(group) as pool:
        outs = list(pool.map(lambda i: fn(i, grp.member(i)), range(group)))
    return outs, grp.calls


def _garbage_past(cache, first):
    """``cache [B, ..., S, ...]`` (seq dim 2 or 1) with slots ``>= first[b]`` set to large garbage."""
    out, dim = cache.clone(), 2 if cache.dim() == 4 else 1
    for b, p in enumerate(first.tolist()):
        out[b].narrow(dim - 1, p, cache.shape[dim] - p).fill_(GARBAGE)
    return out


SELS = {"dense": None, "sparse": ops.Selection(BS, 2, 0, 1), "sparse-init": ops.Selection(BS, 3, 1, 1)}


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("kind", list(SELS))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_on_shards_equals_unsharded_decode(group, kind, ties):
    sel, hq = SELS[kind], HL * group
    q_pos = torch.tensor([77, 40])  # rows at different positions (owned by different ranks)
    q = _rand(B, hq, 1, D, seed=1)
    kc, vc = _garbage_past(_rand(B, 1, S, D, seed=2), q_pos), _garbage_past(_rand(B, 1, S, D, seed=3), q_pos)
    k_new, v_new = _rand(B, 1, 1, D, seed=4), _rand(B, 1, 1, D, seed=5)
    iq = _rand(B, 1, 1, DI, seed=6, ints=ties)
    ik = _garbage_past(_rand(B, S, DI, seed=7, ints=ties), q_pos)
    ik_new = _rand(B, 1, DI, seed=8, ints=ties)
    want = ops.decode_step(q, kc, vc, k_new, v_new, q_pos, 0.25, sel, iq, ik if sel else None,
                           ik_new if sel else None)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ik, group, 1)

    def rank(i, member):
        act = ss.token_active(k_new, v_new, ik_new, q_pos, i, group)
        return ss.rank_attention(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos.view(B, 1), q_pos,
                                 torch.tensor(i), member, 0.25, sel, iq, ik_sh[i])

    outs, calls = _run(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ss.COLLECTIVES["sparse decode" if sel else "dense"])


@pytest.mark.parametrize("kind", list(SELS))
@pytest.mark.parametrize("start", [0, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_chunk_on_shards_equals_the_unsharded_prefill_of_the_written_cache(group, start, kind):
    sel, hq, t = SELS[kind], HL * group, 32
    starts = torch.full((B,), start)
    q = _rand(B, hq, t, D, seed=11)
    k, v = _rand(B, 1, t, D, seed=12), _rand(B, 1, t, D, seed=13)
    iq, ik = _rand(B, 1, t, DI, seed=14, ints=True), _rand(B, t, DI, seed=15, ints=True)
    kc, vc = _garbage_past(_rand(B, 1, S, D, seed=16), starts), _garbage_past(_rand(B, 1, S, D, seed=17), starts)
    ikc = _garbage_past(_rand(B, S, DI, seed=18, ints=True), starts)
    written = [x.clone() for x in (kc, vc, ikc)]
    written[0][:, :, start:start + t], written[1][:, :, start:start + t], written[2][:, start:start + t] = k, v, ik
    end = start + t
    want = ops.prefill_step(q, written[0][:, :, :end], written[1][:, :, :end], 0.25, t, sel, iq,
                            written[2][:, :end] if sel else None, start=start)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ikc, group, 1)
    q_pos = (starts.view(-1, 1) + torch.arange(t)).expand(B, t)

    def rank(i, member):
        act = ss.chunk_active(k, v, ik, starts, i, group)
        return ss.rank_attention(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos, starts, torch.tensor(i),
                                 member, 0.25, sel, iq, ik_sh[i])

    outs, calls = _run(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ss.COLLECTIVES["sparse prefill" if sel else "dense"])


@pytest.mark.parametrize("kind", list(SELS))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_verify_step_on_shards_equals_the_unsharded_prefill_of_each_row(group, kind):
    """A speculative verify step: ``T`` tokens per row from each row's own position (any residue mod G), the
    tokens active on the ranks owning their positions, one all-gather (query heads and candidates packed) and one
    all-to-all. Oracle: per row, ``ops.prefill_step(start=p)`` over the cache with the row's tokens written."""
    sel, hq, t = SELS[kind], HL * group, 4
    starts = torch.tensor([77, 45])  # different residues mod 2 and 4; row 0 crosses the block boundary at 80
    q = _rand(B, hq, t, D, seed=31)
    k, v = _rand(B, 1, t, D, seed=32), _rand(B, 1, t, D, seed=33)
    iq, ik = _rand(B, 1, t, DI, seed=34, ints=True), _rand(B, t, DI, seed=35, ints=True)
    kc, vc = _garbage_past(_rand(B, 1, S, D, seed=36), starts), _garbage_past(_rand(B, 1, S, D, seed=37), starts)
    ikc = _garbage_past(_rand(B, S, DI, seed=38, ints=True), starts)
    want = []
    for b, p in enumerate(starts.tolist()):
        kw, vw, ikw = kc[b:b + 1].clone(), vc[b:b + 1].clone(), ikc[b:b + 1].clone()
        kw[:, :, p:p + t], vw[:, :, p:p + t], ikw[:, p:p + t] = k[b:b + 1], v[b:b + 1], ik[b:b + 1]
        want.append(ops.prefill_step(q[b:b + 1], kw[:, :, :p + t], vw[:, :, :p + t], 0.25, t, sel, iq[b:b + 1],
                                     ikw[:, :p + t] if sel else None, start=p))
    want = torch.cat(want)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ikc, group, 1)
    q_pos = starts.view(-1, 1) + torch.arange(t)

    def rank(i, member):
        act = ss.token_active(k, v, ik, q_pos, i, group)
        return ss.rank_attention(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos, starts, torch.tensor(i),
                                 member, 0.25, sel, iq, ik_sh[i], one_gather=True)

    outs, calls = _run(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ss.COLLECTIVES["sparse decode" if sel else "dense"])


def test_dense_prefill_is_tiled_by_queries_with_the_same_result(monkeypatch):
    """A dense chunk over a long prior splits its queries into tiles (``TILE_ELEMENTS``): same numbers."""
    t, start, group = 32, 64, 2
    starts = torch.full((B,), start)
    q, k, v = _rand(B, HL * group, t, D, seed=21), _rand(B, 1, t, D, seed=22), _rand(B, 1, t, D, seed=23)
    kc, vc = _rand(B, 1, S, D, seed=24), _rand(B, 1, S, D, seed=25)
    q_pos = (starts.view(-1, 1) + torch.arange(t)).expand(B, t)
    k_sh, v_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2)

    def run():
        return _run(group, lambda i, m: ss.rank_attention(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i],
                                                          ss.chunk_active(k, v, None, starts, i, group), q_pos,
                                                          starts, i, m, 0.25))[0]

    whole = run()
    monkeypatch.setattr(ss, "TILE_ELEMENTS", HL * group * (S // group + t // group) * 5)  # 5-query tiles
    for a, b in zip(whole, run()):
        torch.testing.assert_close(a, b, **TOL)
