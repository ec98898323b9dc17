"""``compile --for-vllm``'s own rules, without NxDI or vLLM (the configs themselves:
``test/vllm/test_compile_for_vllm.py``)."""

import json

import pytest

from minimax_m3.neuron.vllm.artifact import serving_problems
from minimax_m3.engine.spec import EngineSpec, SpecError


def _spec(**kw):
    base = dict(model="m", backend="neuron", max_seq_len=8192, max_batch=8, tp=64, ep=64, lnc=2, all_logits=False)
    return EngineSpec(**{**base, **kw}).resolve()


def test_a_serving_spec_has_no_problem():
    assert serving_problems(_spec()) == []
    assert serving_problems(_spec(max_batch=1)) == []
    assert serving_problems(_spec(draft="d", fused_speculation=True, on_device_sampling=True)) == []  # fused


def test_what_vllm_neuron_would_build_differently_is_named_by_option():
    got = serving_problems(_spec(all_logits=True, continuous_batching=False, max_context_len=4096, draft="d"))
    assert len(got) == 4
    for option, text in zip(("--all-logits", "--continuous-batching", "--max-context-len", "--draft"), got):
        assert text.startswith(option)


def test_the_engine_refuses_an_artifact_compiled_for_vllm(tmp_path):
    spec = _spec()
    spec.write_artifact(str(tmp_path), for_vllm=True)
    assert json.loads((tmp_path / "minimax-m3-spec.json").read_text())["for_vllm"] is True
    with pytest.raises(SpecError) as e:
        spec.check_artifact(str(tmp_path))
    assert "--for-vllm" in str(e.value) and "vllm serve" in str(e.value)
    spec.write_artifact(str(tmp_path))  # the engine's own record is accepted
    spec.check_artifact(str(tmp_path))


def test_the_serving_spec_lists_every_problem_at_once():
    from minimax_m3.neuron.vllm.artifact import vllm_spec

    spec = EngineSpec(model="m", backend="neuron", max_seq_len=8192, max_batch=8, tp=64, ep=3, all_logits=True)
    with pytest.raises(SpecError) as e:
        vllm_spec(spec, None)
    text = str(e.value)
    assert "--all-logits" in text and "ep" in text  # a spec rule and a serving rule in one error
