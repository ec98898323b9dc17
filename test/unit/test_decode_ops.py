"""Decode as prior cache + active token (the ``*_prior_active`` ops) against the existing formulas and by hand.

Oracles: (1) a float64 softmax written out key by key; (2) the write-then-attend formulas the reference backend
uses (``write_positions`` of the active token into a copy of the cache, then ``decode_attention_dense`` /
``select_blocks_for_queries`` / ``decode_attention_sparse``). The prior caches carry garbage at the active slot
and beyond, so a read of a stale slot shows up. Tolerance: float32 rounding (the two parts of the softmax are
summed in another order), 2e-6 absolute; block ids must be identical as sets.
"""

import pytest
import torch

from minimax_m3 import ops
from test.support import oracles

TOL = dict(rtol=0, atol=2e-6)
B, HQ, HKV, D, DI, G = 2, 8, 2, 16, 8, 2


def _setup(seed: int, s: int, pos: list[int]):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, 1, D, generator=g)
    kc, vc = torch.randn(B, HKV, s, D, generator=g), torch.randn(B, HKV, s, D, generator=g)
    k_new, v_new = torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g)
    ikc, ik_new = torch.randn(B, s, DI, generator=g), torch.randn(B, 1, DI, generator=g)
    iq = torch.randn(B, G, 1, DI, generator=g)
    q_pos = torch.tensor(pos)
    written = [ops.write_positions(c.clone(), n, q_pos.view(B, 1), seq_dim=d)
               for c, n, d in ((kc, k_new, 2), (vc, v_new, 2), (ikc, ik_new, 1))]
    return q, kc, vc, k_new, v_new, ikc, ik_new, iq, q_pos, written


def test_attend_prior_active_is_one_softmax_over_kept_keys_and_active_key_by_hand():
    s, scale = 12, 0.3
    q, kc, vc, k_new, v_new, *_ = _setup(0, s, [5, 11])
    g = torch.Generator().manual_seed(9)
    keep = torch.rand(B, HKV, 1, s, generator=g) > 0.5
    got = oracles.attend_prior_active(q, kc, vc, keep, k_new, v_new, scale)
    r = HQ // HKV
    for b in range(B):
        for h in range(HQ):
            grp = h // r
            keys = [kc[b, grp, t] for t in range(s) if keep[b, grp, 0, t]] + [k_new[b, grp, 0]]
            vals = [vc[b, grp, t] for t in range(s) if keep[b, grp, 0, t]] + [v_new[b, grp, 0]]
            sc = torch.stack([scale * (q[b, h, 0].double() @ k.double()) for k in keys])
            p = torch.softmax(sc, 0)
            want = sum(pi * v.double() for pi, v in zip(p, vals))
            torch.testing.assert_close(got[b, h, 0].double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", [[0, 7], [16, 31], [40, 63], [17, 48]])
def test_dense_prior_active_equals_write_then_attend(pos):
    q, kc, vc, k_new, v_new, _, _, _, q_pos, (kw, vw, _) = _setup(1, 64, pos)
    got = oracles.decode_dense_prior_active(q, kc, vc, k_new, v_new, q_pos, 0.25)
    want = oracles.decode_attention_dense(q, kw, vw, q_pos, 0.25)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("init_blocks,local_blocks", [(0, 1), (1, 1), (0, 0), (1, 2)])
@pytest.mark.parametrize("pos", [[0, 15], [16, 31], [33, 127], [64, 100]])
def test_selection_on_prior_index_keys_plus_active_key_is_identical(pos, init_blocks, local_blocks):
    bs, topk, s = 16, 3, 128
    _, _, _, _, _, ikc, ik_new, iq, q_pos, (_, _, iw) = _setup(2, s, pos)
    sel = dict(block_size=bs, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    got = oracles.select_blocks_prior_active(iq, ikc, ik_new, q_pos, **sel)
    want = oracles.select_blocks_for_queries(iq, iw, q_pos.view(B, 1), **sel)[:, :, 0]
    assert got.shape == want.shape == (B, G, topk)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_selection_takes_the_active_key_into_its_own_block_without_forcing():
    """``local_blocks=0``: the own block competes on its score, and only the active key can make it win."""
    bs, s = 4, 16
    ikc = torch.zeros(1, s, 2)
    ikc[0, :4] = torch.tensor([1.0, 0.0])  # block 0 scores 1
    iq = torch.tensor([[1.0, 0.0]]).view(1, 1, 1, 2)
    q_pos = torch.tensor([9])  # own block 2; block 1 scores 0, block 2's prior slot 8 scores 0
    strong, weak = torch.tensor([[[5.0, 0.0]]]), torch.tensor([[[-5.0, 0.0]]])
    pick = lambda new: oracles.select_blocks_prior_active(iq, ikc, new, q_pos, bs, topk=1, local_blocks=0)  # noqa: E731
    assert pick(strong).tolist() == [[[2]]]
    assert pick(weak).tolist() == [[[0]]]


@pytest.mark.parametrize("pos", [[0, 127], [50, 96], [79, 80]])
def test_sparse_prior_active_equals_write_then_attend_on_the_same_blocks(pos):
    bs, topk, s = 16, 3, 128
    q, kc, vc, k_new, v_new, ikc, ik_new, iq, q_pos, (kw, vw, iw) = _setup(3, s, pos)
    blocks = oracles.select_blocks_prior_active(iq, ikc, ik_new, q_pos, bs, topk)
    got = oracles.decode_sparse_prior_active(q, kc, vc, k_new, v_new, q_pos, blocks, bs, 0.25)
    want = oracles.decode_attention_sparse(q, kw, vw, q_pos, blocks, bs, 0.25)
    torch.testing.assert_close(got, want, **TOL)
    dense = oracles.decode_attention_dense(q, kw, vw, q_pos, 0.25)
    assert (got - dense).abs().max() > 1e-3  # the geometry really drops blocks here


def test_a_bucket_of_at_most_topk_blocks_is_dense_causal_decode():
    """What ``attention_tokengen`` relies on to skip the indexer in short buckets: the indexer selects every
    block up to the query's, so sparse decode equals dense causal decode."""
    bs, topk, s = 16, 4, 64
    q, kc, vc, k_new, v_new, ikc, ik_new, iq, q_pos, (kw, vw, iw) = _setup(4, s, [3, 63])
    blocks = oracles.select_blocks_for_queries(iq, iw, q_pos.view(B, 1), bs, topk)[:, :, 0]
    sparse = oracles.decode_attention_sparse(q, kw, vw, q_pos, blocks, bs, 0.25)
    torch.testing.assert_close(oracles.decode_dense_prior_active(q, kc, vc, k_new, v_new, q_pos, 0.25), sparse, **TOL)


def test_bfloat16_within_rounding_of_float32():
    q, kc, vc, k_new, v_new, _, _, _, q_pos, _ = _setup(5, 64, [20, 63])
    f32 = oracles.decode_dense_prior_active(q, kc, vc, k_new, v_new, q_pos, 0.25)
    bf = oracles.decode_dense_prior_active(*(t.bfloat16() for t in (q, kc, vc, k_new, v_new)), q_pos, 0.25)
    torch.testing.assert_close(bf.float(), f32, rtol=0, atol=3e-2)
