"""Prefill MoE through NxD's shard-on-intermediate dynamic-while kernel (issue 14 item 1), read from traced graphs.

The kernel needs hidden >= 512 (``blockwise.py`` ``check_blockwise_mm_kernel_compatibility``), so this traces
M3's head and expert counts at hidden 512 / expert intermediate 256 (TP 64 / EP 64 / LNC 2, prefill 2048 and 8192).
Every MoE layer of every context-encoding graph must be one kernel call with the operands NxD hands the kernel
(hand-computed shapes below), no torch blockwise loop, and routed-expert FLOPs (balanced routing, hlo_cost's
stated model) <= 2x the useful work at 8K. Before: NxD's torch fallback, ceil((T*k-1)/512)+1 full-expert blocks."""

from __future__ import annotations

import json
import math

import pytest

from minimax_m3.config import M3Config
from minimax_m3.graphs import hlo_cost, hlo_schema
from minimax_m3 import planner as plan

from .conftest import dry_run, write_config

B = 256  # neuron.config.M3_BLOCKWISE
EP = 64
ARGS = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", "1", "--seq-len", "8192", "--context-buckets",
        "2048,8192", "--token-buckets", "4096,8192"]


@pytest.fixture(scope="module")
def dry_kernel(tmp_path_factory):
    from test.support.hlo.nxd_shard_tp64 import narrow_config

    cfg = narrow_config().replace(hidden_size=512, intermediate_size=256, dense_intermediate_size=512,
                                  shared_intermediate_size=256, max_position_embeddings=8192)
    model = write_config(tmp_path_factory.mktemp("cfg") / "kernel", cfg)
    return dry_run(model, tmp_path_factory.mktemp("dry") / "kernel", ARGS)


def _kernel_calls(module):
    """The MoE kernel's calls (the dense layer's flash-attention kernel is another NKI custom call)."""
    mod = hlo_cost.Module(module)
    out = []
    for node, ins in mod.all_instructions():
        if ins.opcode == "custom-call" and ins.custom_call_target == "AwsNeuronCustomNativeKernel":
            cfg = json.loads(bytes(ins.backend_config))
            if cfg["nki_kernel"] != "attention_cte":
                shapes = [tuple(mod.shape_of(o).dimensions) for o in mod.operands[node]]
                out.append((cfg, shapes, tuple(ins.shape.dimensions)))
    return out


def test_every_moe_layer_is_one_kernel_call_with_nxd_operands(dry_kernel):
    man = json.loads((dry_kernel / "dry_run.json").read_text())
    c = M3Config.from_fields(man["model"])
    h, i, k, e_local = c.hidden_size, c.intermediate_size, c.top_k, c.num_experts // EP
    ctx = [g for g in man["graphs"] if g["submodel"] == "context_encoding_model"]
    assert sorted(g["bucket"] for g in ctx) == [2048, 8192]
    for g in ctx:
        t = g["bucket"]
        module = hlo_schema.parse_module((dry_kernel / g["hlo"]).read_bytes())
        calls = _kernel_calls(module)
        assert len(calls) == sum(c.moe_layers), (t, len(calls))
        n_blocks = math.ceil((t * k - (e_local - 1)) / B) + e_local - 1  # NxD's worst case, expert_mlps_v2:718
        s = math.ceil(math.ceil(t * k / EP) / B)  # NxD's num_static_blocks default, :733
        for cfg, shapes, out in calls:
            assert cfg == {"nki_kernel": "blockwise_mm_baseline_shard_intermediate_hybrid", "block_size": B,
                           "num_static_block": s, "num_blocks": n_blocks}
            # conditions (+1 pad), hidden (+1 padding row), affinities ((T+1)*E_l, 1), gate_up [E_l, H, 2, I],
            # down [E_l, I, H], gate_up bias [E_l, 2, I], down bias [E_l, H], token ids [N*B], block experts [N]
            assert shapes == [(n_blocks + 1,), (t + 1, h), ((t + 1) * e_local, 1), (e_local, h, 2, i),
                              (e_local, i, h), (e_local, 2, i), (e_local, h), (n_blocks * B,), (n_blocks,)]
            assert out == (t + 1, h)


def test_routed_flops_follow_routed_tokens(dry_kernel):
    man = json.loads((dry_kernel / "dry_run.json").read_text())
    c = M3Config.from_fields(man["model"])
    h, i, k, e_local = c.hidden_size, c.intermediate_size, c.top_k, c.num_experts // EP
    for g in (g for g in man["graphs"] if g["submodel"] == "context_encoding_model"):
        t = g["bucket"]
        fig = hlo_cost.analyze_module(hlo_schema.parse_module((dry_kernel / g["hlo"]).read_bytes()))
        useful = sum(c.moe_layers) * t * k * 6 * h * i / EP
        assert useful == plan.prefill_flops(c, 64, 64, 1, t)["routed_experts"]
        s = math.ceil(math.ceil(t * k / EP) / B)
        kernel = sum(c.moe_layers) * e_local * math.ceil(s / e_local) * B * 6 * h * i
        routed = fig["flops"]["routed_experts"]
        # the kernel's rows, plus NxD's small routing dots outside it (block mapping: < 1 % here)
        assert kernel <= routed <= 1.01 * kernel, (t, routed, kernel)
        if t == 8192:
            assert routed <= 2 * useful, (routed, useful)
