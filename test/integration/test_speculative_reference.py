"""Speculative decoding on the reference backend (tiny synthetic target, float32, prompts of 70-150 tokens: at 16-token
blocks keeping 2, sparse selection is active past 48 tokens).

Oracles: plain greedy decoding (drafted greedy must equal it token for token, with any draft); transformers'
``output_hidden_states`` (the target states an EAGLE3 draft reads, vLLM's indexing); a drafter built to agree with the
target on a known pattern (the measured acceptance length must be the constructed one); the same sequence alone and in
a batch (seeded sampling)."""

import random

import pytest
import torch

from minimax_m3 import GenerationConfig
from minimax_m3.checkpoint.draft import write_synthetic_draft
from minimax_m3.config import M3Config
from minimax_m3.engine import EngineSpec
from minimax_m3.load import load_engine
from minimax_m3.reference.engine import ReferenceEngine
from minimax_m3.reference.speculative import ScriptedDrafter, acceptance_blocks, row_cache
from test.conftest import random_ids

PROMPTS = [random_ids(150, seed=21), random_ids(70, seed=22)]
NEW = 40


@pytest.fixture(scope="module")
def draft_dir(tiny_ckpt, tmp_path_factory):
    return write_synthetic_draft(tmp_path_factory.mktemp("eagle3") / "draft", M3Config.from_pretrained(tiny_ckpt))


@pytest.fixture(scope="module")
def spec_engine(tiny_ckpt, draft_dir):
    return load_engine(EngineSpec(model=str(tiny_ckpt), device="cpu", dtype="float32", max_seq_len=1024,
                                  draft=str(draft_dir)))


@pytest.fixture(scope="module")
def plain(ref_engine):
    return ref_engine.generate(PROMPTS, GenerationConfig(max_new_tokens=NEW, return_logits=True))


def test_the_hook_returns_transformers_hidden_states_and_leaves_the_logits(ref_engine, hf_tiny):
    """``hidden_at=(j, ...)``: the residual stream entering layer j, as transformers' ``hidden_states[j]`` (its
    tuple starts with the embeddings: vLLM's and NxDI's indexing); the logits are bit-equal to the plain forward."""
    model, ids = ref_engine.model, PROMPTS[1]
    x = torch.tensor([ids])
    pos = torch.arange(len(ids)).unsqueeze(0)
    plain = model(x, pos, model.new_cache(1, 128), len(ids), decode=False)
    logits, states = model(x, pos, model.new_cache(1, 128), len(ids), decode=False, hidden_at=(3, 1, 2))
    assert torch.equal(plain, logits)
    with torch.no_grad():
        hs = hf_tiny(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    for n, j in enumerate((1, 2, 3)):  # ascending, whatever order they were asked in
        assert (states[0, :, n * h:(n + 1) * h] - hs[j][0]).abs().max() < 2e-4


def test_stale_entries_past_the_position_are_never_read(ref_engine):
    """A verify over a cache whose slots past the verified tokens hold garbage (as rejected drafts leave them)
    gives the same logits as over a clean cache: every read is causal (attention, indexer, sparse blocks)."""
    model, p = ref_engine.model, PROMPTS[0]
    n = len(p)
    outs = []
    for poison in (False, True):
        cache = model.new_cache(2, 256)
        model(torch.tensor([p, p]), torch.arange(n).expand(2, n), cache, n, decode=False)
        if poison:
            g = torch.Generator().manual_seed(0)
            for t in cache.k + cache.v + list(cache.index_k.values()):
                seq = 2 if t.dim() == 4 else 1
                garbage = torch.randn(t.narrow(seq, n + 4, t.shape[seq] - n - 4).shape, generator=g) * 50
                t.narrow(seq, n + 4, t.shape[seq] - n - 4).copy_(garbage)
        toks = torch.tensor([[5, 6, 7, 8]])
        outs.append(model(toks, torch.arange(n, n + 4).unsqueeze(0), row_cache(cache, 1), n + 4, decode=False))
    assert torch.equal(outs[0], outs[1])


def test_drafted_greedy_is_plain_greedy_with_the_eagle3_draft(spec_engine, plain):
    """The synthetic EAGLE3 draft (random weights: it is nearly always wrong, so nearly every step rejects and the
    next verify overwrites the rejected entries) changes no token, alone or batched."""
    for p, ref in ((PROMPTS, plain), (PROMPTS[1:], plain[1:])):  # batched, then alone
        got = spec_engine.generate(p, GenerationConfig(max_new_tokens=NEW, return_logits=True))
        for g, r in zip(got, ref):
            assert g.tokens == r.tokens
            assert (g.step_logits - r.step_logits).abs().max() < 1e-4
            t = g.timings
            assert t["spec_steps"] == len(t["decode_step_s"]) and t["draft_tokens"] >= t["accepted_tokens"] >= 0
            assert t["acceptance_length"] == (t["spec_steps"] + t["accepted_tokens"]) / t["spec_steps"]


@pytest.mark.parametrize("accepted,expected", [([0, 0, 0, 0, 1, 1, 2, 3], 1.875), ([3], 4.0)])
def test_measured_acceptance_equals_the_constructed(ref_engine, plain, accepted, expected):
    """A drafter agreeing with the target on a pattern built so that the verify steps accept 0, 0, 0, 0, 1, 1, 2, 3
    drafts (k = 3; the acceptance of an i.i.d. agreement rate 1/2: sum_i 0.5^i = 1.875 tokens per verify step), in
    a shuffled order repeated 3 times, or every draft (4 per step): measured == constructed, and the tokens are
    plain greedy's."""
    steps = accepted * (24 // len(accepted))
    random.Random(0).shuffle(steps)
    agree = acceptance_blocks(steps, 3)
    new = len(agree)  # the prefill's token, then a + 1 tokens per step
    cont = [r.tokens for r in ref_engine.generate(PROMPTS, GenerationConfig(max_new_tokens=new))]
    eng = ReferenceEngine(ref_engine.model, max_seq_len=1024, drafter=ScriptedDrafter(cont, agree, 512),
                          speculative_tokens=3)
    res = eng.generate(PROMPTS, GenerationConfig(max_new_tokens=new))
    for r, c in zip(res, cont):
        assert r.tokens == c
        t = r.timings
        assert t["spec_steps"] == len(steps) and abs(t["acceptance_length"] - expected) <= 0.05
        assert abs(t["acceptance_length"] - sum(a + 1 for a in steps) / len(steps)) < 1e-12
    assert plain[0].tokens[:NEW] == cont[0][:NEW]


def test_seeded_sampling_alone_and_in_a_batch(spec_engine):
    gen = GenerationConfig(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    batch = spec_engine.generate(PROMPTS, gen)
    alone = spec_engine.generate(PROMPTS[1:], gen)[0]
    assert batch[1].tokens == alone.tokens
    assert spec_engine.generate(PROMPTS[1:], gen)[0].tokens == alone.tokens
    other = spec_engine.generate(PROMPTS[1:], GenerationConfig(max_new_tokens=24, temperature=1.0, top_k=50,
                                                               top_p=0.95, seed=99))[0]
    assert other.tokens != alone.tokens
