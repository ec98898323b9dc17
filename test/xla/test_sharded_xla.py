"""Static-graph proof of the sequence-sharded layout's per-rank ops (``ops.layout``, ``ops.step``) on the XLA CPU
device.

One rank's share of a prefill chunk and of a decode step (``ops.step``, as the port runs it, the collectives
stood in): its block scores over its prior shard and active keys, local candidates, the merge of the group's
candidates, its partial attention over the selected blocks and over its whole shard, the combine, and the chunk /
token writes into the rank's shards. Outputs equal the eager CPU run (float32, <= 1e-5; block
ids identical), one compilation for a new shape, none for new data, other positions or ANOTHER RANK (the rank is a
tensor: one SPMD graph serves the group), and no op falls back to the CPU (fixture ``xla``).
"""

import torch

from minimax_m3 import ops
from test.support import seq_shards as sh

from .conftest import run_on_xla

TOL = dict(rtol=0, atol=1e-5)
B, HKV, R, D, DI, BS, TOPK, S, G, T = 2, 2, 2, 16, 8, 16, 3, 256, 4, 32


def _inputs(seed: int, start: int, pos: list[int], rank: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    shards = (r(B, HKV, S // G, D), r(B, HKV, S // G, D), r(B, S // G, DI))
    chunk = (r(B, HKV * R, T, D), r(B, HKV, T, D), r(B, HKV, T, D), r(B, HKV, T, DI), r(B, T, DI))
    token = (r(B, HKV * R, 1, D), r(B, HKV, 1, D), r(B, HKV, 1, D), r(B, HKV, 1, DI), r(B, 1, DI))
    others = (r(G, B, HKV, T, TOPK), torch.randint(-1, S // BS, (G, B, HKV, T, TOPK), generator=g))
    return (*shards, *chunk, *token, *others, torch.tensor(start), torch.tensor(pos), torch.tensor(rank))


def _rank_step(kc, vc, ikc, q, k, v, iq, ik, qt, kt, vt, iqt, ikt, other_s, other_i, start, pos, rank):
    """A rank's prefill chunk at ``start`` (its prior shard plus its residue of the chunk, ``ops.step``), the
    chunk then written, and a decode step at ``pos`` (the other ranks' candidates and statistics are stand-ins: the
    collectives are not part of the graph)."""
    scale = D ** -0.5
    starts = start.expand(B)
    q_pos = (start + torch.arange(T, device=q.device)).expand(B, T)
    act = ops.call_active(k, v, ik, starts, rank, G)
    partial = ops.step.block_scores(iq, ikc, act, q_pos, starts, BS, rank, G, S // BS)
    cand = ops.local_candidates(partial, q_pos, BS, TOPK, 1, 1)
    blocks = ops.merge_candidates(torch.cat([cand[0][None], other_s[1:]]), torch.cat([cand[1][None], other_i[1:]]),
                                 S // BS, TOPK)
    o, m, s = ops.step.partial_attention(q, kc, vc, act, q_pos, starts, rank, G, scale, blocks, BS)
    prefill = ops.combine(torch.stack([o, o.flip(1)]), torch.stack([m, m - 1]), torch.stack([s, s]))
    for cache, new, dim in ((kc, k, 2), (vc, v, 2), (ikc, ik, 1)):
        sh.write_call(cache, new, start, rank, G, seq_dim=dim)
    p1 = pos.view(B, 1)
    act_t = ops.token_active(kt, vt, ikt, pos, rank, G)
    partial_t = ops.step.block_scores(iqt, ikc, act_t, p1, pos, BS, rank, G, S // BS)
    cand_t = ops.local_candidates(partial_t, p1, BS, TOPK, 1, 1)
    blocks_t = ops.merge_candidates(cand_t[0][None], cand_t[1][None], S // BS, TOPK)
    sparse = ops.step.partial_attention(qt, kc, vc, act_t, p1, pos, rank, G, scale, blocks_t, BS)
    dense = ops.step.partial_attention(qt, kc, vc, act_t, p1, pos, rank, G, scale)
    for cache, new, dim in ((kc, kt, 2), (vc, vt, 2), (ikc, ikt, 1)):
        ops.layout.write_token(cache, new, pos, rank, G, seq_dim=dim)
    return prefill, blocks, *sparse, *dense, blocks_t, kc, ikc


def _check(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype == torch.int64:
            assert torch.equal(a, b), i
        else:
            torch.testing.assert_close(a, b, **TOL, equal_nan=False)


def test_rank_step_matches_eager_one_graph_for_every_rank_and_position(xla):
    args = _inputs(0, start=64, pos=[96, 130], rank=1)
    want = _rank_step(*[a.clone() for a in args])
    got, n1 = run_on_xla(_rank_step, *args)
    _check(got, want)
    assert (want[1] >= 0).all() and (want[-3] >= 0).all()  # the selections are real (no empty slot)
    assert n1 == 1, f"first call at a new shape compiled {n1} graphs, expected 1"

    args2 = _inputs(1, start=160, pos=[199, 224], rank=3)  # new data, positions and rank, same shapes
    want2 = _rank_step(*[a.clone() for a in args2])
    got2, n2 = run_on_xla(_rank_step, *args2)
    _check(got2, want2)
    assert n2 == 0, f"new data / positions / rank recompiled ({n2} graphs)"
    assert not torch.allclose(got2[0], got[0])  # the new data reached the graph
