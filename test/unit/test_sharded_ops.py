"""The sequence-sharded layout (``ops.layout``, ``ops.attention_step``'s pieces) against the unsharded ops.

Oracles: the unsharded ``ops`` (``index_block_scores`` + ``select_blocks``, ``prefill_step``;
graded against transformers in test_ops / test_prefill_tiles / test_decode_ops), a brute-force Python sort for the
tie rule, and a hand-computed combine. Block ids must be EQUAL (ties included); attention within 1e-5 (float32).
"""

import math

import pytest
import torch

from minimax_m3 import ops
from test.support import seq_shards as sh
from test.support import oracles
from minimax_m3.config import parallel

TOL = dict(rtol=0, atol=1e-5)
B, HKV, R, D, DI, BS, TOPK = 2, 2, 2, 16, 8, 16, 3
GROUPS = [1, 2, 4, 16]


def _rand(*shape, seed, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:  # small integers: exact products, many exactly tied block scores
        return torch.randint(-2, 3, shape, generator=g).float()
    return torch.randn(*shape, generator=g)


def _unsharded_blocks(iq, ik, q_pos, sel):
    return ops.select_blocks(ops.index_block_scores(iq, ik, q_pos, sel.block_size), q_pos, **sel.kwargs())


# ---- layout --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", GROUPS)
def test_chunk_and_token_writes_place_each_position_on_its_owner(group):
    s, chunk = 128, 32
    full = _rand(B, HKV, s, D, seed=1)
    want = torch.zeros(B, HKV, s, D)  # the unsharded cache the same writes give
    shards = [torch.zeros(B, HKV, s // group, D) for _ in range(group)]
    for t0 in range(0, 96, chunk):  # three chunks
        want[:, :, t0:t0 + chunk] = full[:, :, t0:t0 + chunk]
        for r in range(group):
            sh.write_call(shards[r], full[:, :, t0:t0 + chunk], t0, r, group, seq_dim=2)
    for p in ([96, 100], [97, 101], [98, 127]):  # decode tokens at per-row positions
        pos = torch.tensor(p)
        new = torch.stack([full[i, :, p[i]:p[i] + 1] for i in range(B)])
        for i in range(B):
            want[i, :, p[i]] = full[i, :, p[i]]
        for r in range(group):
            ops.layout.write_token(shards[r], new, pos, r, group, seq_dim=2)
    for r in range(group):  # position p on rank p % G at slot p // G
        assert torch.equal(shards[r], want[:, :, r::group]), r
    rank, slot = ops.layout.owner(torch.tensor([0, 5, 17]), 4)
    assert rank.tolist() == [0, 1, 1] and slot.tolist() == [0, 1, 4]


def test_layout_and_chunk_rules_name_the_sizes_that_work():
    parallel.check_layout(128, 16)
    parallel.check_call(8192, 128, 16)
    with pytest.raises(parallel.LayoutError, match=r"\[1, 2, 4, 8, 16\]"):
        parallel.check_layout(16, 3)
    with pytest.raises(parallel.LayoutError, match=r"multiple of 128.*\[128, 256\]"):
        parallel.check_call(200, 128, 16)
    with pytest.raises(parallel.LayoutError, match=r"multiple of 48.*\[48\]"):
        parallel.check_call(20, 16, 3)
    with pytest.raises(ValueError):  # a LayoutError is a ValueError and an M3Error
        parallel.check_call(0, 128, 16)
    with pytest.raises(parallel.LayoutError, match="multiples of 4"):
        sh.write_call(torch.zeros(1, 8, 2), torch.zeros(1, 4, 2), 2, 0, 4, seq_dim=1)


# ---- selection -----------------------------------------------------------------------------------------------


def test_tie_rule_by_hand_and_with_any_order_topk():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")]])
    assert ops.top_blocks(scores, 2)[1].tolist() == [[1, 2]]
    assert ops.top_blocks(scores, 4)[1].tolist() == [[1, 2, 4, 3]]  # above the 4th best by id, then the tie
    reversed_topk = lambda x, n, dim=-1: tuple(t.flip(-1) for t in torch.topk(x, n, dim=dim))  # noqa: E731
    assert sorted(ops.top_blocks(scores, 2, reversed_topk)[1][0].tolist()) == [1, 2]
    assert ops.top_blocks(scores, 6)[1].tolist() == [[0, 1, 2, 3, 4, -1]]  # the k-th best is -inf


@pytest.mark.parametrize("seed", range(4))
def test_select_blocks_breaks_ties_by_lower_block_id(seed):
    """Integer scores with many ties, forced blocks: the ids are the first K of a Python sort by (-score, id)."""
    g = torch.Generator().manual_seed(seed)
    nblk, k = 12, 4
    scores = torch.randint(0, 3, (1, 2, 8, nblk), generator=g).float()
    q_pos = torch.randint(0, nblk * BS, (1, 8), generator=g)
    got = ops.select_blocks(scores, q_pos, BS, k, init_blocks=1, local_blocks=2)
    forced = ops.force_blocks(scores, q_pos, BS, 1, 2)
    for h in range(2):
        for t in range(8):
            row = forced[0, h, t].tolist()
            want = sorted(range(nblk), key=lambda j: (-row[j], j))[:k]
            want = [j if row[j] != float("-inf") else -1 for j in want]
            assert sorted(got[0, h, t].tolist()) == sorted(want), (h, t, row)


def _selection_inputs(seed, ints, s=256, tq=24):
    """Index queries/keys, and per row queries near the start (fewer causal blocks than K) and across the cache."""
    iq, ik = _rand(B, HKV, tq, DI, seed=seed, ints=ints), _rand(B, s, DI, seed=seed + 1, ints=ints)
    return iq, ik, torch.stack([torch.arange(tq) * 3, torch.arange(tq) * 10 + 15])


def _ties_at_the_cut(scores, k):
    """Some query has another block scoring exactly its K-th best score (finite, or +inf: forced blocks)."""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return bool(((scores == kth).sum(-1) > 1)[kth.squeeze(-1) > float("-inf")].any())


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("ints", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("rule", [(0, 1), (1, 1), (2, 2), (0, 0)], ids=["local1", "init1", "init2local2", "none"])
def test_merged_selection_equals_unsharded(group, ints, rule):
    sel = ops.Selection(BS, TOPK, *rule)
    iq, ik, q_pos = _selection_inputs(7 * group + rule[0], ints)
    want = _unsharded_blocks(iq, ik, q_pos, sel)
    got = sh.sharded_select(iq, sh.shard(ik, group, 1), q_pos, sel)
    assert torch.equal(got, want)  # the ids and their order, ties included
    assert (want == -1).any() and (want >= 0).all(-1).any()  # both regimes: early queries and full selections
    if ints:
        scores = ops.force_blocks(ops.index_block_scores(iq, ik, q_pos, BS), q_pos, BS, *rule)
        assert _ties_at_the_cut(scores, TOPK), "the integer case must tie at the K-th score"


@pytest.mark.parametrize("group", [2, 16])
def test_merged_selection_with_an_any_order_topk(group):
    def reversed_topk(x, n, dim=-1):  # same winners, another order, int32 indices (as the SDK's op)
        vals, idx = torch.topk(x, n, dim=dim)
        return vals.flip(-1), idx.flip(-1).to(torch.int32)

    sel = ops.Selection(BS, TOPK, 1, 1)
    iq, ik, q_pos = _selection_inputs(group, ints=True)
    want = _unsharded_blocks(iq, ik, q_pos, sel)
    got = sh.sharded_select(iq, sh.shard(ik, group, 1), q_pos, sel, topk_fn=reversed_topk)
    plain = ops.select_blocks(ops.index_block_scores(iq, ik, q_pos, BS), q_pos, BS, TOPK, 1, 1, reversed_topk)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert torch.equal(plain.sort(-1).values, want.sort(-1).values)


# ---- attention -----------------------------------------------------------------------------------------------


def test_combine_by_hand():
    # rank 0: normalised output 1 with max 0 and sum 1; rank 1: 5 with max ln 3, sum 1; rank 2: no key
    outs = torch.tensor([1.0, 5.0, 0.0]).view(3, 1, 1, 1, 1)
    maxes = torch.tensor([0.0, math.log(3.0), float("-inf")]).view(3, 1, 1, 1)
    sums = torch.tensor([1.0, 1.0, 0.0]).view(3, 1, 1, 1)
    assert ops.combine_weights(maxes, sums).flatten().tolist() == pytest.approx([0.25, 0.75, 0.0])
    assert ops.combine(outs, maxes, sums).item() == pytest.approx(0.25 * 1 + 0.75 * 5)


def _model_inputs(s, seed):
    return (_rand(B, HKV * R, s, D, seed=seed), _rand(B, HKV, s, D, seed=seed + 1), _rand(B, HKV, s, D, seed=seed + 2),
            _rand(B, HKV, s, DI, seed=seed + 3), _rand(B, s, DI, seed=seed + 4))


def _attend(q, k, v, q_pos, group, scale, blocks):
    """Every rank's ``ops.step.partial_attention`` over its shard of ``k, v [B, H, S, D]`` (the keys before the
    first query as its prior, the queries' own tokens active on their owners), combined: the attention of the
    queries ``q [B, Hq, Tq, D]`` at ``q_pos [B, Tq]`` (the last ``Tq`` positions)."""
    tq, start = q.shape[2], q_pos[:, 0]
    parts = []
    for r, (kr, vr) in enumerate(zip(sh.shard(k, group, 2), sh.shard(v, group, 2))):
        act = ops.token_active(k[:, :, -tq:], v[:, :, -tq:], None, q_pos, r, group)
        parts.append(ops.step.partial_attention(q, kr, vr, act, q_pos, start, r, group, scale, blocks, BS))
    return ops.combine(*(torch.stack(x) for x in zip(*parts)))


@pytest.mark.parametrize("group", [4, 16])
def test_partial_attention_reads_only_its_keys_of_the_selected_blocks(group):
    """A NaN planted in every key and value of a block no query of its row and KV head selected never reaches the
    output (a masked product over the whole shard could not avoid it: 0 x NaN = NaN); the output is the unsharded
    sparse attention."""
    s, tq, scale = 256, 4, D ** -0.5
    q, k, v, iq, ik = _model_inputs(s, seed=30)
    q_pos = torch.tensor([[252, 253, 254, 255]] * B)
    sel = ops.Selection(BS, TOPK, 0, 1)
    blocks = _unsharded_blocks(iq[:, :, -tq:], ik, q_pos, sel)
    want = _attend(q[:, :, -tq:], k, v, q_pos, group, scale, blocks)
    oracle = oracles.prefill_step(q[:, :, -tq:], k, v, scale, tq, sel, iq[:, :, -tq:], ik, start=s - tq)
    torch.testing.assert_close(want, oracle, **TOL)
    k2, v2 = k.clone(), v.clone()
    for i in range(B):
        for h in range(HKV):
            for blk in set(range(s // BS)) - set(blocks[i, h].flatten().tolist()):
                k2[i, h, blk * BS:(blk + 1) * BS] = float("nan")
                v2[i, h, blk * BS:(blk + 1) * BS] = float("nan")
    assert k2.isnan().any()
    got = _attend(q[:, :, -tq:], k2, v2, q_pos, group, scale, blocks)
    assert torch.equal(got, want)


def test_gathered_bytes_are_counted_from_the_gathers():
    """What ``ops.step.partial_attention``'s gathers return (recorded under a dispatch mode) is gathered_kv_bytes
    per row and KV head; for M3 (block 128, top-16, D 128, bf16, G = 16) that is 1 MiB per 16 queries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gathers(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index_select.default:
                Gathers.nbytes += out.numel() * out.element_size()
            return out

    group, tq, s = 4, 8, 128
    q, k, v, iq, ik = _model_inputs(s, seed=40)
    q_pos = torch.arange(s - tq, s).expand(B, tq)
    blocks = _unsharded_blocks(iq[:, :, -tq:], ik, q_pos, ops.Selection(BS, TOPK))
    shards = sh.shard(k.bfloat16(), group, 2), sh.shard(v.bfloat16(), group, 2)
    act = ops.token_active(k[:, :, -tq:].bfloat16(), v[:, :, -tq:].bfloat16(), None, q_pos, 1, group)
    with Gathers():
        ops.step.partial_attention(q[:, :, -tq:].bfloat16(), shards[0][1], shards[1][1], act, q_pos, q_pos[:, 0], 1,
                                   group, 0.25, blocks, BS)
    assert Gathers.nbytes == B * HKV * sh.gathered_kv_bytes(tq, TOPK, BS, group, D, 2)
    assert sh.gathered_kv_bytes(16, 16, 128, 16, 128, 2) == 2 ** 20
