"""``NeuronMiniMaxM3ForCausalLM`` executed in NxDI's CPU mode against the reference engine, at this process's TP
degree (1, or torchrun's WORLD_SIZE): last-token prefill logits and cached decode steps with the indexer dropping
blocks in both, and proof that the prompt is long enough for that (a dense twin of the checkpoint differs).

The reference engine is graded against transformers' ``minimax_m3_vl`` in the project's own test suite.
"""

import pytest
import torch

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig

pytestmark = pytest.mark.neuron_cpu
TOL = 1e-4  # float32 end to end; measured ~1e-5 at TP 1, 2 and 4
STEPS = 8


def _ids(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(70, 11), _ids(23, 12), _ids(49, 13)]  # 70 tokens = 5 blocks of 16, top-2 kept


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    tiny = M3Config.preset("tiny")
    d = tmp_path_factory.mktemp("m3")
    dense = tiny.replace(index_topk=64)  # every causal block always kept: dense attention, same weights
    return write_synthetic(d / "sparse", tiny, seed=0), write_synthetic(d / "dense", dense, seed=0)


@pytest.fixture(scope="module")
def engines(ckpts):
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    port = load_engine(str(ckpts[0]), backend="neuron-cpu",
                       **neuron_cpu_engine_kwargs(batch_size=3, max_seq_len=96, max_context_length=80))
    refs = [ReferenceEngine.from_pretrained(p, device="cpu", dtype="float32", max_seq_len=256) for p in ckpts]
    return port, refs[0], refs[1]


def test_sparsity_is_active_for_these_prompts(engines):
    _, ref, dense = engines
    c = ref.config
    assert len(PROMPTS[0]) > c.index_topk * c.index_block_size
    r, d = ref.prefill_logits(PROMPTS[:2]), dense.prefill_logits(PROMPTS[:2])
    # short prompt: every block kept, the twins agree up to summation order (in this batch the sparse twin runs the
    # gathered-block path, the 70-token row drops blocks; the dense twin the masked dense path): measured 1.0e-5
    assert (r[1] - d[1]).abs().max() < 3e-5
    assert (r[0][-1] - d[0][-1]).abs().max() > 1e-2  # long prompt: the indexer dropped blocks


def test_prefill_last_token_logits(engines):
    port, ref, _ = engines
    got = port.provider.prefill(PROMPTS, list(range(len(PROMPTS))), 96)  # one slot per prompt
    want = torch.stack([x[-1] for x in ref.prefill_logits(PROMPTS)])
    assert (got - want).abs().max() <= TOL


def test_decode_steps_and_greedy_tokens(engines):
    port, ref, dense = engines
    gen = GenerationConfig(max_new_tokens=STEPS, return_logits=True)
    got, want, twin = port.generate(PROMPTS, gen), ref.generate(PROMPTS, gen), dense.generate(PROMPTS[:1], gen)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert (g.step_logits - w.step_logits).abs().max() <= TOL
    assert (twin[0].step_logits - want[0].step_logits).abs().max() > 1e-2  # decode selection matters too


def test_batch_of_one_and_padding_invariance(engines):
    port, ref, _ = engines
    gen = GenerationConfig(max_new_tokens=4, return_logits=True)
    solo = port.generate([PROMPTS[2]], gen)[0]  # two padding rows in the compiled batch of 3
    want = ref.generate([PROMPTS[2]], gen)[0]
    assert solo.tokens == want.tokens
    assert (solo.step_logits - want.step_logits).abs().max() <= TOL
