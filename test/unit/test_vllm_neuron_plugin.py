"""The vLLM Neuron model's registration: only under vLLM Neuron 1.x (recognised by its files, never imported), by
name in vLLM's ModelRegistry for both MiniMax-M3 architectures."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from minimax_m3.vllm_neuron import plugin
from minimax_m3.vllm_neuron.contract import ARCHITECTURES
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
    assert added == dict.fromkeys(ARCHITECTURES, plugin.FACTORY)
    assert plugin.models() == dict.fromkeys(ARCHITECTURES, MiniMaxM3ForCausalLM)


def test_leaves_vllm_alone_without_it(tmp_path, monkeypatch):
    _plugin_tree(tmp_path, monkeypatch, one_x=False)  # vllm-neuron 0.4.x: the NxDI line, served elsewhere
    added = _fake_vllm(monkeypatch)
    plugin.register()
    assert added == {}
