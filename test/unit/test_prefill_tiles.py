"""Sparse prefill in query tiles through the step that ships (``ops.attention_step``, a call from position 0: its own
keys read by selected block): graded against transformers' dense additive block mask at every tile size, and shown to
read only the selected key blocks (a NaN planted in every unselected block never reaches the output, which a
dense-masked product cannot avoid: 0 x NaN = NaN). The tile rule (``ops.tile_for``) by hand."""

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hfm

from minimax_m3 import ops

from .test_ops import _hf_indexer, rnd
from test.support import layer_functions as L
from test.support import oracles

TOL = 1e-5
S, BS, TOPK, D = 150, 16, 2, 32


def _qkv(b=1, hq=8, g=2, seed=0):
    q, k, v = rnd(b, hq, S, D, seed=seed + 1), rnd(b, g, S, D, seed=seed + 2), rnd(b, g, S, D, seed=seed + 3)
    return q, k, v, rnd(b, g, S, D, seed=seed + 4), rnd(b, S, D, seed=seed + 5)


@pytest.mark.parametrize("tile", [16, 40, 48, 128, 150, 256])
def test_tiled_sparse_prefill_matches_transformers(tile):
    _, idx = _hf_indexer()
    q, k, v, iq, ik = _qkv()
    pos = torch.arange(S).unsqueeze(0)
    blocks = oracles.select_blocks_for_queries(iq, ik, pos, BS, TOPK)  # the whole prompt at once, as transformers
    mask = idx.build_block_mask(blocks, None, S, torch.float32, q.device, pos)
    want, _ = hfm.eager_attention_forward(
        type("M", (), {"num_key_value_groups": 4, "training": False})(), q, k, v, mask, scaling=D ** -0.5)
    got = L.prefill_step(q, k, v, D ** -0.5, tile, ops.Selection(BS, TOPK), iq, ik)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=TOL, rtol=0)
    # the per-tile selection is the whole-prompt selection
    assert torch.equal(ops.prefill_blocks(iq, ik, BS, TOPK, tile=tile).sort(-1).values, blocks.sort(-1).values)


def test_unselected_blocks_are_never_read():
    q, k, v, iq, ik = _qkv(seed=10)
    pos = torch.arange(S).unsqueeze(0)
    blocks = oracles.select_blocks_for_queries(iq, ik, pos, BS, TOPK)  # [1, G, S, K]
    # blocks no query of the last chunk selected (every query there could see them): poison their K and V
    last = blocks[0, :, 144:]  # the tile of queries 144..149 (tiles of 16), keys in blocks 0..9
    unused = [blk for blk in range(9) if not (last == blk).any()]
    assert unused, "the geometry must leave a block unselected"
    k2, v2 = k.clone(), v.clone()
    for blk in unused:
        k2[:, :, blk * BS:(blk + 1) * BS] = float("nan")
        v2[:, :, blk * BS:(blk + 1) * BS] = float("nan")
    got = L.prefill_step(q, k2, v2, D ** -0.5, 16, ops.Selection(BS, TOPK), iq, ik)
    want = L.prefill_step(q, k, v, D ** -0.5, 16, ops.Selection(BS, TOPK), iq, ik)
    torch.testing.assert_close(got[:, :, 144:], want[:, :, 144:], atol=0, rtol=0)


def test_tile_for_by_hand():
    assert ops.tile_for(8192, 8, 128, 4096) == 1024  # 8 tiles
    assert ops.tile_for(32768, 8, 128, 4096) == 4096  # still 8 tiles
    assert ops.tile_for(131072, 8, 128, 4096) == 4096  # capped: 32 tiles
    assert ops.tile_for(1000, 8, 128) == 128  # rounded up to whole blocks: 8 tiles
    assert ops.tile_for(100, 8, 128) == 128  # never below one block


def test_topk_op_is_injectable_and_order_free():
    q, k, v, iq, ik = _qkv(seed=20)
    calls = []

    def reversed_topk(x, n, dim=-1):  # same winners, another order, int32 indices (as the SDK's op)
        calls.append(n)
        vals, idx = torch.topk(x, n, dim=dim)
        return vals.flip(-1), idx.flip(-1).to(torch.int32)

    want = oracles.prefill_attention(q, k, v, D ** -0.5, iq=iq, ik=ik, block_size=BS, topk=TOPK, tile=48)
    got = oracles.prefill_attention(q, k, v, D ** -0.5, iq=iq, ik=ik, block_size=BS, topk=TOPK, tile=48,
                                topk_fn=reversed_topk)
    assert calls, "the injected top-k was not used"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("start", [48, 96, 144])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_a_later_call_over_the_cache_equals_the_one_call_prefill(start, sparse):
    """A chunked prefill's later call: queries ``start..`` over a whole-block cache holding every key (the earlier
    calls' and its own; slots past them hold stale entries, large and finite as a cache's are, that must weigh
    nothing) equal the one-call prefill's rows."""
    q, k, v, iq, ik = _qkv(seed=30)
    idx = dict(iq=iq, ik=ik, block_size=BS, topk=TOPK) if sparse else {}
    want = oracles.prefill_attention(q, k, v, D ** -0.5, tile=48, **idx)
    end = min(S, start + 40)
    pad = lambda x, dim: torch.cat([x, torch.full_like(x.narrow(dim, 0, 10), 1e4)], dim)  # noqa: E731
    kc, vc, ikc = pad(k[:, :, :end], 2), pad(v[:, :, :end], 2), pad(ik[:, :end], 1)  # stale slots past the call
    if sparse:
        idx = dict(iq=iq[:, :, start:end], ik=ikc, block_size=BS, topk=TOPK)
    got = oracles.prefill_attention(q[:, :, start:end], kc, vc, D ** -0.5, tile=16, start=start, **idx)
    torch.testing.assert_close(got, want[:, :, start:end], atol=TOL, rtol=0)
