"""Prefill of a serving build (NxDI's last-token pick inside the graph, no all-position logits) with the inputs
vllm-neuron builds: one prompt per call, ``attention_mask=None``, ``position_ids = arange(len)``, the request's
cache row in ``seq_ids``. NxDI pads ``position_ids`` with 1 up to the bucket and picks the last real token by the
maximum position, so stock NxDI answers a one-token prompt with a padding slot's logits; graded here against the
reference engine (float32), for one-token prompts and longer ones, and through the project's own engine.

One NxDI model per file (TP 2 and 4 rerun this folder under torchrun)."""

import pytest
import torch

from minimax_m3.config import M3Config
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
TOL = 1e-4  # float32 end to end, as test_port_cpu
SLOTS = 2


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The NxDI application itself (the object vllm-neuron drives), in CPU mode, and the reference engine."""
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.neuron.nxd_compat import to_cpu as _to_cpu
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import nxdi_spec

    ck = str(write_synthetic(tmp_path_factory.mktemp("one") / "tiny", M3Config.preset("tiny"), seed=0))
    spec, m3 = nxdi_spec(ck, max_batch=SLOTS, max_seq_len=64, max_context_len=32, context_buckets=(16, 32))
    app = NeuronMiniMaxM3ForCausalLM(ck, inference_config(spec, m3))
    _to_cpu(app)
    return app, ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=64)


@torch.no_grad()
def _prefill(app, prompt, row):
    """One prefill exactly as vllm-neuron calls the application (no attention mask; positions 0..n-1)."""
    n = len(prompt)
    out = app(input_ids=torch.tensor([prompt]), attention_mask=None, position_ids=torch.arange(n).view(1, -1),
              seq_ids=torch.tensor([row]))
    return out.logits[0, -1].float()


@pytest.mark.parametrize("n", [1, 2, 9, 16])
def test_vllm_style_prefill_returns_the_last_prompt_tokens_logits(engines, n):
    app, ref = engines
    assert not app.neuron_config.prefill_all_logits  # the graph picks the last token itself
    app.reset()
    prompt = random_ids(n, seed=60 + n)
    got, want = _prefill(app, prompt, row=1), ref.prefill_logits([prompt])[0][-1]
    assert got.shape == want.shape
    assert (got - want).abs().max() <= TOL


def test_one_token_prompt_then_decode_matches_reference(engines):
    """The one-token prefill wrote its cache row: the next decode step (both rows) is graded too."""
    app, ref = engines
    app.reset()
    prompts = [random_ids(1, seed=71), random_ids(3, seed=72)]
    firsts = [int(_prefill(app, p, row=r).argmax()) for r, p in enumerate(prompts)]
    with torch.no_grad():
        out = app(input_ids=torch.tensor(firsts).view(-1, 1),
                  position_ids=torch.tensor([len(p) for p in prompts]).view(-1, 1), seq_ids=torch.arange(SLOTS))
    for r, p in enumerate(prompts):
        want = ref.prefill_logits([p + [firsts[r]]])[0]
        assert firsts[r] == int(want[-2].argmax())
        assert (out.logits[r, -1].float() - want[-1]).abs().max() <= TOL
