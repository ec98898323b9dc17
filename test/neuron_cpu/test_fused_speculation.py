"""NxDI's fused speculation on the Neuron port (issue 24) in NxDI's CPU mode, at this process's TP: the EAGLE3 draft
inside the graph (``neuron.eagle``: NxDI's Llama EAGLE3 draft layer with this package's draft checkpoints, a reduced
draft vocabulary folded into a full-vocabulary head), one fused call per step for every cache row (k drafts, the
target's verify on the sharded caches with sparse selection active, acceptance on the device).

Oracles: plain on-device decoding of the same checkpoint without a draft (greedy and seeded: the fused graph keeps a
draft while it equals the target's own choice, so the tokens must be the same, token for token), the float64
reference's greedy tokens, and the reference EAGLE3 draft (``reference.eagle3``, written from vLLM's layout; NxDI's
draft is AWS's own code) for the draft's proposal from the same target states. A build whose prompts are prefilled in
calls of ``CHUNK`` tokens is graded against the same oracles, and its draft cache and rolling-buffer state after a
prefill against the one-call build's (NxDI's own fused prefill, graded above)."""

import pytest
import torch

from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
K = 3  # drafts per step: speculation_length 4
SLOTS, SEQ, CONTEXT = 2, 192, 128
PROMPTS = [random_ids(70, seed=51), random_ids(37, seed=52), random_ids(45, seed=53)]
NEW = 20  # the 37-token prompt decodes across the 48 block boundary: selection active
CHUNK = 16  # the chunked build's prefill calls: the prompts take 5, 3 and 3 calls


def _tp() -> int:
    from test.support.neuron.cpu_plugin import world_size

    return world_size()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from minimax_m3.load import load_engine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs, tiny_target_and_draft

    config, ck, draft = tiny_target_and_draft(tmp_path_factory.mktemp("fused"))
    kw = neuron_cpu_engine_kwargs(batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT,
                                  prefill_chunk=CONTEXT, on_device_sampling=True)
    fused = load_engine(str(ck), backend="neuron-cpu", draft=str(draft), num_speculative_tokens=K,
                        fused_speculation=True, **kw)
    plain = load_engine(str(ck), backend="neuron-cpu", **kw)
    return fused, plain, ck, draft, config


@pytest.fixture(scope="module")
def chunked(engines):
    """The fused build of the same target and draft whose prompts are prefilled in calls of ``CHUNK`` tokens."""
    from minimax_m3.load import load_engine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    _, _, ck, draft, _ = engines
    kw = neuron_cpu_engine_kwargs(batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT,
                                  prefill_chunk=CHUNK, on_device_sampling=True)
    return load_engine(str(ck), backend="neuron-cpu", draft=str(draft), num_speculative_tokens=K,
                       fused_speculation=True, **kw)


def test_a_fused_build_has_the_draft_in_its_graphs(engines):
    fused = engines[0]
    app = fused.app
    nc = app.neuron_config
    assert nc.enable_fused_speculation and nc.is_eagle3 and nc.speculation_length == K + 1
    assert not nc.kv_cache_tiling and not hasattr(app, "token_generation_model")
    model = app.fused_spec_model.model
    assert type(model.draft_model).__name__ == "M3Eagle3DraftModel"
    assert type(model.target_model).__name__ == "NeuronMiniMaxM3Model"
    assert app.config.kv_layout == "sharded" and app.config.num_cores_per_group == _tp()
    assert fused.provider.speculative_tokens == K and fused.provider.max_seq_len == SEQ - K


def test_fused_tokens_are_plain_on_device_decodings(engines):
    """Greedy and seeded sampling, three prompts in two slots (a slot re-admitted while the other row decodes), and
    a prompt alone: the fused build's tokens are the build without a draft's, token for token; greedy ones are the
    float64 reference's."""
    import copy

    from minimax_m3.reference.engine import ReferenceEngine

    fused, plain, ck, _, _ = engines
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    golden = ReferenceEngine(copy.deepcopy(ref.model).double(), max_seq_len=256, max_batch_size=SLOTS)
    for gen in (GenerationConfig(max_new_tokens=NEW),
                GenerationConfig(max_new_tokens=NEW, temperature=0.8, top_k=20, seed=11)):
        want = plain.generate(PROMPTS, gen)
        got = fused.generate(PROMPTS, gen)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        assert all(g.timings["spec_steps"] > 0 and g.timings["draft_tokens"] == K * g.timings["spec_steps"]
                   for g in got)
        assert fused.generate([PROMPTS[1]], gen)[0].tokens == want[1].tokens
        if gen.greedy:
            assert [g.tokens for g in got] == [w.tokens for w in golden.generate(PROMPTS, gen)]
    steps = sum(g.timings["spec_steps"] for g in got)
    print(f"\nfused, TP {_tp()}: {sum(len(g.tokens) for g in got)} tokens in {steps} fused steps "
          f"(acceptance of the random synthetic draft: {[g.timings['acceptance_length'] for g in got]})")


def _expected_steps(tokens: list[int], a: int, k: int) -> tuple[int, int]:
    """(fused steps, accepted drafts) when every draft is ``a``: a step after token ``i`` keeps the leading ``a``s
    among the target's next ``k`` tokens and emits one token more, until the sequence is complete."""
    i, steps, accepted = 0, 0, 0
    while i + 1 < len(tokens):
        n = 0
        while n < k and i + 1 + n < len(tokens) and tokens[i + 1 + n] == a:
            n += 1
        steps, accepted, i = steps + 1, accepted + n, i + n + 1
    return steps, accepted


@pytest.fixture(scope="module")
def two_token(engines, tmp_path_factory):
    """A target whose greedy token is ``A`` or ``B`` by the sign of one coordinate of its final state (its final
    norm keeps that coordinate only, its lm_head reads it with +c for A and -c for B; of the first 8 coordinates the
    one whose sign splits the reference's tokens most evenly), and a draft whose vocabulary
    is ``A`` alone (``d2t``): every draft is ``A``, so how many a step keeps is known from the plain tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    from minimax_m3.checkpoint.draft import synthetic_config, write_synthetic_draft
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    _, _, ck, _, config = engines
    root = tmp_path_factory.mktemp("two")
    draft = write_synthetic_draft(root / "draft", config, seed=2, config=synthetic_config(config, draft_vocab=1))
    a = int(load_file(str(draft / "model.safetensors"))["d2t"][0])
    b = (a + 1) % config.vocab_size
    target = root / "target"
    shutil.copytree(ck, target)

    def read_coordinate(d: int) -> None:
        for f in target.glob("*.safetensors"):
            t = load_file(str(f))
            if "language_model.lm_head.weight" in t:
                norm = torch.full_like(t["language_model.model.norm.weight"], -1.0)  # Gemma: scale 1 + w
                norm[d] = 0.0
                head = torch.zeros_like(t["language_model.lm_head.weight"])
                head[a, d], head[b, d] = 8.0, -8.0
                t["language_model.model.norm.weight"], t["language_model.lm_head.weight"] = norm, head
                save_file(t, str(f), metadata={"format": "pt"})

    def balance(d: int) -> float:  # how evenly the reference's greedy tokens split between A and B
        read_coordinate(d)
        ref = ReferenceEngine.from_pretrained(target, device="cpu", dtype="float32", max_seq_len=256)
        toks = [t for r in ref.generate(PROMPTS, GenerationConfig(max_new_tokens=NEW)) for t in r.tokens]
        return min(toks.count(a), toks.count(b)) / len(toks)

    read_coordinate(max(range(8), key=balance))
    kw = neuron_cpu_engine_kwargs(batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT,
                                  prefill_chunk=CONTEXT, on_device_sampling=True)
    fused = load_engine(str(target), backend="neuron-cpu", draft=str(draft), num_speculative_tokens=K,
                        fused_speculation=True, **kw)
    plain = load_engine(str(target), backend="neuron-cpu", **kw)
    return fused, plain, a, b


def test_measured_acceptance_equals_the_constructed_one(two_token):
    """Every draft is A and the target says A or B: each fused step keeps the leading As of the target's next k
    tokens, so steps and accepted drafts per sequence are worked out from the plain tokens alone; the tokens are the
    plain ones."""
    fused, plain, a, b = two_token
    gen = GenerationConfig(max_new_tokens=NEW)
    want = plain.generate(PROMPTS, gen)
    got = fused.generate(PROMPTS, gen)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert all(set(w.tokens) <= {a, b} for w in want) and any(w.tokens.count(a) > 2 for w in want)
    measured = [(g.timings["spec_steps"], g.timings["accepted_tokens"]) for g in got]
    expected = [_expected_steps(w.tokens, a, K) for w in want]
    print(f"\nTP {_tp()}: (steps, accepted) {measured}, expected {expected}; acceptance "
          f"{[round(g.timings['acceptance_length'], 3) for g in got]}")
    assert measured == expected and sum(acc for _, acc in measured) > 0


def test_the_drafts_proposals_are_the_reference_drafts(engines):
    """The traced draft (NxDI's EAGLE3 layer over the converted checkpoint: key names, the d2t head, norms, RoPE)
    run alone on a prompt's target states proposes, after each of several prefixes, the token the reference EAGLE3
    draft proposes from the same states (argmax over the draft vocabulary, as a target id)."""
    from minimax_m3.reference.eagle3 import DraftCache, load_host_drafter
    from minimax_m3.reference.engine import ReferenceEngine

    fused, _, ck, draft_path, _ = engines
    draft = fused.app.context_encoding_model.model.draft_model
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    drafter = load_host_drafter(draft_path, str(ck), ref.model.config)
    ids = PROMPTS[0]
    n, bucket = len(ids), 128
    x, pos = torch.tensor([ids]), torch.arange(n).unsqueeze(0)
    _, states = ref.model(x, pos, ref.model.new_cache(1, 128), n, decode=False, hidden_at=drafter.aux_layers)
    # the draft entry at position t reads the target's states at t and the token at t + 1
    tokens, states = x[:, 1:], states[:, :n - 1].float()
    rd = drafter.draft
    logits, _ = rd(tokens, rd.combine(states), pos[:, :n - 1], DraftCache(rd.dc, 1, 128, torch.float32, "cpu"))
    want = logits[0].argmax(-1)
    assert (want < rd.dc.vocab_size).all() and len(set(want.tolist())) > 1
    got = []
    draft.n_positions = bucket
    for m in (9, 24, 40, n - 1):  # each call proposes after its last entry (the prefill's last-token pick)
        pad = bucket - m
        with torch.no_grad():
            out = draft(torch.nn.functional.pad(tokens[:, :m], (0, pad)),
                        torch.nn.functional.pad(torch.ones(1, m, dtype=torch.long), (0, pad)),
                        torch.nn.functional.pad(pos[:, :m], (0, pad), value=1), torch.tensor([0]),
                        torch.tensor([[1.0, 1.0, 1.0]]), prev_hidden=torch.nn.functional.pad(states[:, :m],
                                                                                          (0, 0, 0, pad)))
        got.append(int(out[0].reshape(-1)[0]))
    print(f"\ndraft proposals, TP {_tp()}: {got} (reference: {[int(want[m - 1]) for m in (9, 24, 40, n - 1)]})")
    assert got == [int(want[m - 1]) for m in (9, 24, 40, n - 1)]


def _draft_state(engine, row: int, n: int):
    """The draft's K and V cache entries at positions ``0 .. n - 2`` of cache row ``row`` (entry ``n - 1`` is the
    placeholder the first fused step rewrites) and the rolling buffer's target state for position ``n``."""
    model = engine.app.fused_spec_model.model
    kv = [x[row, :, :n - 1].clone() for x in model.draft_model.kv_mgr.past_key_values]
    buffer = model.hidden_state_rolling_buffer
    return kv, buffer.hidden_states[row, n % buffer.buffer_length].clone()


def test_a_chunked_prefill_leaves_the_draft_what_one_call_leaves(engines, chunked):
    """Each prompt prefilled alone in calls of ``CHUNK`` tokens (the draft attends to what its earlier calls wrote and
    rewrites the previous call's placeholder entry) leaves the draft's cache entries and the rolling buffer's state as
    the one-call build's prefill (NxDI's own fused prefill) does, within float32 rounding."""
    fused = engines[0]
    assert type(chunked.app.fused_spec_model.model).__name__ == "M3FusedSpecModel"
    assert type(chunked.app.fused_spec_model.model.draft_model.kv_mgr).__name__ == "DraftKVCacheManager"
    one = GenerationConfig(max_new_tokens=1)
    worst = 0.0
    for ids in PROMPTS:
        assert fused.generate([ids], one)[0].tokens == chunked.generate([ids], one)[0].tokens
        want, got = _draft_state(fused, 0, len(ids)), _draft_state(chunked, 0, len(ids))
        for w, g in zip([*want[0], want[1]], [*got[0], got[1]]):
            assert w.abs().max() > 0.1
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            worst = max(worst, float((g - w).abs().max()))
    print(f"\nchunked prefill, TP {_tp()}: draft cache and rolling-buffer state vs one call: max |diff| {worst:.2e}")


def test_chunked_fused_tokens_are_plain_on_device_decodings(engines, chunked):
    """Greedy and seeded, three prompts in two slots: the chunked fused build's tokens are the build without a
    draft's (and the one-call fused build's acceptance, step for step)."""
    fused, plain = engines[0], engines[1]
    for gen in (GenerationConfig(max_new_tokens=NEW),
                GenerationConfig(max_new_tokens=NEW, temperature=0.8, top_k=20, seed=11)):
        want = plain.generate(PROMPTS, gen)
        got = chunked.generate(PROMPTS, gen)
        assert [g.tokens for g in got] == [w.tokens for w in want]
        one_call = fused.generate(PROMPTS, gen)
        assert [(g.timings["spec_steps"], g.timings["accepted_tokens"]) for g in got] == \
            [(o.timings["spec_steps"], o.timings["accepted_tokens"]) for o in one_call]
