"""The NxDI rule table on a synthetic release checkpoint (no Neuron SDK needed)."""

from __future__ import annotations

import pytest
import torch

from minimax_m3.checkpoint import CheckpointError, open_source
from minimax_m3.checkpoint.audit import coverage
from minimax_m3.checkpoint.convert import stream_state_dict, target_table
from minimax_m3.checkpoint.nxdi_rules import fp32_targets
from minimax_m3.config import M3Config

LM = "language_model.model"


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    c = M3Config.from_pretrained(tiny_ckpt)
    src = open_source(tiny_ckpt, c)
    sd = dict(stream_state_dict(tiny_ckpt, to="neuron", dtype=torch.bfloat16, tp=4, config=c))
    return c, src, sd


def create_local_weight(rank, world, full, dim, per_partition, stride):
    """NxD ``trace.trace.create_local_weight`` semantics, restated: split ``full`` along ``dim`` in chunks of
    ``per_partition / stride`` and take chunks ``rank::world``."""
    chunks = torch.split(full, per_partition // stride, dim=dim)[rank::world]
    return torch.cat(chunks, dim=dim)


def test_every_release_key_is_consumed_or_skipped(tiny_ckpt, tiny):
    c, src, _ = tiny
    used, skipped, unaccounted = coverage(src, c, target_table("neuron", c, tp=4))
    assert unaccounted == []
    assert any(k.startswith("vision_tower.") for k in skipped)
    assert not any(k.startswith("vision_tower.") for k in used)
    # the text backbone is fully consumed
    assert all(k in used for k in src.keys() if k.startswith("language_model."))


def test_unknown_or_missing_keys_stop_the_load(tiny_ckpt, tmp_path):
    """The port's loader validates first: an unknown key or a missing tensor is one clear error."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    tensors[f"{LM}.layers.0.self_attn.new_thing.weight"] = torch.zeros(2)
    tensors.pop(next(k for k in tensors if k.endswith("index_k_norm.weight")))
    save_file(tensors, shard)
    index = (bad / "model.safetensors.index.json")
    import json

    idx = json.loads(index.read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in tensors or v != shard.name}
    idx["weight_map"][f"{LM}.layers.0.self_attn.new_thing.weight"] = shard.name
    index.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as err:
        dict(stream_state_dict(bad, to="neuron", tp=4))
    assert "new_thing" in str(err.value) and "index_k_norm" in str(err.value)


def test_norms_are_folded_in_fp32(tiny):
    c, src, sd = tiny
    pairs = {"norm.weight": f"{LM}.norm.weight"}
    for i in range(c.num_layers):
        a = f"{LM}.layers.{i}"
        pairs[f"layers.{i}.input_layernorm.weight"] = f"{a}.input_layernorm.weight"
        pairs[f"layers.{i}.post_attention_layernorm.weight"] = f"{a}.post_attention_layernorm.weight"
        pairs[f"layers.{i}.self_attn.q_layernorm.weight"] = f"{a}.self_attn.q_norm.weight"
        pairs[f"layers.{i}.self_attn.k_layernorm.weight"] = f"{a}.self_attn.k_norm.weight"
        if c.sparse_layers[i]:
            pairs[f"layers.{i}.self_attn.index_q_norm.weight"] = f"{a}.self_attn.index_q_norm.weight"
            pairs[f"layers.{i}.self_attn.index_k_norm.weight"] = f"{a}.self_attn.index_k_norm.weight"
    for ours, rel in pairs.items():
        w = src.get(rel)
        assert sd[ours].dtype == torch.float32, ours
        assert torch.equal(sd[ours], 1.0 + w.float()), ours
        # the fold is not a bf16 rounding of 1 + w
        assert not torch.equal(sd[ours], (1.0 + w.float()).bfloat16().float()) or w.abs().max() == 0
    assert pairs.keys() <= fp32_targets(c)


def test_router_and_bias_stay_fp32_and_exact(tiny):
    c, src, sd = tiny
    for i in (i for i in range(c.num_layers) if c.moe_layers[i]):
        m = f"{LM}.layers.{i}.block_sparse_moe"
        b = sd[f"layers.{i}.moe.router.e_score_correction_bias"]
        assert b.dtype == torch.float32 and torch.equal(b, src.get(f"{m}.e_score_correction_bias").float())
        assert len(torch.unique(b)) > 1  # non-uniform: a constant-folded bias would be caught
        w = sd[f"layers.{i}.moe.router.linear_router.weight"]
        assert w.dtype == torch.float32 and torch.equal(w, src.get(f"{m}.gate.weight").float())


def test_expert_layout_and_zero_biases(tiny):
    c, src, sd = tiny
    i = 1
    m = f"{LM}.layers.{i}.block_sparse_moe"
    gu = sd[f"layers.{i}.moe.expert_mlps.mlp_op.gate_up_proj.weight"]
    dn = sd[f"layers.{i}.moe.expert_mlps.mlp_op.down_proj.weight"]
    assert gu.shape == (c.num_experts, c.hidden_size, 2 * c.intermediate_size)
    assert dn.shape == (c.num_experts, c.intermediate_size, c.hidden_size)
    for e in (0, c.num_experts - 1):
        assert torch.equal(gu[e, :, : c.intermediate_size], src.get(f"{m}.experts.{e}.w1.weight").t())
        assert torch.equal(gu[e, :, c.intermediate_size:], src.get(f"{m}.experts.{e}.w3.weight").t())
        # the routed scaling factor (2.0) folded in: exact in bf16 (a power of two)
        assert torch.equal(dn[e], (c.routed_scaling_factor * src.get(f"{m}.experts.{e}.w2.weight").float()).t()
                           .to(dn.dtype))
    gb = sd[f"layers.{i}.moe.expert_mlps.mlp_op.gate_up_proj.bias"]
    db = sd[f"layers.{i}.moe.expert_mlps.mlp_op.down_proj.bias"]
    assert gb.shape == (c.num_experts, 2 * c.intermediate_size) and not gb.any()
    assert db.shape == (c.num_experts, c.hidden_size) and not db.any()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_stride2_gate_up_gives_each_rank_its_gate_and_up_slice(tiny, tp):
    c, src, sd = tiny
    g = src.get(f"{LM}.layers.0.mlp.gate_proj.weight")
    u = src.get(f"{LM}.layers.0.mlp.up_proj.weight")
    full = sd["layers.0.mlp.gate_up_proj.weight"]
    inter = c.dense_intermediate_size
    per = 2 * inter // tp
    for r in range(tp):
        local = create_local_weight(r, tp, full, 0, per, stride=2)
        lg, lu = local.chunk(2, dim=0)
        assert torch.equal(lg, g[r * inter // tp:(r + 1) * inter // tp])
        assert torch.equal(lu, u[r * inter // tp:(r + 1) * inter // tp])
    if tp > 1:  # stride 1 would hand rank 0 only gate rows: the bug the stride prevents
        lg, lu = create_local_weight(0, tp, full, 0, per, stride=1).chunk(2, dim=0)
        assert not torch.equal(lu, u[: inter // tp])


def test_stride2_hand_case():
    full = torch.arange(8).view(8, 1)  # gate rows 0..3, up rows 4..7
    assert create_local_weight(0, 2, full, 0, 4, 2).flatten().tolist() == [0, 1, 4, 5]
    assert create_local_weight(1, 2, full, 0, 4, 2).flatten().tolist() == [2, 3, 6, 7]


def test_attention_and_rank_keys(tiny):
    c, src, sd = tiny
    assert torch.equal(sd["rank_util.rank"], torch.arange(4, dtype=torch.int32))
    for i in range(c.num_layers):
        a = f"{LM}.layers.{i}.self_attn"
        for n in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(sd[f"layers.{i}.self_attn.qkv_proj.{n}.weight"], src.get(f"{a}.{n}.weight"))
        assert torch.equal(sd[f"layers.{i}.self_attn.o_proj.o_proj.weight"], src.get(f"{a}.o_proj.weight"))
        assert torch.equal(sd[f"layers.{i}.self_attn.rank_util.rank"], torch.arange(4, dtype=torch.int32))
        assert (f"layers.{i}.self_attn.index_q_proj.weight" in sd) == c.sparse_layers[i]
    assert not any(k.startswith("language_model") or "vision" in k for k in sd)


def test_fused_qkv(tiny_ckpt, tiny):
    c, src, _ = tiny
    out = dict(stream_state_dict(tiny_ckpt, to="neuron", tp=2, config=c, fused_qkv=True))
    a = f"{LM}.layers.1.self_attn"
    w = torch.cat([src.get(f"{a}.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(out["layers.1.self_attn.qkv_proj.Wqkv.weight"], w)
    assert "layers.1.self_attn.qkv_proj.q_proj.weight" not in out
