"""Synthetic checkpoints: the release's layout, deterministic by seed, loadable by transformers 5.23."""

import json

import torch
from safetensors import safe_open

from minimax_m3.checkpoint.synthetic import write_synthetic


def test_transformers_loads_it_with_nothing_missing_or_unexpected(tiny_ckpt):
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    _, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        tiny_ckpt, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_release_layout_keys_dtypes_and_shards(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert "sparse_attention_config" in cfg["text_config"] and cfg["text_config"]["hidden_act"] == "swigluoai"
    dtypes = {}
    for shard in shards:
        with safe_open(str(tiny_ckpt / shard), "pt") as f:
            for k in f.keys():
                dtypes[k] = f.get_slice(k).get_dtype()
    lm = "language_model.model.layers"
    assert dtypes[f"{lm}.1.block_sparse_moe.experts.7.w1.weight"] == "BF16"
    assert dtypes[f"{lm}.1.block_sparse_moe.gate.weight"] == "F32"
    assert dtypes[f"{lm}.1.block_sparse_moe.e_score_correction_bias"] == "F32"
    assert dtypes[f"{lm}.0.mlp.gate_proj.weight"] == "BF16" and f"{lm}.0.block_sparse_moe.gate.weight" not in dtypes
    assert f"{lm}.1.self_attn.index_q_proj.weight" in dtypes and f"{lm}.0.self_attn.index_q_proj.weight" not in dtypes
    assert any(k.startswith("vision_tower.") for k in dtypes) and "language_model.lm_head.weight" in dtypes


def test_deterministic_by_seed(tmp_path):
    a = write_synthetic(tmp_path / "a", "tiny", seed=3)
    b = write_synthetic(tmp_path / "b", "tiny", seed=3)
    c = write_synthetic(tmp_path / "c", "tiny", seed=4)
    name = "model-00001-of-00002.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / name).read_bytes() != (c / name).read_bytes()
