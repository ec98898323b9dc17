"""The vLLM Neuron model's registration: only under vLLM Neuron 1.x (recognised by its files, never imported), by
name in vLLM's ModelRegistry for both MiniMax-M3 architectures and the EAGLE3 draft (under the name the plugin's
proposer looks up: ``Eagle3`` + the draft checkpoint's ``LlamaForCausalLMEagle3``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from minimax_m3.vllm_neuron import plugin
from minimax_m3.config.draft import DraftConfig
from minimax_m3.vllm_neuron.contract import ARCHITECTURES
from minimax_m3.vllm_neuron.eagle3 import MiniMaxM3Eagle3Draft
from minimax_m3.vllm_neuron.model import MiniMaxM3ForCausalLM


def _fake_vllm(monkeypatch):
    added = {}
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(
        ModelRegistry=SimpleNamespace(register_model=lambda arch, cls: added.__setitem__(arch, cls))))
    return added


def _plugin_tree(tmp_path, monkeypatch, one_x: bool):
    pkg = tmp_path / "vllm_neuron"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the plugin must not be imported to be recognised')\n")
    if one_x:
        (pkg / "model" / "kv_cache.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm_neuron", raising=False)


def test_registers_both_architectures_under_the_1x_plugin(tmp_path, monkeypatch):
    _plugin_tree(tmp_path, monkeypatch, one_x=True)
    added = _fake_vllm(monkeypatch)
    plugin.register()
    assert added == {**dict.fromkeys(ARCHITECTURES, plugin.FACTORY), plugin.DRAFT_ARCHITECTURE: plugin.DRAFT_FACTORY}
    assert plugin.models() == {**dict.fromkeys(ARCHITECTURES, MiniMaxM3ForCausalLM),
                               plugin.DRAFT_ARCHITECTURE: MiniMaxM3Eagle3Draft}


def test_the_draft_name_is_the_proposers_lookup_of_this_packages_drafts():
    """The plugin's ``EagleProposer`` (ed3580d) prefixes ``Eagle3`` to an architecture that does not start with it;
    this package's drafts are written (and read) as ``LlamaForCausalLMEagle3``."""
    (arch,) = DraftConfig(hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8, intermediate_size=16, vocab_size=32,
                          draft_vocab_size=16, target_hidden_size=8).to_dict()["architectures"]
    assert plugin.DRAFT_ARCHITECTURE == (arch if arch.startswith("Eagle3") else f"Eagle3{arch}")


def test_leaves_vllm_alone_without_it(tmp_path, monkeypatch):
    _plugin_tree(tmp_path, monkeypatch, one_x=False)  # vllm-neuron 0.4.x: the NxDI line, served elsewhere
    added = _fake_vllm(monkeypatch)
    plugin.register()
    assert added == {}


def test_a_dcp_size_that_splits_no_kv_head_names_the_sizes_that_do():
    """``decode_context_parallel_size`` must divide the ranks that hold one KV head (M3: 64 / 4 = 16 at TP 64): a
    size that does not, or a draft beside a DCP group, fails at start-up with one error naming what works."""
    import pytest

    from minimax_m3.config import M3Config
    from minimax_m3.errors import ServingError
    from minimax_m3.vllm_neuron.contract import Layout, check_serving, dcp_problems

    c = M3Config.preset("tiny")  # 2 KV heads
    assert dcp_problems(c, Layout(world=8, dcp=4)) == []
    assert dcp_problems(c, Layout(world=64, dcp=1, speculative=True)) == []
    (p,) = dcp_problems(c, Layout(world=8, dcp=3))
    assert "4 rank(s) hold each of the 2 KV heads" in p and "[1, 2, 4]" in p
    with pytest.raises(ServingError) as e:
        check_serving(c, SimpleNamespace(architectures=[ARCHITECTURES[0]]),
                      Layout(world=8, dcp=8, speculative=True, dtype=__import__("torch").float32))
    assert "use one of [1, 2, 4]" in str(e.value) and "EAGLE3 draft's pages" in str(e.value)
