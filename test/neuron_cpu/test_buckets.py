"""Context-encoding buckets that fit the request, checked through NxDI's own bucket selection
(``ModelWrapper.get_target_bucket``) on the tensors the engine really passes, without running a model; and static
batching (``continuous_batching=False``) run in NxDI's CPU mode against the reference engine."""

from types import SimpleNamespace

import pytest
import torch

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
TOL = 1e-4  # float32 end to end, as test_port_cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("buckets") / "tiny", M3Config.preset("tiny"), seed=0))


def _engine_calls(ckpt, **fields):
    """A NeuronEngine over an unloaded NxDI application whose forward only records its keyword arguments."""
    from minimax_m3.neuron.build import application, inference_config
    from minimax_m3.neuron.provider import NeuronEngine

    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, "neuron", tp=1, ep=1, lnc=1, **fields)  # the device layout, never run
    config = inference_config(spec, m3, save_sharded_checkpoint=False, attn_kernel_enabled=False)
    app = application(ckpt, config)
    calls = []

    def forward(**inputs):
        calls.append(inputs)
        return SimpleNamespace(logits=torch.zeros(inputs["input_ids"].shape[0], 1, config.vocab_size))

    app.forward = forward
    return NeuronEngine(app, m3, spec), app, calls


def _bucket(app, inputs) -> int:
    args = [inputs[k] for k in ("input_ids", "attention_mask", "position_ids", "seq_ids")]
    return app.context_encoding_model.get_target_bucket(*args)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_100_token_prompt_runs_the_smallest_bucket_of_a_build_up_to_8k(ckpt, batch):
    eng, app, calls = _engine_calls(ckpt, max_batch=batch, max_seq_len=8192)
    assert app.context_encoding_model.neuron_config.buckets == [128, 256, 512, 1024, 2048, 4096, 8192]
    eng.generate([random_ids(100, seed=1)], GenerationConfig(max_new_tokens=1))
    assert len(calls) == 1 and calls[0]["input_ids"].shape == (1, 100)
    assert _bucket(app, calls[0]) == 128


def test_static_batch_pads_to_the_bucket_of_its_longest_prompt(ckpt):
    eng, app, calls = _engine_calls(ckpt, max_batch=3, max_seq_len=8192, continuous_batching=False)
    eng.generate([random_ids(100, seed=1), random_ids(300, seed=2)], GenerationConfig(max_new_tokens=1))
    assert len(calls) == 1 and calls[0]["input_ids"].shape == (3, 300)
    assert _bucket(app, calls[0]) == 512


def test_buckets_are_overridable_and_the_context_length_is_the_last(ckpt):
    _, app, _ = _engine_calls(ckpt, max_seq_len=3008)
    assert app.context_encoding_model.neuron_config.buckets == [128, 256, 512, 1024, 2048, 3008]
    _, app, _ = _engine_calls(ckpt, max_seq_len=3008, context_buckets=(1000, 3008))
    assert app.context_encoding_model.neuron_config.buckets == [1000, 3008]


def test_static_batching_matches_reference(ckpt):
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    prompts = [random_ids(70, seed=41), random_ids(9, seed=42), random_ids(33, seed=43)]
    port = load_engine(ckpt, backend="neuron-cpu", **neuron_cpu_engine_kwargs(
        batch_size=2, max_seq_len=96, max_context_length=80, continuous_batching=False))
    ref = ReferenceEngine.from_pretrained(ckpt, device="cpu", dtype="float32", max_seq_len=256)
    assert not port.app.neuron_config.is_continuous_batching and port.app.neuron_config.ctx_batch_size == 2
    gen = GenerationConfig(max_new_tokens=4, return_logits=True)
    for g, w in zip(port.generate(prompts, gen), ref.generate(prompts, gen)):
        assert g.tokens == w.tokens
        assert (g.step_logits - w.step_logits).abs().max() <= TOL
    for g, w in zip(port.prefill_logits(prompts), ref.prefill_logits(prompts)):
        assert (g - w).abs().max() <= TOL
