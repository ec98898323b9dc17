"""The graph report on a fused speculation build (``fused_speculation_model``): the draft's parameters (NxDI's
``draft_model.`` and the target-state rolling buffer) counted apart from the target's, the planner's minimum at
``speculation_length`` tokens per row. A hand-built module (``test_graphs._hand_module``: p0 bf16[4, 8] read 8 x 64
bytes, p1 bf16[8, 3] read by two dots, p2 f32[2, 2] read by a while loop) under the names a fused build gives."""

from __future__ import annotations

import json
from pathlib import Path

from minimax_m3 import planner as plan
from minimax_m3.graphs import report as graphs
from minimax_m3.graphs import table

from .test_graphs import TINY, _hand_module


def _dry_dir(root: Path, submodel: str, names: tuple[str, str, str], roles=("weight", "weight", "state")) -> Path:
    (root / "hlo").mkdir(parents=True)
    (root / "hlo" / "g.hlo").write_bytes(_hand_module().SerializeToString())
    params = [{"number": n, "role": r, "name": name} for n, (r, name) in enumerate(zip(roles, names))]
    man = {"format": 1, "port": "minimax-m3", "layout": {"tp": 2, "ep": 2, "lnc": 1, "world_size": 2, "rank": 0},
           "dtype": "bfloat16", "batch_size": 1, "max_length": 8, "speculation_length": 4,
           "model": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.__dict__.items()},
           "graphs": [{"submodel": submodel, "bucket": 8, "batch": 1, "tokens": 1, "hlo": "hlo/g.hlo",
                       "params": params}]}
    (root / "dry_run.json").write_text(json.dumps(man))
    return root


def test_a_fused_graph_counts_its_draft_apart(tmp_path):
    d = _dry_dir(tmp_path / "fused", graphs.FUSED, ("draft_model.layers.0.mlp.up_proj.weight",
                                                    "target_model.lm_head.weight",
                                                    "hidden_state_rolling_buffer.hidden_states"))
    g = graphs.analyze_dir(d, write=False)["graphs"][0]
    assert g["bytes_read"] == {"weights": 2 * 8 * 3 * 2, "kv_dense": 0, "kv_sparse": 0, "index_k": 0}
    assert g["draft"] == {"weights": 8 * 64, "kv": 0, "states": 2 * 2 * 4, "state_copies": 0,
                          "state_copy_bytes": 0}
    # one token per row in the call, the target verifies speculation_length: the planner's minimum at 4 tokens
    assert g["tokens"] == 4
    assert g["analytic"]["bytes_read"] == plan.decode_minimum_bytes(TINY, 2, 2, 1, 8, dtype_bytes=2, tokens=4)
    labels = [label for label, *_ in table._rows(g)]
    assert "draft: bytes read: weights" in labels and "draft: bytes read: target states (rolling buffer)" in labels


def test_a_draft_cache_is_not_the_targets(tmp_path):
    """``draft_model.kv_mgr.past_key_values.0`` would read as the target's layer-0 K/V by its name alone."""
    d = _dry_dir(tmp_path / "kv", graphs.FUSED, ("draft_model.kv_mgr.past_key_values.0", "target_model.w",
                                                 "target_model.kv_mgr.past_key_values.0"),
                 ("state", "weight", "state"))
    g = graphs.analyze_dir(d, write=False)["graphs"][0]
    assert g["draft"]["kv"] == 8 * 64 and g["draft"]["weights"] == 0
    assert g["bytes_read"]["kv_dense"] == 2 * 2 * 4  # TINY's layer 0 is dense: the target's cache only


def test_other_graphs_have_no_draft_figures(tmp_path):
    d = _dry_dir(tmp_path / "plain", "token_generation_model", ("w0", "w1", "kv_mgr.past_key_values.0"))
    g = graphs.analyze_dir(d, write=False)["graphs"][0]
    assert "draft" not in g and g["tokens"] == 1
    assert not any(label.startswith("draft:") for label, *_ in table._rows(g))
