"""Each op against the corresponding piece of transformers 5.23 `minimax_m3_vl` (float32)."""

import pytest
import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hfm
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

from minimax_m3 import ops
from minimax_m3.config import M3Config
from test.support import oracles

C = M3Config.preset("tiny")
TOL = 1e-5


def hf_text_config(c: M3Config = C) -> MiniMaxM3VLTextConfig:
    return MiniMaxM3VLTextConfig(**c.to_release_dict()["text_config"])


def rnd(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_rms_norm_matches_gemma_norm():
    norm = hfm.MiniMaxM3VLRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(rnd(64, seed=1, scale=0.3))
    x = rnd(3, 5, 64, seed=2, scale=4.0)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x), atol=TOL, rtol=0)
    # folded weights (NxDI form): offset 0 with 1 + w stored
    torch.testing.assert_close(ops.rms_norm(x, 1 + norm.weight, 1e-6, offset=0.0), norm(x), atol=TOL, rtol=0)
    # bf16 input: computed in fp32, cast back like transformers
    xb = x.bfloat16()
    assert torch.equal(ops.rms_norm(xb, norm.weight, 1e-6), norm(xb))


def test_partial_rope_matches_transformers():
    cfg = hf_text_config()
    rot = hfm.MiniMaxM3VLRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 5, 100, 4095]])
    x = rnd(1, 2, 5, C.head_dim, seed=3)
    cos_h, sin_h = rot(x, pos)
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(C.rotary_dim, C.rope_theta), torch.float32)
    torch.testing.assert_close(cos, cos_h, atol=0, rtol=0)
    q_h, k_h = hfm.apply_rotary_pos_emb(x, x * 2, cos_h, sin_h)
    torch.testing.assert_close(ops.apply_rope(x, cos, sin), q_h, atol=TOL, rtol=0)
    assert torch.equal(ops.apply_rope(x, cos, sin)[..., C.rotary_dim:], x[..., C.rotary_dim:])  # pass-through


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_bit_equal_to_apply_rope(dtype):
    """The table form (full-width cos/sin, rotate-half as a permutation) gives exactly ``apply_rope``'s numbers."""
    pos = torch.tensor([[0, 1, 5, 100, 4095], [7, 8, 9, 10, 65000]])
    x = rnd(2, 3, 5, C.head_dim, seed=4).to(dtype)
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(C.rotary_dim, C.rope_theta), dtype)
    want = ops.apply_rope(x, cos, sin)
    got = ops.apply_rope_tables(x, *ops.rope_tables(cos, sin, C.head_dim))
    assert torch.equal(got, want)
    assert not torch.equal(want[..., :C.rotary_dim], x[..., :C.rotary_dim])  # it did rotate


def test_swiglu_oai_matches_dense_mlp_and_clamps():
    cfg = hf_text_config()
    mlp = hfm.MiniMaxM3VLDenseMLP(cfg, intermediate_size=48)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(rnd(96, C.hidden_size, seed=4, scale=0.5))  # large: clamps engage
    x = rnd(7, C.hidden_size, seed=5)
    gu = x @ mlp.gate_up_proj.weight.t()
    assert gu.max() > 7 and gu.min() < -7
    got = ops.swiglu_mlp(x, mlp.gate_up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(got, mlp(x), atol=TOL, rtol=1e-5)
    # hand check of the activation on exact points
    g, u = torch.tensor([10.0, -10.0, 0.0]), torch.tensor([10.0, -10.0, 1.0])
    expect = torch.tensor([(7 + 1) * 7 * torch.sigmoid(torch.tensor(1.702 * 7)).item(),
                           (-7 + 1) * -10 * torch.sigmoid(torch.tensor(-17.02)).item(), 0.0])
    torch.testing.assert_close(ops.swiglu_oai(g, u), expect, atol=1e-6, rtol=0)


def _hf_moe(seed=6):
    cfg = hf_text_config()
    moe = hfm.MiniMaxM3VLSparseMoeBlock(cfg)
    with torch.no_grad():
        for i, p in enumerate(moe.parameters()):
            p.copy_(rnd(*p.shape, seed=seed + i, scale=0.2))
        moe.gate.e_score_correction_bias.copy_(rnd(C.num_experts, seed=99, scale=0.1))
    return moe


def test_router_matches_and_bias_is_selection_only():
    moe = _hf_moe()
    x = rnd(40, C.hidden_size, seed=7)
    _, w_h, e_h = moe.gate(x)
    w, e = ops.route(x, moe.gate.weight, moe.gate.e_score_correction_bias, C.top_k)
    se, oe = torch.sort(e, -1)
    se_h, oe_h = torch.sort(e_h, -1)
    assert torch.equal(se, se_h)
    torch.testing.assert_close(w.gather(-1, oe), w_h.gather(-1, oe_h), atol=1e-6, rtol=0)
    # the bias changes which experts win on some tokens but weights are the plain sigmoid scores renormalised
    w0, e0 = ops.route(x, moe.gate.weight, torch.zeros(C.num_experts), C.top_k)
    assert not torch.equal(torch.sort(e0, -1)[0], se)
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    sel = scores.gather(-1, e)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True))


def test_moe_block_matches_with_routed_scaling_and_shared_expert():
    moe = _hf_moe()
    x = rnd(2, 9, C.hidden_size, seed=8)
    w, e = ops.route(x.view(-1, C.hidden_size), moe.gate.weight, moe.gate.e_score_correction_bias, C.top_k)
    gate_up = moe.experts.gate_up_proj.transpose(1, 2)  # [E, H, 2I]
    down = moe.experts.down_proj.transpose(1, 2)  # [E, I, H]
    routed = ops.moe_all_experts(x.view(-1, C.hidden_size), w, e, gate_up, down)
    shared = ops.swiglu_mlp(x.view(-1, C.hidden_size), moe.shared_experts.gate_up_proj.weight,
                            moe.shared_experts.down_proj.weight)
    got = (2.0 * routed + shared).view_as(x)
    torch.testing.assert_close(got, moe(x), atol=TOL, rtol=1e-5)


def _hf_indexer(layer=1):
    cfg = hf_text_config()
    idx = hfm.MiniMaxM3VLIndexer(cfg, layer)
    with torch.no_grad():
        for i, p in enumerate(idx.parameters()):
            p.copy_(rnd(*p.shape, seed=20 + i, scale=0.3))
    return cfg, idx


@pytest.mark.parametrize("seq", [20, 100, 161])
def test_indexer_selection_matches_per_query_and_kv_group(seq):
    cfg, idx = _hf_indexer()
    rot = hfm.MiniMaxM3VLRotaryEmbedding(cfg)
    h = rnd(2, seq, C.hidden_size, seed=seq)
    pos = torch.arange(seq).unsqueeze(0).expand(2, -1)
    cos, sin = rot(h, pos)
    want = idx(h, (cos, sin), None, pos)  # [B, G, S, K]
    iq = ops.apply_rope(idx.q_norm(idx.q_proj(h).view(2, seq, -1, C.index_head_dim)).transpose(1, 2), cos, sin)
    ik = ops.apply_rope(idx.k_norm(idx.k_proj(h).view(2, seq, 1, C.index_head_dim)).transpose(1, 2), cos, sin)
    got = oracles.select_blocks_for_queries(iq, ik[:, 0], pos, C.index_block_size, C.index_topk, 0, 1)
    assert got.shape == want.shape
    assert torch.equal(torch.sort(got, -1)[0], torch.sort(want, -1)[0])
    if seq > C.index_topk * C.index_block_size:  # the indexer really drops blocks here
        assert (got >= 0).sum(-1).max() == C.index_topk
        assert (torch.div(pos[0], C.index_block_size, rounding_mode="floor") + 1).max() > C.index_topk


def test_select_blocks_forcing_rules_by_hand():
    # one query at position 70 (block 4 of 16-token blocks), 6 blocks, scores favour blocks 5 (future), 1, 2
    scores = torch.tensor([[[[0.1, 0.9, 0.8, 0.2, 0.3, 5.0]]]])
    pos = torch.tensor([[70]])
    assert sorted(ops.select_blocks(scores, pos, 16, 2, 0, 1)[0, 0, 0].tolist()) == [1, 4]  # own block forced
    assert sorted(ops.select_blocks(scores, pos, 16, 3, 1, 1)[0, 0, 0].tolist()) == [0, 1, 4]  # init forced
    early = ops.select_blocks(torch.tensor([[[[0.5, float("-inf"), float("-inf")]]]]), torch.tensor([[3]]), 16, 2)
    assert early[0, 0, 0].tolist() == [0, -1]  # an empty slot is -1


def test_sparse_prefill_and_decode_match_transformers_eager_mask():
    """Block-sparse attention through keep masks vs transformers' dense additive block mask."""
    cfg, idx = _hf_indexer()
    s, b = 150, 1
    q, k, v = rnd(b, C.num_heads, s, 32, seed=1), rnd(b, 2, s, 32, seed=2), rnd(b, 2, s, 32, seed=3)
    iq, ik = rnd(b, 2, s, 32, seed=4), rnd(b, s, 32, seed=5)
    pos = torch.arange(s).unsqueeze(0)
    blocks = oracles.select_blocks_for_queries(iq, ik, pos, 16, 2)
    mask = idx.build_block_mask(blocks, None, s, torch.float32, q.device, pos)
    want, _ = hfm.eager_attention_forward(
        type("M", (), {"num_key_value_groups": 4, "training": False})(), q, k, v, mask, scaling=32 ** -0.5)
    got = oracles.prefill_attention(q, k, v, 32 ** -0.5, iq=iq, ik=ik, block_size=16, topk=2, tile=48)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=TOL, rtol=0)
    # decode for the last position reads only its blocks from a paged cache and agrees with prefill
    pad = 160 - s
    kc, vc = torch.nn.functional.pad(k, (0, 0, 0, pad)), torch.nn.functional.pad(v, (0, 0, 0, pad))
    dec = oracles.decode_attention_sparse(q[:, :, -1:], kc, vc, torch.tensor([s - 1]), blocks[:, :, -1], 16, 32 ** -0.5)
    torch.testing.assert_close(dec, got[:, :, -1:], atol=TOL, rtol=0)


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(ops.filter_logits(logits, 1.0, top_k=2)[0, 2:]).all()
    kept = ~torch.isinf(ops.filter_logits(logits, 1.0, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = ~torch.isinf(ops.filter_logits(logits, 1.0, top_p=0.81))
    assert kept.tolist() == [[True, True, True, False]]
    g = torch.Generator().manual_seed(0)
    draws = [int(ops.sample(logits, 1.0, 0, 1.0, g)) for _ in range(2000)]
    freq0 = draws.count(0) / len(draws)
    assert abs(freq0 - 0.5) < 0.05
