"""Chunked prefill through the NxDI port in CPU mode (issue 23): an engine built with ``EngineSpec(prefill_chunk=32)``
prefills a prompt in calls of at most 32 tokens through NxDI's one context-encoding graph (the context buckets end at
the chunk), the application's ``forward`` running the loop (``neuron.chunk_loop.prefill_in_chunks``), each call
reading the cache lines the earlier calls wrote (K/V and index-K) and writing its chunk at ``p0``; graded against the
reference engine's ONE-SHOT prefill (the golden, float32) and its decode, with the indexer dropping blocks.

The two numeric tests need the attention to read the rows' prior cache in context encoding (``neuron.attention`` /
``neuron.kv_cache``); the call pattern and the refusals do not.

One NxDI model per file (torchrun reruns build one model per process)."""

import pytest

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
# float32 end to end. Measured with the prototype's attention (2026-12-01, branch port), chunked / unchunked port on
# the same prompts: prefill 7.6e-6 / 9.5e-6 at TP 1, 2.1e-5 / 2.1e-5 at TP 2; decode 1.9e-5 / 1.9e-5 at TP 1,
# 1.8e-5 / 1.9e-5 at TP 2. Chunking added no error; the port itself sits at issue 23's 2e-5 target, hence the margin.
TOL = 4e-5
CHUNK = 32  # two 16-token blocks of the tiny model
SEQ, CTX = 128, 112
# 100 tokens: 4 calls (32, 32, 32, 4), 7 blocks with the top 2 kept; 70: 3 calls; 33: a 1-token last call; 20: one
PROMPTS = [random_ids(100, seed=41), random_ids(70, seed=42), random_ids(33, seed=43), random_ids(20, seed=44)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import world_size

    ck = write_synthetic(tmp_path_factory.mktemp("chunked") / "tiny", M3Config.preset("tiny"), seed=0)
    port = load_engine(EngineSpec(str(ck), "neuron-cpu", tp=world_size(), dtype="float32", max_batch=2,
                                  max_seq_len=SEQ, max_context_len=CTX, prefill_chunk=CHUNK))
    return port, ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)


@pytest.fixture
def calls(engines, monkeypatch):
    """Every context-encoding call NxDI makes: (input_ids shape after NxDI's padding, first position, seq_ids)."""
    wrapper = engines[0].app.context_encoding_model
    log, orig = [], wrapper._forward

    def spy(*args):
        log.append((tuple(args[0].shape), int(args[2][0, 0]), args[3].tolist()))
        return orig(*args)

    monkeypatch.setattr(wrapper, "_forward", spy)
    return log


def test_the_spec_builds_one_chunk_wide_graph_and_the_indexer_drops_blocks(engines):
    port, ref = engines
    nc, c = port.app.neuron_config, ref.config
    assert (nc.prefill_chunk, port.app.config.prefill_chunk, nc.context_encoding_buckets) == (CHUNK, CHUNK, [CHUNK])
    assert (nc.max_context_length, nc.seq_len, port.provider.max_context_len) == (CTX, SEQ, CTX)
    assert len(PROMPTS[0]) > c.index_topk * c.index_block_size and CHUNK % c.index_block_size == 0


def test_each_call_runs_the_one_graph_at_its_chunks_start(engines, calls):
    """A 100-token prompt: calls at 0, 32, 64, 96; a 33-token one: 0 and 32 (its 1-token last call sent 2 wide, so
    NxDI routes it to context encoding); every call padded to the one 32-wide bucket, into the prompt's slot."""
    port, _ = engines
    port.provider.prefill([PROMPTS[0]], [1])
    port.provider.prefill([PROMPTS[2]], [0])
    assert calls == [((1, CHUNK), p0, [1]) for p0 in (0, 32, 64, 96)] + [((1, CHUNK), p0, [0]) for p0 in (0, 32)]


def test_every_position_of_a_chunked_prefill_equals_the_one_shot_golden(engines, calls):
    """Needs the attention to read the prior cache in context encoding."""
    port, ref = engines
    got, want = port.provider.prefill_logits(PROMPTS[:3]), ref.prefill_logits(PROMPTS[:3])
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max() <= TOL
    assert [p0 for _, p0, _ in calls] == [0, 32, 64, 96, 0, 32, 64, 0, 32]


def test_generate_with_staggered_admissions(engines, calls):
    """Continuous batching, 2 slots, 4 prompts: the later prompts are prefilled chunk by chunk into a slot while the
    other slot is mid-decode; decode crosses block (16) and chunk (32) boundaries. Needs the attention to read the
    prior cache in context encoding."""
    port, ref = engines
    gen = GenerationConfig(max_new_tokens=8, return_logits=True)
    got, want = port.generate(PROMPTS, gen), ref.generate(PROMPTS, gen)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert (g.step_logits - w.step_logits).abs().max() <= TOL
    assert sorted(p0 for _, p0, _ in calls) == sorted([0, 32, 64, 96, 0, 32, 64, 0, 32, 0])
    assert {s for s, _, _ in calls} == {(1, CHUNK)} and {tuple(ids) for _, _, ids in calls} == {(0,), (1,)}


@pytest.mark.parametrize("chunk, seq, ctx, buckets, words", [
    (24, 96, 96, [24], r"prefill chunk of 24 tokens: it must be a multiple of 16 .*nearest that work: \[16, 32\]"),
    (32, 112, 112, [32], "the last one written up to position 127, past the cache of max_seq_len 112: raise "
                         "--max-seq-len to 128 or lower --max-context-len to 96"),
    (32, 128, 112, [32, 64], r"context-encoding buckets \[64\] exceed prefill_chunk 32"),
    (32, 128, 112, [16], "the largest context-encoding bucket 16 is below prefill_chunk 32"),
])
def test_nxdi_refuses_chunks_the_layout_cannot_use(engines, chunk, seq, ctx, buckets, words):
    """vLLM's configs are checked here (``validate_config``), with the spec's rules and messages."""
    from minimax_m3.errors import ServingError
    from minimax_m3.neuron.build import neuron_config
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig

    port, _ = engines
    spec = port.spec
    nc = neuron_config(spec, max_batch_size=1, batch_size=1, tkg_batch_size=1, ctx_batch_size=1,
                       is_continuous_batching=False, seq_len=seq, max_context_length=ctx,
                       context_encoding_buckets=buckets, token_generation_buckets=[seq], prefill_chunk=chunk)
    with pytest.raises(ServingError, match=words):
        MiniMaxM3InferenceConfig(nc, m3=port.app.config.m3)


def test_a_vllm_config_without_a_chunk_gets_the_spec_default_and_buckets_ending_at_a_given_one(engines):
    from minimax_m3.neuron.build import neuron_config
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig

    port, _ = engines
    kw = dict(context_encoding_buckets=None, prefill_chunk=None, max_context_length=SEQ)
    cfg = MiniMaxM3InferenceConfig(neuron_config(port.spec, **kw), m3=port.app.config.m3)
    assert cfg.prefill_chunk == cfg.neuron_config.prefill_chunk == SEQ  # 128 in whole blocks: one call per prompt
    cfg = MiniMaxM3InferenceConfig(neuron_config(port.spec, **{**kw, "prefill_chunk": 64}), m3=port.app.config.m3)
    assert (cfg.prefill_chunk, cfg.neuron_config.context_encoding_buckets) == (64, [64])
