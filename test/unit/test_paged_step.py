"""The attention step over paged caches written first (the vLLM Neuron model's order), graded against the oracle.

The model writes a call's K/V and index keys into its pages at vLLM's ``slot_mapping`` and then runs
``ops.attention_step`` with no active keys (``act=None``) over ``ops.paged.Pages``: each query reads its row's pages up
to its own position, by selected page on sparse layers. The oracle is ``oracles.prefill_attention``: causal attention
over the row's contiguous line written first, in query tiles, block-sparse through ``select_tile`` / ``attend_blocks``
(other arithmetic: one softmax per query, no partial softmax, no page table). Page tables are shuffled, rows have
other lengths, calls start mid-page, and padding slots (``-1``) land in the null page without touching any row.
"""

from __future__ import annotations

import pytest
import torch

from minimax_m3 import ops
from minimax_m3.ops.paged import Pages, write_slots
from test.support import oracles

P, TOPK, HQ, HKV, D, DI = 8, 2, 4, 2, 16, 8  # page = index block of 8 slots, top-2 blocks
SCALE = D ** -0.5
TOL = 1e-5  # float32: the step's partial softmax vs the oracle's one softmax, measured ~1e-7


def _lines(b, s, gen):
    return (torch.randn(b, HKV, s, D, generator=gen), torch.randn(b, HKV, s, D, generator=gen),
            torch.randn(b, s, DI, generator=gen))


def _paged(k, v, ik, width, gen):
    """The rows' contiguous lines copied into shuffled physical pages (page 0 is the null page, never a row's)."""
    b, _, s, _ = k.shape
    n = b * width + 1
    perm = torch.randperm(n - 1, generator=gen) + 1
    table = perm.view(b, width)
    kc, vc = torch.full((n, HKV, P, D), float("nan")), torch.full((n, HKV, P, D), float("nan"))
    ikc = torch.full((n, 1, P, DI), float("nan"))
    for row in range(b):
        slots = table[row].repeat_interleave(P) * P + torch.arange(width * P) % P
        slots = slots[:s]
        write_slots(kc, k[row].transpose(0, 1), slots)
        write_slots(vc, v[row].transpose(0, 1), slots)
        write_slots(ikc, ik[row].unsqueeze(1), slots)
    # what the null page and unwritten slots hold must never be read: make them large instead of NaN where a
    # masked product would still multiply them (0 * NaN = NaN in the value matmul)
    for c in (kc, vc, ikc):
        c.nan_to_num_(1e4)
    return kc, vc, ikc, table


def _assert_oracle(got, q, k, v, iq, ik, starts, t, sparse):
    """Each row's output equals the oracle's causal attention over its contiguous line (block-sparse when
    ``sparse``), the row's ``t`` queries from ``starts[row]``."""
    for row, s0 in enumerate(starts):
        e = s0 + t
        want = oracles.prefill_attention(q[row:row + 1], k[row:row + 1, :, :e], v[row:row + 1, :, :e], SCALE,
                                         iq=iq[row:row + 1] if sparse else None,
                                         ik=ik[row:row + 1, :e] if sparse else None,
                                         block_size=P, topk=TOPK, tile=8, start=s0)
        torch.testing.assert_close(got[row:row + 1], want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("start, t", [(0, 40), (13, 19), (37, 1), (29, 4)])
def test_written_first_pages_match_oracle(sparse, start, t):
    gen = torch.Generator().manual_seed(start * 100 + t)
    b, width = 2, 8  # up to 64 slots a row: more pages than top-k, so sparse calls select
    starts = [start, start + 5]  # row 1 starts later: rows at other positions in one batch
    end = starts[-1] + t
    k, v, ik = _lines(b, end, gen)
    q = torch.randn(b, HQ, t, D, generator=gen)
    iq = torch.randn(b, HKV, t, DI, generator=gen)
    kc, vc, ikc, table = _paged(k, v, ik, width, gen)
    sel = ops.Selection(P, TOPK, 0, 1) if sparse else None
    q_pos = torch.stack([torch.arange(s0, s0 + t) for s0 in starts])
    ik_line = Pages(ikc, table).lines()[:, 0] if sparse else None
    got = ops.attention_step(q, Pages(kc, table), Pages(vc, table), None, q_pos, torch.tensor(starts), 0,
                             ops.Alone(), SCALE, sel, iq if sparse else None, ik_line, tile=8)
    _assert_oracle(got, q, k, v, iq, ik, starts, t, sparse)


def test_padding_slots_go_to_the_null_page():
    cache = torch.zeros(3, 1, P, 2)
    write_slots(cache, torch.ones(3, 1, 2), torch.tensor([P + 1, -1, 2 * P + 7]))
    assert cache[1, 0, 1].tolist() == [1.0, 1.0] and cache[2, 0, 7].tolist() == [1.0, 1.0]
    assert cache[0].abs().sum() == 1 * 2  # only the padding token, at the null page's slot 0
    assert cache.abs().sum() == 3 * 2


def test_block_table_padding_reads_the_null_page():
    """vLLM Neuron's runner pads block tables with -1: a padded entry reads page 0 (masked by position anyway)."""
    cache = torch.arange(3 * 1 * P * 2, dtype=torch.float32).view(3, 1, P, 2)
    pages = Pages(cache, torch.tensor([[2, -1]]))
    assert torch.equal(pages.lines()[0, 0], torch.cat([cache[2, 0], cache[0, 0]]))
    assert torch.equal(pages.gather(torch.tensor([[[[1, 0]]]]))[0, 0, 0], torch.cat([cache[0, 0], cache[2, 0]]))


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("start, t", [(0, 40), (13, 20)])
def test_a_query_split_selection_matches_the_oracle(parts, start, t):
    """``ops.QuerySplit``: ``parts`` ranks holding the same pages each select the blocks of their share of the call's
    queries, and the gather (here: the shares the other simulated ranks computed, in order) hands each the whole
    selection; every rank's output equals the oracle's, as the whole selection's does."""
    gen = torch.Generator().manual_seed(7 * start + t + parts)
    b, width = 2, 8
    starts = [start, start + 3]
    k, v, ik = _lines(b, starts[-1] + t, gen)
    q, iq = torch.randn(b, HQ, t, D, generator=gen), torch.randn(b, HKV, t, DI, generator=gen)
    kc, vc, ikc, table = _paged(k, v, ik, width, gen)
    sel, q_pos = ops.Selection(P, TOPK, 0, 1), torch.stack([torch.arange(s0, s0 + t) for s0 in starts])
    ik_line = Pages(ikc, table).lines()[:, 0]

    def run(index, gather):
        return ops.attention_step(q, Pages(kc, table), Pages(vc, table), None, q_pos, torch.tensor(starts), 0,
                                  ops.Alone(), SCALE, sel, iq, ik_line, tile=8,
                                  split=ops.QuerySplit(parts, index, gather))

    shares = {}

    def keep(index):
        def gather(ids):
            assert ids.shape[2] == t // parts  # this rank selected its share only
            shares[index] = ids
            return torch.zeros(b, ids.shape[1], t, ids.shape[3], dtype=ids.dtype)
        return gather

    for i in range(parts):
        run(i, keep(i))
    whole = torch.cat([shares[i] for i in range(parts)], dim=2)
    for i in range(parts):
        got = run(i, lambda ids, i=i: (torch.testing.assert_close(ids, shares[i]), whole)[1])
        for row, s0 in enumerate(starts):
            want = oracles.prefill_attention(q[row:row + 1], k[row:row + 1, :, :s0 + t], v[row:row + 1, :, :s0 + t],
                                             SCALE, iq=iq[row:row + 1], ik=ik[row:row + 1, :s0 + t], block_size=P,
                                             topk=TOPK, tile=8, start=s0)
            torch.testing.assert_close(got[row:row + 1], want, rtol=TOL, atol=TOL)
    # a decode step (one token a row) and a call not a multiple of the parts select whole
    one = ops.attention_step(q[:, :, :1], Pages(kc, table), Pages(vc, table), None, q_pos[:, :1],
                             torch.tensor(starts), 0, ops.Alone(), SCALE, sel, iq[:, :, :1], ik_line,
                             split=ops.QuerySplit(parts, 0, lambda ids: pytest.fail("decode must not split")))
    assert one.shape == (b, HQ, 1, D)


# ---- decode context parallelism: whole pages dealt over the ranks (vLLM Neuron's DCP, ops.layout by block) -------


def _dcp_paged(k, v, ik, width, group, gen):
    """Each rank's pages of the rows' lines, dealt as vLLM Neuron deals them (interleave = the block): block ``n`` of
    a row on rank ``n mod G``, in its page ``table[row, n div G]`` (one table for every rank, as the scheduler hands
    it; each rank's pages its own memory, shuffled). Slots written only where the rank owns the position
    (``ops.paged.slot_mapping`` on the rank's table)."""
    b, _, s, _ = k.shape
    local = width // group
    n = b * local + 1
    table = (torch.randperm(n - 1, generator=gen) + 1).view(b, local)
    ranks = []
    for r in range(group):
        kc, vc = torch.full((n, HKV, P, D), 1e4), torch.full((n, HKV, P, D), 1e4)
        ikc = torch.full((n, 1, P, DI), 1e4)
        for row in range(b):
            pos = torch.arange(s)
            mine = pos[(pos // P) % group == r]
            slots = table[row, mine // (P * group)] * P + mine % P
            write_slots(kc, k[row, :, mine].transpose(0, 1), slots)
            write_slots(vc, v[row, :, mine].transpose(0, 1), slots)
            write_slots(ikc, ik[row, mine].unsqueeze(1), slots)
        ranks.append((kc, vc, ikc))
    return ranks, table


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("start, t", [(0, 64), (32, 32), (37, 1), (29, 4)])
def test_block_interleaved_ranks_match_the_oracle(group, sparse, start, t):
    """``G`` ranks each holding whole pages (``unit`` = the block): each scores its own blocks, the group merges the
    candidates and each reads the selected pages it holds; every rank's heads equal the one-softmax oracle's over the
    unsharded line. A prefill from 0 and from a block boundary past it (the plugin's DCP segments), a decode token
    and a verify step mid-page; two rows at other positions."""
    from test.support import seq_shards as sh

    gen = torch.Generator().manual_seed(group * 1000 + start * 10 + t)
    b, width = 2, 8
    starts = [start, start + 5 if t < 8 else start + 8 * group]  # prefill rows start on a lap of G blocks
    end = starts[-1] + t
    width = max(width, -(-end // (P * group)) * group)
    k, v, ik = _lines(b, end, gen)
    q = torch.randn(b, HQ, t, D, generator=gen)
    iq = torch.randn(b, HKV, t, DI, generator=gen)
    ranks, table = _dcp_paged(k, v, ik, width, group, gen)
    sel = ops.Selection(P, TOPK, 0, 1) if sparse else None
    q_pos = torch.stack([torch.arange(s0, s0 + t) for s0 in starts])
    hl = HQ // group

    def rank_step(r, member):
        kc, vc, ikc = ranks[r]
        ik_line = Pages(ikc, table).lines()[:, 0] if sparse else None
        return ops.attention_step(q[:, r * hl:(r + 1) * hl], Pages(kc, table), Pages(vc, table), None, q_pos,
                                  q_pos[:, 0], r, member, SCALE, sel, iq if sparse else None, ik_line, tile=8, unit=P)

    outs, calls = sh.run_group(group, rank_step)
    got = torch.cat(outs, dim=1)  # each rank's own heads, in rank order
    _assert_oracle(got, q, k, v, iq, ik, starts, t, sparse)
    one = t < ops.step.ONE_GATHER_TOKENS and t == 1
    kinds = ["all-gather"] * (1 if one or not sparse else 2) + ["all-to-all"]
    assert calls == kinds


def test_block_interleaved_last_slots_by_hand():
    """``ops.layout`` dealt by 4-token runs over 2 ranks: rank 1 holds positions 4-7, 12-15, ...; a query at 9 reads
    rank 0's slots up to 5 (positions 0-3, 8, 9) and rank 1's up to 3 (positions 4-7)."""
    q = torch.tensor([0, 3, 4, 9, 15])
    assert ops.layout.last_slot(q, 0, 2, 4).tolist() == [0, 3, 3, 5, 7]
    assert ops.layout.last_slot(q, 1, 2, 4).tolist() == [-1, -1, 0, 3, 7]
    assert ops.layout.last_slot(q, 1, 2, 1).tolist() == ops.layout.last_slot(q, 1, 2).tolist()


def test_an_interleave_other_than_the_block_is_refused():
    q = torch.zeros(1, HQ, 1, D)
    pages = Pages(torch.zeros(2, HKV, P, D), torch.tensor([[1]]))
    with pytest.raises(ValueError, match="whole index blocks per rank"):
        ops.attention_step(q, pages, pages, None, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1), 0,
                           ops.Alone(), SCALE, ops.Selection(P, TOPK), torch.zeros(1, HKV, 1, DI),
                           torch.zeros(1, P, DI), unit=P // 2)


def test_dcp_slot_mapping_by_hand():
    """vLLM Neuron's slots under DCP 2 (pages of 4, interleave = the page): the table counts 8-token virtual blocks;
    positions 0-3 and 8-11 are rank 0's (pages 5 and 9), 4-7 and 12-15 rank 1's; the other rank writes slot 0."""
    table, pos = torch.tensor([[5, 9]]), torch.arange(16).view(1, 16)
    r0 = ops.paged.slot_mapping(table, pos, 4, dcp=2, dcp_rank=0)[0].tolist()
    r1 = ops.paged.slot_mapping(table, pos, 4, dcp=2, dcp_rank=1)[0].tolist()
    assert r0 == [20, 21, 22, 23, 0, 0, 0, 0, 36, 37, 38, 39, 0, 0, 0, 0]
    assert r1 == [0, 0, 0, 0, 20, 21, 22, 23, 0, 0, 0, 0, 36, 37, 38, 39]
    assert ops.paged.slot_mapping(table, torch.tensor([[16]]), 4, dcp=2, dcp_rank=0).tolist() == [[-1]]  # past it
