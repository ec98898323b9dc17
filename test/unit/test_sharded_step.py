"""``ops.attention_step`` (the per-rank step the Neuron port runs on sequence-sharded caches) against the unsharded ops,
every rank of a KV group run as a thread with a simulated group (barrier exchanges standing in for all-gather and
all-to-all).

Oracles: the former formulas (``test/support/oracles.py``): ``decode_step`` (prior caches + active token) and
``prefill_step(start=...)`` over the cache with the call written (both graded against transformers in test_decode_ops
/ test_prefill_tiles). Every rank's output must equal its own heads of the unsharded attention within 1e-5 (float32);
cache slots at and past each query's position hold large garbage (any read of them fails the check); small-integer
index keys make many block scores tie exactly (the merged selection must still equal the unsharded ``select_blocks``:
lower id wins).
"""

import pytest
import torch

from minimax_m3 import ops
from test.support import seq_shards as sh
from test.support import oracles

TOL = dict(rtol=0, atol=1e-5)
B, HL, D, DI, BS, S = 2, 2, 16, 8, 16, 128  # local query heads per rank, head dims, index block, cache length
GARBAGE = 1e3


def _rand(*shape, seed, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:
        return torch.randint(-2, 3, shape, generator=g).float()
    return torch.randn(*shape, generator=g)


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
    want = oracles.decode_step(q, kc, vc, k_new, v_new, q_pos, 0.25, sel, iq, ik if sel else None,
                           ik_new if sel else None)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ik, group, 1)

    def rank(i, member):
        act = ops.token_active(k_new, v_new, ik_new, q_pos, i, group)
        return ops.attention_step(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos.view(B, 1), q_pos,
                                 torch.tensor(i), member, 0.25, sel, iq, ik_sh[i])

    outs, calls = sh.run_group(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ops.step.COLLECTIVES["sparse decode" if sel else "dense"])


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("kind", list(SELS))
@pytest.mark.parametrize("start", [0, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_chunk_on_shards_equals_the_unsharded_prefill_of_the_written_cache(group, start, kind, tile):
    """A prefill call from a block boundary: its own keys read by selected block like the prior's, in one tile or
    in query tiles of 16 (the same numbers)."""
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
    want = oracles.prefill_step(q, written[0][:, :, :end], written[1][:, :, :end], 0.25, t, sel, iq,
                            written[2][:, :end] if sel else None, start=start)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ikc, group, 1)
    q_pos = (starts.view(-1, 1) + torch.arange(t)).expand(B, t)

    def rank(i, member):
        act = ops.call_active(k, v, ik, starts, i, group)
        return ops.attention_step(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos, starts, torch.tensor(i),
                                  member, 0.25, sel, iq, ik_sh[i], tile=tile)

    outs, calls = sh.run_group(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ops.step.COLLECTIVES["sparse prefill" if sel else "dense"])


@pytest.mark.parametrize("tile", [None, 16, 48])
@pytest.mark.parametrize("kind", list(SELS))
def test_a_prompt_without_prior_equals_the_former_prefill(kind, tile):
    """The replicated layout's one-call prefill (and the reference's first call): no prior cache at all, the call's
    own keys only, a ragged length (100 tokens: the last block partly filled), in query tiles."""
    sel, t = SELS[kind], 100
    q = _rand(B, HL, t, D, seed=41)
    k, v = _rand(B, 1, t, D, seed=42), _rand(B, 1, t, D, seed=43)
    iq, ik = _rand(B, 1, t, DI, seed=44, ints=True), _rand(B, t, DI, seed=45, ints=True)
    want = oracles.prefill_step(q, k, v, 0.25, 32, sel, iq, ik if sel else None)
    start = torch.zeros(B, dtype=torch.int64)
    act = ops.call_active(k, v, ik if sel else None, start, 0, 1)
    got = ops.attention_step(q, None, None, act, torch.arange(t).expand(B, t), start, 0, ops.Alone(), 0.25, sel, iq,
                             None, tile=tile)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", list(SELS))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_verify_step_on_shards_equals_the_unsharded_prefill_of_each_row(group, kind):
    """A speculative verify step: ``T`` tokens per row from each row's own position (any residue mod G), the
    tokens active on the ranks owning their positions, one all-gather (query heads and candidates packed) and one
    all-to-all. Oracle: per row, ``oracles.prefill_step(start=p)`` over the cache with the row's tokens written."""
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
        want.append(oracles.prefill_step(q[b:b + 1], kw[:, :, :p + t], vw[:, :, :p + t], 0.25, t, sel, iq[b:b + 1],
                                     ikw[:, :p + t] if sel else None, start=p))
    want = torch.cat(want)
    k_sh, v_sh, ik_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2), sh.shard(ikc, group, 1)
    q_pos = starts.view(-1, 1) + torch.arange(t)

    def rank(i, member):
        act = ops.token_active(k, v, ik, q_pos, i, group)
        return ops.attention_step(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i], act, q_pos, starts, torch.tensor(i),
                                 member, 0.25, sel, iq, ik_sh[i], one_gather=True)

    outs, calls = sh.run_group(group, rank)
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want[:, i * HL:(i + 1) * HL], **TOL)
    if group > 1:
        assert tuple(calls) == tuple(c for c, _ in ops.step.COLLECTIVES["sparse decode" if sel else "dense"])


def test_dense_prefill_is_tiled_by_queries_with_the_same_result(monkeypatch):
    """A dense chunk over a long prior splits its queries into tiles (``TILE_ELEMENTS``): same numbers."""
    t, start, group = 32, 64, 2
    starts = torch.full((B,), start)
    q, k, v = _rand(B, HL * group, t, D, seed=21), _rand(B, 1, t, D, seed=22), _rand(B, 1, t, D, seed=23)
    kc, vc = _rand(B, 1, S, D, seed=24), _rand(B, 1, S, D, seed=25)
    q_pos = (starts.view(-1, 1) + torch.arange(t)).expand(B, t)
    k_sh, v_sh = sh.shard(kc, group, 2), sh.shard(vc, group, 2)

    def run():
        return sh.run_group(group, lambda i, m: ops.attention_step(q[:, i * HL:(i + 1) * HL], k_sh[i], v_sh[i],
                                                          ops.call_active(k, v, None, starts, i, group), q_pos,
                                                          starts, i, m, 0.25))[0]

    whole = run()
    monkeypatch.setattr(ops.step, "TILE_ELEMENTS", HL * group * (S // group + t // group) * 5)  # 5-query tiles
    for a, b in zip(whole, run()):
        torch.testing.assert_close(a, b, **TOL)
