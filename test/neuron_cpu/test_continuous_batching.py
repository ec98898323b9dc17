"""Continuous batching in NxDI's CPU mode, at this process's TP degree: requests prefilled one at a time into
their own cache rows (K/V and index-K, ``seq_ids=[slot]``), decoded together, a finished request's slot reused by
the next prompt while the other slot is mid-decode, graded against the reference engine (float32; the reference is
graded against transformers in the project's own suite). Also: one context-encoding call per prompt for
``prefill_logits``, and each prefill runs the smallest bucket that holds its prompt.

One NxDI model per file (TP 2 and 4 rerun this file under torchrun, one model per process)."""

import pytest

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
TOL = 1e-4  # float32 end to end, as test_port_cpu
STEPS = 6
SLOTS = 2
BUCKETS = [32, 64, 128]
# 100 and 75 tokens: 7 and 5 blocks of 16 with the top 2 kept (sparse in prefill and decode); the rest dense
PROMPTS = [random_ids(100, seed=31), random_ids(12, seed=32), random_ids(75, seed=33), random_ids(40, seed=34),
           random_ids(5, seed=35)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    ck = write_synthetic(tmp_path_factory.mktemp("cb") / "tiny", M3Config.preset("tiny"), seed=0)
    port = load_engine(str(ck), backend="neuron-cpu", **neuron_cpu_engine_kwargs(
        batch_size=SLOTS, max_seq_len=160, max_context_length=max(BUCKETS), context_encoding_buckets=BUCKETS))
    return port, ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)


@pytest.fixture
def calls(engines, monkeypatch):
    """Every compiled-graph call NxDI makes, in order: (graph, input_ids shape after NxDI's padding, seq_ids)."""
    app = engines[0].app
    log = []
    for tag, wrapper in (("prefill", app.context_encoding_model), ("decode", app.token_generation_model)):
        def spy(*args, _tag=tag, _orig=wrapper._forward):
            log.append((_tag, tuple(args[0].shape), args[3].tolist()))
            return _orig(*args)
        monkeypatch.setattr(wrapper, "_forward", spy)
    return log


def test_config_is_nxdi_continuous_batching(engines):
    nc = engines[0].app.neuron_config
    assert nc.is_continuous_batching and nc.ctx_batch_size == 1 and nc.tkg_batch_size == nc.batch_size == SLOTS
    assert engines[0].app.context_encoding_model.neuron_config.batch_size == 1


def test_requests_prefilled_one_at_a_time_into_reused_slots_match_reference(engines, calls):
    port, ref = engines
    plain = ref.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=STEPS))[0].tokens
    # the first request ends at its 3rd token (unless the others emit it first): its slot takes the next prompt
    # while the other slot is mid-decode
    gen = GenerationConfig(max_new_tokens=STEPS, return_logits=True, eos_token_ids=(plain[2],))
    got, want = port.generate(PROMPTS, gen), ref.generate(PROMPTS, gen)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        assert (g.step_logits - w.step_logits).abs().max() <= TOL
    prefills = [c for c in calls if c[0] == "prefill"]
    assert len(prefills) == len(PROMPTS) and all(c[1][0] == 1 and len(c[2]) == 1 for c in prefills)
    assert sorted(c[2][0] for c in prefills[:SLOTS]) == list(range(SLOTS))
    # some prefill came between two decode steps (a slot refilled while the other kept decoding)
    kinds = [c[0] for c in calls]
    assert any(kinds[i - 1:i + 2] == ["decode", "prefill", "decode"] for i in range(1, len(kinds) - 1)), kinds
    assert all(c[1][0] == SLOTS and c[2] == list(range(SLOTS)) for c in calls if c[0] == "decode")


def test_prefill_runs_the_smallest_bucket_that_holds_the_prompt(engines, calls):
    port, _ = engines
    port.provider.prefill([PROMPTS[1], PROMPTS[0]], [0, 1])  # 12 and 100 tokens, into slots 0 and 1
    assert [c[1] for c in calls] == [(1, 32), (1, 128)]


def test_prefill_logits_is_one_prefill_per_prompt(engines, calls):
    port, ref = engines
    got, want = port.prefill_logits(PROMPTS[:3]), ref.prefill_logits(PROMPTS[:3])
    assert [c[0] for c in calls] == ["prefill"] * 3
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= TOL
