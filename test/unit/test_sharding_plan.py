"""The sharding plan against NxD's semantics, on cases computed by hand.

NxD (``neuronx_distributed``, ``trace.create_local_weight`` and ``parallel_state.get_experts_for_expert_parallel_rank``;
NxDI ``GQA.REPLICATE_TO_TP_DEGREE``): split into ``size / world / stride`` tiles, rank ``r`` takes chunks ``r::world``;
EP rank ``e`` holds experts ``[e*E/ep, (e+1)*E/ep)``; with more ranks than KV heads rank ``r`` uses KV head
``r // (world / kv_heads)``.
"""

import pytest
import torch

from minimax_m3.config import M3Config
from minimax_m3.reference.parallel import ShardPlan, ShardPlanError, create_local_weight, experts_for_rank

TINY, M3 = M3Config.preset("tiny"), M3Config.preset("m3")


def test_stride_two_gives_each_rank_its_gate_and_up_slices():
    gate_up = torch.arange(8)  # gate = 0..3, up = 4..7
    assert create_local_weight(gate_up, 0, 0, 2, stride=2).tolist() == [0, 1, 4, 5]
    assert create_local_weight(gate_up, 0, 1, 2, stride=2).tolist() == [2, 3, 6, 7]
    assert create_local_weight(gate_up, 0, 3, 4, stride=2).tolist() == [3, 7]
    # stride 1 would hand rank 0 only gate rows: the bug stride 2 exists to avoid
    assert create_local_weight(gate_up, 0, 0, 2).tolist() == [0, 1, 2, 3]
    # along the last dim of an expert tensor [E, H, 2I] (NxD ExpertFusedColumnParallelLinear, partition dim 2)
    w = torch.arange(12).view(1, 1, 12)  # I = 6: gate 0..5, up 6..11
    assert create_local_weight(w, 2, 1, 3, stride=2).flatten().tolist() == [2, 3, 8, 9]
    with pytest.raises(ShardPlanError, match="does not split"):
        create_local_weight(torch.arange(6), 0, 0, 4, stride=2)


def test_expert_ranges_are_contiguous():
    assert list(experts_for_rank(1, 128, 64)) == [2, 3]
    assert list(experts_for_rank(0, 8, 2)) == [0, 1, 2, 3]
    assert list(experts_for_rank(3, 8, 4)) == [6, 7]
    plan = ShardPlan(world=4, rank=3, ep=2)  # TP innermost: ranks 2, 3 form EP group 1
    assert (plan.ep_rank, plan.moe_tp_rank, plan.moe_tp) == (1, 1, 2)
    assert list(plan.experts(TINY)) == [4, 5, 6, 7]


def test_kv_heads_replicate_beyond_their_count_and_split_below_it():
    # M3 at TP 64: one query head per rank, KV head r // 16 (NxD REPLICATE_TO_TP_DEGREE)
    for r, kv in ((0, 0), (15, 0), (16, 1), (17, 1), (63, 3)):
        p = ShardPlan(world=64, rank=r, ep=64)
        assert list(p.q_heads(M3)) == [r] and list(p.kv_heads(M3)) == [kv]
    # M3 at TP 2: 32 query heads and 2 of the 4 KV heads per rank, the KV heads of exactly those query heads
    p = ShardPlan(world=2, rank=1)
    assert list(p.q_heads(M3)) == list(range(32, 64)) and list(p.kv_heads(M3)) == [2, 3]
    assert [list(ShardPlan(world=4, rank=r).kv_heads(TINY)) for r in range(4)] == [[0], [0], [1], [1]]


def test_shard_slices_every_parameter_as_planned():
    c = TINY
    d, di, h = c.head_dim, c.index_head_dim, c.hidden_size
    p = ShardPlan(world=4, rank=2, ep=2)  # q heads 4, 5; KV / index head 1; ep group 1, moe-TP rank 0
    q = torch.arange(c.num_heads * d).view(-1, 1).expand(-1, h)
    assert torch.equal(p.shard(c, "layers.1.attn.q_proj.weight", q), q[4 * d:6 * d])
    k = torch.randn(c.num_kv_heads * d, h)
    assert torch.equal(p.shard(c, "layers.1.attn.k_proj.weight", k), k[d:2 * d])
    iq = torch.randn(c.index_heads * di, h)
    assert torch.equal(p.shard(c, "layers.1.attn.index_q_proj.weight", iq), iq[di:2 * di])
    o = torch.randn(h, c.num_heads * d)
    assert torch.equal(p.shard(c, "layers.1.attn.o_proj.weight", o), o[:, 4 * d:6 * d])
    ik = torch.randn(di, h)
    assert p.shard(c, "layers.1.attn.index_k_proj.weight", ik) is ik  # replicated
    router = torch.randn(c.num_experts, h)
    assert p.shard(c, "layers.1.moe.router.weight", router) is router
    gu = torch.randn(c.num_experts, h, 2 * c.intermediate_size)
    i2 = c.intermediate_size // 2
    want = torch.cat([gu[4:8, :, :i2], gu[4:8, :, c.intermediate_size:c.intermediate_size + i2]], dim=2)
    assert torch.equal(p.shard(c, "layers.1.moe.experts.gate_up", gu), want)
    down = torch.randn(c.num_experts, c.intermediate_size, h)
    assert torch.equal(p.shard(c, "layers.1.moe.experts.down", down), down[4:8, :i2])
    shared = torch.randn(2 * c.shared_intermediate_size, h)
    s4 = c.shared_intermediate_size // 4
    want = torch.cat([shared[2 * s4:3 * s4], shared[c.shared_intermediate_size + 2 * s4:][:s4]])
    assert torch.equal(p.shard(c, "layers.1.moe.shared.gate_up_proj.weight", shared), want)
    emb = torch.randn(c.vocab_size, h)
    v = c.vocab_size // 4
    assert torch.equal(p.shard(c, "embed_tokens.weight", emb), emb[2 * v:3 * v])


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 8)])
def test_ranks_together_hold_every_expert_weight_exactly_once(world, ep):
    c = TINY
    gu = torch.randn(c.num_experts, c.hidden_size, 2 * c.intermediate_size)
    seen = torch.zeros_like(gu, dtype=torch.long)
    marker = torch.arange(gu.numel()).view(gu.shape)
    for r in range(world):
        part = ShardPlan(world=world, rank=r, ep=ep).shard(c, "layers.1.moe.experts.gate_up", marker)
        seen.view(-1)[part.flatten()] += 1
    assert bool((seen == 1).all())


def test_plan_rejects_degrees_that_do_not_fit():
    with pytest.raises(ShardPlanError) as err:
        ShardPlan(world=3).check(TINY)
    assert "tp 3 does not divide the 8 attention heads" in err.value.problems
    assert any(p.startswith("tp 3 and 2 KV heads: one must divide the other") for p in err.value.problems)
    assert "tp 3 does not divide the vocabulary 512" in err.value.problems  # the reference splits it evenly
    assert isinstance(err.value, ValueError)  # the builtin base older callers caught
    with pytest.raises(ShardPlanError, match="ep 3 must divide tp 4"):
        ShardPlan(world=4, ep=3).check(TINY)
    with pytest.raises(ShardPlanError, match="ep 16 does not divide the 8 experts"):
        ShardPlan(world=16, ep=16).check(TINY.replace(num_heads=16, vocab_size=512))
    ShardPlan(world=64, rank=5, ep=64).check(M3)  # the NxDI contrib's TP64 / EP64 layout fits
