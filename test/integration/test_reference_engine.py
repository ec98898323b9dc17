"""Engine behaviour: batching/padding invariance, sampling, stopping, and every bad input."""

import pytest
import torch

from minimax_m3 import EngineInputError, GenerationConfig
from minimax_m3.engine import unpad
from minimax_m3.reference.engine import ReferenceEngine, resolve_dtype
from test.conftest import random_ids

GREEDY = GenerationConfig(max_new_tokens=12, return_logits=True)


def test_batch_and_padding_invariance(ref_engine):
    """Each sequence gets exactly its solo tokens whatever its batch-mates, padded left or right."""
    prompts = [random_ids(n, seed=n) for n in (150, 37, 90)]  # sparse, dense and in-between lengths
    alone = [ref_engine.generate([p], GREEDY)[0] for p in prompts]
    batched = ref_engine.generate(prompts, GREEDY)
    for a, b in zip(alone, batched):
        assert a.tokens == b.tokens
        assert (a.step_logits - b.step_logits).abs().max() < 1e-4
    width = max(len(p) for p in prompts)
    for side in ("left", "right"):
        ids = torch.zeros(3, width, dtype=torch.long)
        mask = torch.zeros(3, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
            ids[i, sl], mask[i, sl] = torch.tensor(p), 1
        padded = ref_engine.generate(unpad(ids, mask), GREEDY)
        assert [r.tokens for r in padded] == [a.tokens for a in alone]


def test_prefill_batch_invariance(ref_engine):
    prompts = [random_ids(n, seed=100 + n) for n in (70, 20)]
    solo = [ref_engine.prefill_logits([p])[0] for p in prompts]
    for s, b in zip(solo, ref_engine.prefill_logits(prompts)):
        assert s.shape == b.shape and (s - b).abs().max() < 1e-4


def test_sampling_is_reproducible_and_seeded(ref_engine):
    p = random_ids(40, seed=3)
    cfg = GenerationConfig(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    a = ref_engine.generate([p], cfg)[0].tokens
    assert a == ref_engine.generate([p], cfg)[0].tokens
    assert a == ref_engine.generate([random_ids(9, seed=4), p], cfg)[1].tokens  # batch-mates don't matter
    other = GenerationConfig(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=99)
    assert a != ref_engine.generate([p], other)[0].tokens
    assert a != ref_engine.generate([p], GenerationConfig(max_new_tokens=16))[0].tokens  # not greedy


def test_eos_and_stop_sequences(ref_engine):
    p = random_ids(30, seed=5)
    full = ref_engine.generate([p], GenerationConfig(max_new_tokens=10))[0]
    assert full.finish_reason == "length" and len(full.tokens) == 10
    eos = ref_engine.generate([p], GenerationConfig(max_new_tokens=10, eos_token_ids=(full.tokens[3],)))[0]
    first = full.tokens.index(full.tokens[3])
    assert eos.finish_reason == "eos" and eos.tokens == full.tokens[:first + 1]
    stop = tuple(full.tokens[4:6])
    res = ref_engine.generate([p], GenerationConfig(max_new_tokens=10, stop_sequences=(stop,)))[0]
    assert res.finish_reason == "stop" and tuple(res.tokens[-2:]) == stop


def test_bad_inputs_give_clear_errors(ref_engine, monkeypatch):
    with pytest.raises(EngineInputError, match="prompt 0 is empty"):
        ref_engine.generate([[]], GREEDY)
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        ref_engine.prefill_logits([[1, 2, 512]])
    with pytest.raises(EngineInputError, match="exceeds max_seq_len=1024"):
        ref_engine.generate([random_ids(1020, seed=0)], GREEDY)
    with pytest.raises(EngineInputError, match="max_new_tokens must be >= 1"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(EngineInputError, match="has holes"):
        unpad(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 0, 1]]))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(EngineInputError, match="no bfloat16 support; use --dtype float32"):
        resolve_dtype("bfloat16", "cuda")
    with pytest.raises(EngineInputError, match="unknown dtype"):
        resolve_dtype("float16", "cpu")


def test_no_cuda_requested_on_cpu_machine(tiny_ckpt):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from minimax_m3.config import ConfigError

    with pytest.raises(ConfigError, match="no CUDA device is available"):  # listed by the spec before loading
        ReferenceEngine.from_pretrained(tiny_ckpt, device="cuda")


def test_the_cache_is_max_seq_len_long_and_longer_requests_are_refused(tiny_ckpt):
    """A reference engine loaded with ``max_seq_len=N`` keeps N positions per sequence (as the neuron backend's
    cache; tiny's indexer block is 16, so 96 is whole blocks) and refuses prompt + generation > N with the engine's
    error before any work."""
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.load import load_engine

    n = 96
    eng = load_engine(EngineSpec(str(tiny_ckpt), device="cpu", dtype="float32", max_seq_len=n, max_batch=2))
    assert eng.max_seq_len == n and eng.spec.max_seq_len == n
    eng.generate([random_ids(20, seed=1), random_ids(9, seed=2)], GenerationConfig(max_new_tokens=4))
    cache = eng.provider._cache
    assert cache.max_len == n and {tuple(k.shape[1:3]) for k in cache.k} == {(eng.config.num_kv_heads, n)}
    assert {tuple(ik.shape[:2]) for ik in cache.index_k.values()} == {(2, n)}
    fits = eng.generate([random_ids(90, seed=3)], GenerationConfig(max_new_tokens=6))[0]  # exactly N positions
    assert len(fits.tokens) == 6
    with pytest.raises(EngineInputError, match=f"90 tokens; with 7 new tokens that exceeds max_seq_len={n}"):
        eng.generate([random_ids(90, seed=3)], GenerationConfig(max_new_tokens=7))


@pytest.mark.parametrize("backend", ["reference", "neuron", "neuron-cpu"])
def test_max_seq_len_beyond_the_model_is_refused_by_the_spec_alike(tiny_ckpt, backend):
    """No silent clamp: one problem, the same words for every backend, from the spec before anything loads."""
    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec, SpecError

    c = M3Config.from_pretrained(tiny_ckpt)
    too_long = c.max_position_embeddings + c.index_block_size
    want = f"max_seq_len {too_long} exceeds the model's max_position_embeddings {c.max_position_embeddings}"
    with pytest.raises(SpecError) as exc:
        EngineSpec(str(tiny_ckpt), backend=backend, max_seq_len=too_long, tp=1, ep=1, lnc=1).validate(c)
    assert [p for p in exc.value.problems if "max_position_embeddings" in p] == [want]


def test_no_clamp_on_a_model_loaded_by_hand_or_through_load_engine(tiny_ckpt):
    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec, SpecError
    from minimax_m3.load import load_engine
    from minimax_m3.reference.loader import load_model

    c = M3Config.from_pretrained(tiny_ckpt)
    too_long = c.max_position_embeddings + c.index_block_size
    want = f"max_seq_len {too_long} exceeds the model's max_position_embeddings {c.max_position_embeddings}"
    with pytest.raises(SpecError, match=want):
        load_engine(EngineSpec(str(tiny_ckpt), device="cpu", max_seq_len=too_long))
    with pytest.raises(SpecError, match=want):
        ReferenceEngine(load_model(tiny_ckpt, "cpu"), max_seq_len=too_long)


def test_one_load_parses_config_json_once(tiny_ckpt, monkeypatch):
    """``load_engine`` parses the model's config once and hands the M3Config down: neither the spec, the reference
    loader nor the checkpoint reader parse config.json again."""
    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.load import load_engine

    parses = []
    real = M3Config.from_dict.__func__

    def counting(cls, raw, source="config"):
        parses.append(source)
        return real(cls, raw, source)

    monkeypatch.setattr(M3Config, "from_dict", classmethod(counting))
    eng = load_engine(EngineSpec(str(tiny_ckpt), device="cpu", dtype="float32", max_seq_len=128))
    assert parses == [str(tiny_ckpt / "config.json")], parses
    assert eng.config == eng.provider.model.config
