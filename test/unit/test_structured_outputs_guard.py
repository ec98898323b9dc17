"""The structured-outputs rule of the vllm-neuron 0.4.1 path (``neuron/vllm/structured.py``): which build samples on
device (so vLLM's grammar would be ignored there) and what a request then gets. The end-to-end checks through
``vllm serve`` are in ``test/vllm/test_agentic_serve.py``; this one needs no vLLM.

Oracle: vllm-neuron 0.4.1's rules as read (``_get_default_neuron_config``: on-device sampling unless overridden; a
precompiled artifact's neuron_config.json wins over the override), written out case by case."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from minimax_m3.neuron.vllm import structured


@pytest.mark.parametrize("additional,artifact,want", [
    (None, None, True),  # vllm-neuron's default
    ({"override_neuron_config": {"tp_degree": 2}}, None, True),
    ({"override_neuron_config": {"on_device_sampling_config": None}}, None, False),
    ({"override_neuron_config": {"on_device_sampling_config": {"dynamic": True}}}, None, True),
    ({"override_neuron_config": {"on_device_sampling_config": None}}, {"dynamic": True}, True),  # artifact wins
    ({}, "host", False),
])
def test_which_build_samples_on_device(tmp_path, additional, artifact, want):
    art = None
    if artifact is not None:
        art = tmp_path / "art"
        art.mkdir()
        ods = None if artifact == "host" else artifact
        (art / "neuron_config.json").write_text(json.dumps({"neuron_config": {"on_device_sampling_config": ods}}))
    assert structured.samples_on_device(additional, str(art) if art else None) is want


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.delenv("NEURON_COMPILED_ARTIFACTS", raising=False)
    monkeypatch.setattr(structured, "_refusal", None)
    return structured.StructuredOutputGuard


def _params(so):
    return SimpleNamespace(structured_outputs=so)


def _vllm_config(additional, procs=None):
    return SimpleNamespace(additional_config=additional, model_config=SimpleNamespace(logits_processors=procs))


def test_the_guard_is_inert_until_an_m3_build_is_installed(guard):
    guard.validate_params(_params({"json": {}}))  # nothing recorded: nothing refused


def test_install_adds_the_guard_once_beside_the_users_processors():
    cfg = _vllm_config({}, ["user.mod:Proc"])
    structured.install(cfg)
    structured.install(cfg)
    assert cfg.model_config.logits_processors == ["user.mod:Proc", structured.GUARD]
    module, name = structured.GUARD.split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is structured.StructuredOutputGuard


def test_an_on_device_build_refuses_a_grammar_naming_the_fix(guard):
    structured.install(_vllm_config({}))
    guard.validate_params(_params(None))  # no grammar: served
    with pytest.raises(ValueError, match=r"samples on device.*compile --for-vllm --structured-outputs"):
        guard.validate_params(_params({"json": {}}))


def test_a_host_sampling_build_serves_a_grammar(guard):
    structured.install(_vllm_config({"override_neuron_config": structured.HOST_SAMPLING}))
    guard.validate_params(_params({"json": {}}))
    assert structured.StructuredOutputGuard().apply("logits") == "logits"  # it never changes logits
