"""The reference backend prefills long prompts in calls of ``prefill_chunk`` tokens (issue 23), each call attending to
the cache the earlier calls wrote plus itself.

Oracles: the same engine prefilling each prompt in one call (float32 logits within 5e-5: a later call sums its prior
and its own keys' attention in two products, the one call in one; measured 1.7e-5 at 100 tokens), and transformers'
MiniMax-M3 (``hf_tiny``, tolerance of test_reference_vs_transformers). The tiny preset has 16-token blocks and keeps
2: with 32-token calls a 160-token prompt takes 5 calls and the indexer drops blocks from the third call on.
"""

import pytest
import torch

from minimax_m3 import GenerationConfig
from minimax_m3.errors import M3Error
from minimax_m3.reference.engine import ReferenceEngine
from test.conftest import random_ids
from test.integration.test_reference_vs_transformers import F32_TOL, hf_greedy, hf_logits

TOL = 5e-5
CHUNK = 32


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """The one-call engine (the spec's default chunk) and the chunked one, through ``EngineSpec.prefill_chunk``."""
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.load import load_engine

    def load(**kw):
        return load_engine(EngineSpec(str(tiny_ckpt), device="cpu", dtype="float32", max_seq_len=1024, **kw))

    return load(), load(prefill_chunk=CHUNK)


def test_the_call_size_comes_from_the_spec(engines):
    one, chunked = engines
    assert one.spec.prefill_chunk == one.provider.prefill_chunk == 8192  # default: ops.call_tokens, whole blocks
    assert one.provider.prefill_chunk % one.config.index_block_size == 0
    assert chunked.spec.prefill_chunk == chunked.provider.prefill_chunk == CHUNK


@pytest.mark.parametrize("length", [100, 160])
def test_chunked_prefill_logits_equal_one_call_and_transformers(engines, hf_tiny, length, monkeypatch):
    one, chunked = engines
    c = chunked.config
    assert length >= 3 * CHUNK and length > c.index_topk * c.index_block_size  # >= 3 calls, sparse selection active
    ids = random_ids(length, seed=100 + length)
    calls, forward = [], chunked.model.forward

    def counted(x, *args, **kwargs):
        calls.append(x.shape[1])
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(chunked.model, "forward", counted)
    got = chunked.prefill_logits([ids])[0]
    assert calls == [CHUNK] * (length // CHUNK) + [length % CHUNK] * bool(length % CHUNK)
    want = one.prefill_logits([ids])[0]
    assert (got - want).abs().max().item() <= TOL
    oracle = hf_logits(hf_tiny, ids)
    assert (got - oracle).abs().max().item() <= F32_TOL
    assert torch.equal(got.argmax(-1), oracle.argmax(-1))


def test_batch_of_ragged_prompts_then_decode(engines, hf_tiny):
    """Rows whose last token falls in different calls (right padding), then greedy decode across a block boundary:
    tokens and logits equal the one-call engine's, and transformers' for each prompt alone."""
    one, chunked = engines
    prompts = [random_ids(150, seed=3), random_ids(70, seed=4), random_ids(97, seed=5)]
    gen = GenerationConfig(max_new_tokens=12, return_logits=True)
    got, want = chunked.generate(prompts, gen), one.generate(prompts, gen)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert (g.step_logits - w.step_logits).abs().max().item() <= TOL
    hf_tokens, hf_step = hf_greedy(hf_tiny, prompts[0], 12)
    assert got[0].tokens == hf_tokens
    assert (got[0].step_logits - hf_step).abs().max().item() <= F32_TOL


def test_a_call_size_the_layout_cannot_use_names_the_sizes_that_work(tiny_ckpt, engines):
    _, chunked = engines
    with pytest.raises(M3Error, match=r"multiple of 16.*\[32, 48\]: set --prefill-chunk"):
        ReferenceEngine(chunked.model, prefill_chunk=40)  # refused by the spec, before any prefill
