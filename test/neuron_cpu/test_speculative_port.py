"""Speculative decoding on the Neuron port (issue 24) in NxDI's CPU mode, at this process's TP (1, or torchrun's 2:
the one KV head's caches then split over G = 2 ranks): a build with a draft has NxDI's context-encoding and
speculation graphs (``speculation_length = k + 1``); every verify step is one call of the speculation graph for all
cache rows, each row at its own position, on the sharded caches, with sparse selection active.

Oracles: the reference engine in **float64** (graded against transformers in the project's own suite) for the verify
logits at arbitrary positions and the plain greedy tokens; the reference model's ``hidden_at`` states for the target
states the port returns; a drafter that agrees with the target on a built pattern for the acceptance length; with
on-device sampling, the same build without a draft (plain on-device decoding, greedy and seeded). Bound: 2e-5, or where
float32 itself cannot reach it, 1.5x the float32 reference's own distance from the golden on the same inputs (as
``test_sharded_caches``). """

import copy

import pytest
import torch

from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
TOL, FLOOR = 2e-5, 1.5
K = 3  # drafts per step: speculation_length 4
SLOTS, SEQ, CHUNK, CONTEXT = 2, 192, 32, 128
PROMPTS = [random_ids(70, seed=51), random_ids(37, seed=52), random_ids(45, seed=53)]
NEW = 24  # the 37-token prompt decodes across the 48 and 64 block boundaries; selection active past 48


def _tp() -> int:
    from test.support.neuron.cpu_plugin import world_size

    return world_size()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs, tiny_target_and_draft

    config, ck, draft = tiny_target_and_draft(tmp_path_factory.mktemp("spec"))
    port = load_engine(str(ck), backend="neuron-cpu", **neuron_cpu_engine_kwargs(
        batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT, prefill_chunk=CHUNK, draft=str(draft),
        num_speculative_tokens=K))
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    golden = ReferenceEngine(copy.deepcopy(ref.model).double(), max_seq_len=256, max_batch_size=SLOTS)
    return port, ref, golden, draft


def _bound(ref_err: float) -> float:
    return max(TOL, FLOOR * ref_err)


def _err(got, want) -> float:
    return max((g.double() - w).abs().max().item() for g, w in zip(got, want))


def test_a_draft_build_has_the_speculation_graph_on_sharded_caches(engines):
    port = engines[0]
    app = port.app
    assert app.neuron_config.speculation_length == K + 1 and not hasattr(app, "token_generation_model")
    assert app.config.kv_layout == "sharded" and app.config.num_cores_per_group == _tp()
    assert app.speculation_model.model.kv_mgr.kv_lines(0)[0].shape[2] == SEQ // _tp()
    assert port.provider.max_seq_len == SEQ - K and port.provider.speculative_tokens == K
    # scoring before any generation (a speculating engine's prefill calls keep the draft's states)
    assert port.prefill_logits([PROMPTS[1]])[0].shape[0] == len(PROMPTS[1])


def test_verify_logits_at_each_rows_own_position(engines):
    """Two rows at different positions (one across an index-block boundary, both with blocks dropped), k + 1 tokens
    each, then a second verify after accepting one draft: the slots the first call wrote past the accepted prefix
    are rewritten before they are read."""
    port, ref, golden, _ = engines
    p = port.provider
    p.start(GenerationConfig())
    p.prefill([PROMPTS[0]], [0])
    p.prefill([PROMPTS[2]], [1])
    first = [random_ids(K + 1, seed=61), random_ids(K + 1, seed=62)]
    pos = [len(PROMPTS[0]), len(PROMPTS[2])]
    got = p.verify([0, 1], first, pos)
    seqs = [PROMPTS[0] + first[0], PROMPTS[2] + first[1]]
    want = [w[n:] for w, n in zip(golden.prefill_logits(seqs), pos)]
    ref32 = [w[n:] for w, n in zip(ref.prefill_logits(seqs), pos)]
    # accept one draft in each row: the next verify starts two positions on
    second = [random_ids(K + 1, seed=63), random_ids(K + 1, seed=64)]
    pos2 = [n + 2 for n in pos]
    got2 = p.verify([0, 1], second, pos2)
    seqs2 = [s[:n] + t for s, n, t in zip(seqs, pos2, second)]
    want2 = [w[n:] for w, n in zip(golden.prefill_logits(seqs2), pos2)]
    ref2 = [w[n:] for w, n in zip(ref.prefill_logits(seqs2), pos2)]
    diff, ref_err = _err(got + got2, want + want2), _err(ref32 + ref2, want + want2)
    print(f"\nverify steps, TP {_tp()}: max |port - golden64| {diff:.2e} (float32 reference: {ref_err:.2e})")
    assert [g.shape for g in got + got2] == [w.shape for w in want + want2]
    assert diff <= _bound(ref_err)


def test_target_states_are_the_residual_streams_the_draft_reads(engines):
    port, _, golden, _ = engines
    layers = port.provider.drafter.aux_layers
    assert port.app.config.aux_hidden_layers == layers
    ids = PROMPTS[1]
    out = port.app(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                   position_ids=torch.arange(len(ids)).unsqueeze(0), seq_ids=torch.tensor([0]))
    model = golden.model
    x, pos = torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)
    _, states = model(x, pos, model.new_cache(1, 128), len(ids), decode=False, hidden_at=layers)
    got = out.aux_states[0, :len(ids)].double()
    scale = states.abs().max().item()
    diff = (got - states[0]).abs().max().item()
    print(f"\ntarget states, TP {_tp()}: max |port - golden64| {diff:.2e} (largest state {scale:.1f})")
    assert got.shape == states[0].shape and diff <= 1e-5 * max(1.0, scale)


def test_drafted_greedy_is_plain_greedy_with_staggered_admissions(engines):
    """The synthetic EAGLE3 draft (random weights: it rarely agrees) through the one loop, three prompts in two
    slots, the first ending early so a slot is re-admitted while the other row is mid-decode."""
    port, _, golden, _ = engines
    plain = golden.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=NEW))[0].tokens
    gen = GenerationConfig(max_new_tokens=NEW, eos_token_ids=(plain[4],))
    got, want = port.generate(PROMPTS, gen), golden.generate(PROMPTS, gen)
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in want]
    assert all(g.timings["spec_steps"] > 0 for g in got)


def test_measured_acceptance_equals_the_constructed_one(engines):
    """A drafter agreeing with the target's own greedy continuation on a built pattern: each verify step accepts
    the constructed number of drafts, so tokens per verify step is known in advance; the output stays plain greedy."""
    from minimax_m3.reference.speculative import ScriptedDrafter, acceptance_blocks

    port, _, golden, _ = engines
    prompts = PROMPTS[1:]
    gen = GenerationConfig(max_new_tokens=NEW)
    plain = [w.tokens for w in golden.generate(prompts, gen)]
    steps = [0, 3, 1, 2, 3, 0, 3, 2]  # accepted drafts per verify step: (1+4+2+3+4+1+4+3) = 22 tokens after the 1st
    agree = acceptance_blocks(steps, K)
    provider = port.provider
    saved = provider.drafter
    provider.drafter = ScriptedDrafter(plain, agree, port.config.vocab_size)
    try:
        got = port.generate(prompts, GenerationConfig(max_new_tokens=1 + sum(a + 1 for a in steps)))
    finally:
        provider.drafter = saved
    assert [g.tokens for g in got] == [w[:len(g.tokens)] for g, w in zip(got, plain)]
    for g in got:
        t = g.timings
        assert t["spec_steps"] == len(steps) and t["accepted_tokens"] == sum(steps)
        assert abs(t["acceptance_length"] - (1 + sum(steps) / len(steps))) < 1e-9


def test_seeded_sampling_is_the_references_alone_and_in_a_batch(engines):
    """Speculative sampling with a seed: a sequence's tokens depend on its seed and its own positions only, so they
    are the same alone, again, and beside another prompt, and equal to the float64 reference speculating with the
    same draft."""
    from minimax_m3.reference.eagle3 import load_host_drafter
    from minimax_m3.reference.engine import ReferenceEngine

    port, _, golden, draft = engines
    gen = GenerationConfig(max_new_tokens=12, temperature=0.8, top_k=20, seed=7)
    alone = port.generate([PROMPTS[1]], gen)[0]
    again = port.generate([PROMPTS[1]], gen)[0].tokens
    batched = port.generate([PROMPTS[0], PROMPTS[1]], gen)[1].tokens
    model = golden.model
    drafter = load_host_drafter(draft, port.app.config._name_or_path, model.config)  # whole tables under torchrun
    oracle = ReferenceEngine(model, max_seq_len=256, max_batch_size=1, drafter=drafter,
                             speculative_tokens=K).generate([PROMPTS[1]], gen)[0].tokens
    assert alone.tokens == again == batched == oracle and alone.timings["spec_steps"] > 0


@pytest.fixture(scope="module")
def sampling_engines(engines, tmp_path_factory):
    """On-device sampling: a build with the draft and one without, over the same checkpoint."""
    from minimax_m3.load import load_engine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    port, _, _, draft = engines
    kw = neuron_cpu_engine_kwargs(batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT, prefill_chunk=CHUNK,
                                  on_device_sampling=True)
    ck = port.app.config._name_or_path
    spec = load_engine(ck, backend="neuron-cpu", draft=str(draft), num_speculative_tokens=K, **kw)
    plain = load_engine(ck, backend="neuron-cpu", **kw)
    return spec, plain


def test_on_device_sampling_drafted_equals_plain_on_device_sampling(sampling_engines):
    """The verify step draws the target's token after every position on the device (each at its own position's
    seeded draw); drafts are kept while they equal those draws, so a sequence's tokens are plain on-device decoding's,
    token for token, greedy and sampled, alone and in a batch with staggered admissions."""
    spec, plain = sampling_engines
    for gen in (GenerationConfig(max_new_tokens=16),
                GenerationConfig(max_new_tokens=16, temperature=0.8, top_k=20, seed=11)):
        want = plain.generate(PROMPTS, gen)
        got = spec.generate(PROMPTS, gen)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert all(g.timings["spec_steps"] > 0 for g in got)
        alone = spec.generate([PROMPTS[1]], gen)[0].tokens
        assert alone == want[1].tokens
