"""EAGLE3 draft checkpoints: both published config forms, the synthetic writer, and bad drafts refused in ONE error
that lists every problem. Oracles: the layout vLLM's / SGLang's ``llama_eagle3`` load, written out by hand here
(key names, shapes, ``d2t`` semantics), and vLLM's default aux ids ``(2, L // 2, L - 3)``."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimax_m3.checkpoint.draft import (DraftError, canonical, check_draft, draft_info, open_draft,
                                         write_synthetic_draft)
from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.cli import main
from minimax_m3.config import M3Config
from minimax_m3.config.draft import default_aux_layers, parse_draft_config

TINY = M3Config.preset("tiny")


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return write_synthetic_draft(tmp_path_factory.mktemp("draft") / "eagle3", TINY, seed=0)


def test_synthetic_draft_is_the_published_layout(draft):
    raw = json.loads((draft / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["eagle_aux_hidden_state_layer_ids"] == raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    t = load_file(draft / "model.safetensors")
    h, v, vd = 128, TINY.vocab_size, raw["draft_vocab_size"]
    assert vd == v // 2
    assert t["fc.weight"].shape == (h, 3 * h)  # three target states in, hidden out
    assert t["midlayer.self_attn.q_proj.weight"].shape == (raw["num_attention_heads"] * raw["head_dim"], 2 * h)
    assert t["midlayer.self_attn.k_proj.weight"].shape[1] == 2 * h  # q/k/v read cat(embedding, hidden)
    assert t["lm_head.weight"].shape == (vd, h)
    assert "embed_tokens.weight" not in t  # shared with the target (same hidden size)
    target_ids = torch.arange(vd) + t["d2t"]  # vLLM: target id = draft id + d2t[draft id]
    assert target_ids.unique().numel() == vd and 0 <= target_ids.min() and target_ids.max() < v
    assert t["t2d"].dtype == torch.bool and t["t2d"].sum() == vd and t["t2d"][target_ids].all()
    assert check_draft(draft, TINY).problems == []


def test_both_config_forms_and_the_default_aux_ids():
    llama = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 6144, "num_attention_heads": 48,
             "num_key_value_heads": 48, "intermediate_size": 16384, "vocab_size": 200064, "draft_vocab_size": 32000,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    dc, problems = parse_draft_config(llama)
    assert problems == [] and dc.head_dim == 128 and dc.target_hidden_size == 6144 and dc.aux_layer_ids is None
    m3 = M3Config()
    assert dc.aux_layers(m3.num_layers) == (2, 30, 57) == default_aux_layers(60)  # vLLM's (2, L // 2, L - 3)
    assert dc.target_problems(m3) == []
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 32000,
            "transformer_layer_config": {k: v for k, v in llama.items() if k not in ("architectures",
                                                                                    "draft_vocab_size")},
            "eagle_aux_hidden_state_layer_ids": [1, 29, 56],
            "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
    sc, problems = parse_draft_config(spec)
    assert problems == [] and sc.form == "speculators" and sc.speculative_tokens == 3
    assert sc.aux_layers(60) == (1, 29, 56) and sc.draft_vocab_size == 32000
    bad, problems = parse_draft_config({**llama, "eagle_aux_hidden_state_layer_ids": [2, 30, 57],
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
                                        "num_hidden_layers": 2, "rope_scaling": {"rope_type": "yarn"}})
    assert len(problems) == 3 and "num_hidden_layers 2" in problems[0] and "yarn" in problems[1]
    assert "[2, 30, 57] (top level) and [1, 2, 3] (eagle_config) differ" in problems[2]
    # the tiny target (4 layers): vLLM's default (2, 2, 1) repeats a layer, so the draft must name its ids
    assert "three distinct ids" in " ".join(dc.target_problems(TINY))


def _copy(draft, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(draft, out)
    return out


def test_a_bad_draft_gets_one_error_listing_every_problem(draft, tmp_path):
    bad = _copy(draft, tmp_path, "bad")
    raw = json.loads((bad / "config.json").read_text())
    raw.update(target_hidden_size=256, vocab_size=1024)  # another model's draft
    (bad / "config.json").write_text(json.dumps(raw))
    t = load_file(bad / "model.safetensors")
    del t["midlayer.mlp.down_proj.weight"]  # missing
    t["midlayer.self_attn.o_proj.weight"] = t["midlayer.self_attn.o_proj.weight"][:, :64].contiguous()  # shape
    t["midlayer.extra.weight"] = torch.zeros(2)  # unexpected
    save_file(t, bad / "model.safetensors")
    with pytest.raises(DraftError) as e:
        open_draft(bad, TINY)
    problems = e.value.problems
    text = "\n".join(problems)
    for what in ("unexpected tensor 'midlayer.extra.weight'", "missing tensor 'layer.mlp.down_proj.weight'",
                 "'midlayer.self_attn.o_proj.weight' is", "fc.weight", "t2d",
                 "target hidden states of width 256", "vocab_size 1024 differs"):
        assert what in text, (what, problems)
    assert str(e.value).startswith(f"EAGLE3 draft {bad}: {len(problems)} problem(s):")


def test_d2t_outside_the_vocabulary_and_the_target_not_a_draft(draft, tmp_path, tiny_ckpt):
    bad = _copy(draft, tmp_path, "d2t")
    t = load_file(bad / "model.safetensors")
    t["d2t"] = t["d2t"].clone()
    t["d2t"][-1] = 10_000
    save_file(t, bad / "model.safetensors")
    assert check_draft(bad, TINY).problems == [
        f"d2t maps draft ids outside the target vocabulary [0, {TINY.vocab_size}) or two draft ids to one target id"]
    assert any("is this the target checkpoint?" in p for p in check_draft(tiny_ckpt, TINY).problems)


def test_canonical_names_accept_both_layer_prefixes():
    assert canonical("midlayer.self_attn.q_proj.weight") == canonical("model.layers.0.self_attn.q_proj.weight") \
        == "layer.self_attn.q_proj.weight"
    assert canonical("model.fc.weight") == "fc.weight" and canonical("d2t") == "d2t"


def test_synth_and_inspect_commands(tmp_path, capsys, tiny_ckpt):
    out = tmp_path / "d"
    assert main(["synth", "--draft", "eagle3", str(out), "--target", str(tiny_ckpt)]) == 0
    assert "synthetic eagle3 draft" in capsys.readouterr().out
    assert main(["inspect", str(out), "--target", str(tiny_ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["problems"] == [] and info["config"]["draft_vocab"] == 256 and info["config"]["aux_layer_ids"] == \
        [1, 2, 3] and info["shared_with_target"] == ["embed_tokens.weight"]
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "EAGLE3 draft (llama config form)" in text and "problems: 0" in text
    other = write_synthetic(tmp_path / "small", "small")  # a target of another width and vocabulary
    assert main(["inspect", str(out), "--target", str(other)]) == 1
    text = capsys.readouterr().out
    assert "problems: 2" in text and "hidden_size is 256" in text
    assert main(["synth", "--draft", "eagle3"]) == 2
    assert "give one output directory" in capsys.readouterr().err
    assert draft_info(out)["config"]["aux_layer_ids"] == [1, 2, 3]
