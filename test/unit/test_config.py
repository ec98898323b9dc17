"""M3Config: both config.json forms, presets, and one clear error for every bad setting."""

import json

import pytest

from minimax_m3.config import ConfigError, M3Config


def test_release_form_round_trips_for_every_preset():
    for name in ("tiny", "small", "m3"):
        c = M3Config.preset(name)
        assert M3Config.from_dict(c.to_release_dict()) == c


def test_m3_preset_is_the_published_model():
    c = M3Config.preset("m3")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (6144, 60, 64, 4, 128)
    assert c.moe_layers == (False,) * 3 + (True,) * 57 and c.sparse_layers == c.moe_layers
    assert (c.index_topk, c.index_block_size, c.index_local_blocks, c.rotary_dim) == (16, 128, 1, 64)


def test_transformers_form_matches_release_form(tiny_ckpt, tmp_path):
    """The config transformers writes (layer_types, index_*, rope_parameters) parses to the same M3Config."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    hf = MiniMaxM3VLConfig.from_pretrained(tiny_ckpt)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in written["text_config"] and "sparse_attention_config" not in written["text_config"]
    assert M3Config.from_pretrained(tmp_path) == M3Config.from_pretrained(tiny_ckpt)


def _release(**text_changes):
    d = M3Config.preset("tiny").to_release_dict()
    for k, v in text_changes.items():
        if k.startswith("sparse_"):
            d["text_config"]["sparse_attention_config"][k] = v
        else:
            d["text_config"][k] = v
    return d


@pytest.mark.parametrize("changes, needle", [
    ({"sparse_num_index_heads": 1}, "index heads (1) differ from KV heads (2)"),
    ({"sparse_disable_index_value": [0, 0, 1, 1]}, "sparse_disable_index_value is 0 on sparse layer(s) [1]"),
    ({"sparse_score_type": "lse"}, "sparse_score_type 'lse' is not supported"),
    ({"moe_layer_freq": [0, 1, 1]}, "moe_layer_freq has 3 entries but num_hidden_layers is 4"),
    ({"sparse_attention_freq": [0, 1]}, "sparse_attention_freq has 2 entries"),
    ({"rotary_dim": 12}, "contradicts partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"hidden_size": "big"}, "hidden_size must be a positive integer"),
])
def test_bad_settings_fail_with_one_clear_message(changes, needle):
    with pytest.raises(ConfigError) as err:
        M3Config.from_dict(_release(**changes))
    assert needle in str(err.value)


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        M3Config.from_dict(_release(sparse_score_type="lse", hidden_act="relu", sparse_num_index_heads=1))
    assert len(err.value.problems) == 3


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        M3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        M3Config.from_pretrained(tmp_path)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        M3Config.preset("huge")
