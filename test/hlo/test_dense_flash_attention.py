"""Dense layers prefill through NxDI's flash-attention kernel on device builds (issue 14 item 2), from traced graphs.

``minimax-m3 compile`` turns NxDI's CTE attention kernel on (``attn_kernel_enabled=True``); at LNC 2 with NxDI's
context mask, ``get_flash_attention_strategy`` picks the sharded kernel for buckets of 256 and 1024, and
``NeuronAttentionBase.perform_prefill`` launches ``attention_cte[2](q, k, v, 1.0, causal_mask=True, tp_out=True,
tp_q=True, tp_k=True)`` with q ``[B*H, S, D]`` and k, v ``[B*KV, S, D]`` (trn2's native GQA: no K/V replication).
Traced here at M3's head counts and narrow widths (TP 64 / EP 64 / LNC 2: one query and one KV head per rank,
D = 8) with layers dense, sparse, dense: every context-encoding graph holds one kernel call per dense layer (two; the
sparse layer keeps ``oracles.prefill_step``, so three calls or one would fail), decode graphs none, and ``hlo_cost``
charges each call the kernel's tile count worked out by hand. Before: ``attn_kernel_enabled=False``, no call.

This is the replicated cache layout's path (``--kv-layout replicated``: NxDI's GQA copies, a prompt in one call). With
the port's default sequence-sharded caches every layer's context encoding runs ``ops.attention_step``
over the rank's shard and the kernel is not used (docs/results.md, "Graphs of the sharded layout").
"""

from __future__ import annotations

import json

import pytest

from minimax_m3.graphs import hlo_cost, hlo_schema

from .conftest import NARROW, dry_run, write_config

FLAGS = (False, True, False)  # dense, sparse, dense attention
CONFIG = {"nki_kernel": "attention_cte", "causal_mask": True, "grid": 2, "scale": 1.0, "tp_k": True, "tp_out": True,
          "tp_q": True}
# per dense layer, one head of D = 8 (test/unit/test_nki_cost.py works the tile counts out):
# S = 256: QK 2 x 2*128*256*8, PV 2*128*(128+256)*8; S = 1024 (T = 2, G = 8): 12 QK tiles x 2*128*512*8 and
# 36 PV tiles x 2*128*128*8
KERNEL_FLOPS = {256: 1_048_576 + 786_432, 1024: 12 * 1_048_576 + 36 * 262_144}


@pytest.fixture(scope="module")
def dry_flash(tmp_path_factory):
    from test.support.hlo.nxd_shard_tp64 import narrow_config

    cfg = narrow_config().replace(sparse_layers=FLAGS)
    model = write_config(tmp_path_factory.mktemp("cfg") / "flash", cfg)
    return dry_run(model, tmp_path_factory.mktemp("dry") / "flash", NARROW + ["--kv-layout", "replicated"])


def _graphs(dry):
    man = json.loads((dry / "dry_run.json").read_text())
    for g in man["graphs"]:
        yield g, hlo_schema.parse_module((dry / g["hlo"]).read_bytes())


def _kernel_calls(module):
    mod = hlo_cost.Module(module)
    out = []
    for node, ins in mod.all_instructions():
        if ins.opcode == "custom-call" and ins.custom_call_target == "AwsNeuronCustomNativeKernel":
            shapes = [(tuple(mod.shape_of(o).dimensions), mod.shape_of(o).element_type) for o in mod.operands[node]]
            out.append((json.loads(bytes(ins.backend_config)), shapes,
                        (tuple(ins.shape.dimensions), ins.shape.element_type)))
    return out


def test_one_flash_call_per_dense_layer_with_the_kernels_shapes(dry_flash):
    bf16 = hlo_schema.PRIMITIVE_TYPES["BF16"]
    seen = set()
    for g, module in _graphs(dry_flash):
        calls = _kernel_calls(module)
        if g["submodel"] != "context_encoding_model":
            assert calls == [], g["hlo"]  # decode never takes the prefill kernel
            continue
        s, d = g["bucket"], 8
        seen.add(s)
        assert len(calls) == FLAGS.count(False), (s, len(calls))
        for cfg, operands, out in calls:
            assert cfg == CONFIG
            assert operands == [((1, s, d), bf16)] * 3  # q [B*H, S, D], k and v [B*KV, S, D]
            assert out == ((1, d, s), bf16)  # tp_out: [B*H, D, S]
    assert seen == {256, 1024}


def test_the_cost_counter_charges_each_call_the_kernels_tiles(dry_flash):
    for g, module in _graphs(dry_flash):
        if g["submodel"] != "context_encoding_model":
            continue
        with_kernel = hlo_cost.analyze_module(module)["flops"]["attention"]
        for c in module.computations:  # the same graph with the kernel's name taken out of its config
            for ins in c.instructions:
                if ins.opcode == "custom-call" and ins.custom_call_target == "AwsNeuronCustomNativeKernel":
                    ins.backend_config = b"{}"
        without = hlo_cost.analyze_module(module)["flops"]["attention"]
        assert with_kernel - without == FLAGS.count(False) * KERNEL_FLOPS[g["bucket"]], g["bucket"]
