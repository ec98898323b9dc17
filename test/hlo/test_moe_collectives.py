"""One reduction per MLP (issue 15 item 3), read from the traced graphs: at TP 64 / EP 64 each layer all-reduces once
after attention and once after its MLP — the MoE layers' routed and shared partial sums together — in the model's
dtype (bf16), in prefill and decode. Before: 3 per MoE layer, the dense and shared MLP reductions in f32."""

from __future__ import annotations

import json

import pytest

from minimax_m3.config import M3Config
from minimax_m3.graphs import hlo_cost, hlo_schema


def _all_reduces(out):
    man = json.loads((out / "dry_run.json").read_text())
    cfg = M3Config.from_fields(man["model"])
    for g in man["graphs"]:
        fig = hlo_cost.analyze_module(hlo_schema.parse_module((out / g["hlo"]).read_bytes()))
        yield g, cfg, [c for c in fig["collectives"] if c["kind"] == "all-reduce"]


@pytest.mark.parametrize("shape", ["narrow", "m3"])
def test_two_bf16_all_reduces_per_layer(request, shape):
    out = request.getfixturevalue(f"dry_{shape}")
    for g, cfg, ars in _all_reduces(out):
        where = f"{g['submodel']} bucket {g['bucket']}"
        assert sum(c["count"] for c in ars) == 2 * cfg.num_layers, (where, ars)
        assert {c["dtype"] for c in ars} == {"bf16"}, (where, ars)
        assert {c["group_size"] for c in ars} == {64}, (where, ars)
