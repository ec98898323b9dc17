"""The shared backend suite: ``pytest --backend reference|neuron|neuron-cpu test/integration``.

What a backend is graded against (the ``expected`` fixture): the reference backend against transformers'
``minimax_m3_vl`` run on the same checkpoint (an independent oracle, never the reference's own output); every
other backend against the golden file that ``minimax-m3 golden`` writes with the reference backend (float32),
which is itself graded against transformers here (test_golden_agrees_with_transformers). Graded: prefill logits at
every prompt position, cached decode-step logits and greedy tokens, a prompt long enough that the indexer drops
blocks in prefill and in decode, and batch/padding invariance.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3.cli import main as cli
from test.conftest import random_ids
from test.integration.test_reference_vs_transformers import hf_greedy, hf_logits

TOLERANCE = {"float32": 2e-4}
PROMPTS = [random_ids(24, seed=1), random_ids(160, seed=2), random_ids(97, seed=3)]  # dense, sparse, ragged
DECODE_STEPS = 16


@pytest.fixture(scope="session")
def golden(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    out = d / "golden.safetensors"
    assert cli(["golden", "--model", str(tiny_ckpt), "--prompts", str(prompts), "--out", str(out),
                "--decode-steps", str(DECODE_STEPS), "--device", "cpu"]) == 0
    return load_file(out)


@pytest.fixture(scope="session")
def hf_expected(request):
    """transformers' logits and greedy tokens for PROMPTS, in the golden file's layout (float32, eager)."""
    hf = request.getfixturevalue("hf_tiny")  # looked up here: neuron-cpu's transformers pin has no minimax_m3_vl
    out = {}
    for i, p in enumerate(PROMPTS):
        out[f"{i}.prefill_logits"] = hf_logits(hf, p)
        tokens, out[f"{i}.step_logits"] = hf_greedy(hf, p, DECODE_STEPS)
        out[f"{i}.tokens"] = torch.tensor(tokens)
    return out


@pytest.fixture(scope="session")
def expected(backend, request):
    """The reference backend is graded against transformers directly; the others against the golden file."""
    return request.getfixturevalue("hf_expected" if backend == "reference" else "golden")


@pytest.fixture(scope="session")
def engine(backend, tiny_ckpt):
    """The engine under test, built from the same synthetic checkpoint."""
    if backend == "reference":
        from minimax_m3.reference.engine import ReferenceEngine

        return ReferenceEngine.from_pretrained(tiny_ckpt, device="cpu", dtype="float32", max_seq_len=512)
    if backend == "neuron-cpu" and not (os.environ.get("NXDI_SRC") and os.environ.get("NXD_SRC")):
        pytest.skip("neuron-cpu needs NxDI/NxD sources: set NXDI_SRC and NXD_SRC (see README, NxDI CPU mode)")
    from minimax_m3.load import load_engine

    try:
        return load_engine(str(tiny_ckpt), backend=backend, dtype="float32", max_seq_len=512)
    except ImportError as exc:  # the neuron package raises one clear error without the SDK
        pytest.skip(f"{backend} backend unavailable here: {exc}")


def test_golden_file_layout(golden):
    for i, p in enumerate(PROMPTS):
        assert golden[f"{i}.prefill_logits"].shape == (len(p), 512)
        assert golden[f"{i}.step_logits"].shape == (DECODE_STEPS, 512)
        assert torch.equal(golden[f"{i}.tokens"], golden[f"{i}.step_logits"].argmax(-1))
        torch.testing.assert_close(golden[f"{i}.step_logits"][0], golden[f"{i}.prefill_logits"][-1], atol=1e-5, rtol=0)


def test_golden_agrees_with_transformers(golden, hf_tiny, hf_expected):
    for i in range(len(PROMPTS)):
        assert (golden[f"{i}.prefill_logits"] - hf_expected[f"{i}.prefill_logits"]).abs().max() <= TOLERANCE["float32"]
        assert (golden[f"{i}.step_logits"] - hf_expected[f"{i}.step_logits"]).abs().max() <= TOLERANCE["float32"]
        assert golden[f"{i}.tokens"].tolist() == hf_expected[f"{i}.tokens"].tolist()


def test_reference_is_graded_by_transformers(backend, expected, request):
    """The oracle really is transformers for the reference backend (not a file the reference wrote)."""
    if backend != "reference":
        assert expected is request.getfixturevalue("golden")
    else:
        assert expected is request.getfixturevalue("hf_expected")


def test_prefill_logits_against_oracle(engine, expected):
    for i, got in enumerate(engine.prefill_logits(PROMPTS)):
        assert (got - expected[f"{i}.prefill_logits"]).abs().max() <= TOLERANCE["float32"]


def test_decode_against_oracle_with_sparse_selection_active(engine, expected):
    from minimax_m3 import GenerationConfig

    c = engine.config
    assert len(PROMPTS[1]) > c.index_topk * c.index_block_size  # the indexer drops blocks here
    res = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=DECODE_STEPS, return_logits=True))
    for i, r in enumerate(res):
        assert r.tokens == expected[f"{i}.tokens"].tolist()
        assert (r.step_logits - expected[f"{i}.step_logits"]).abs().max() <= TOLERANCE["float32"]


def test_batch_invariance_against_oracle(engine, expected):
    from minimax_m3 import GenerationConfig

    solo = engine.generate([PROMPTS[1]], GenerationConfig(max_new_tokens=DECODE_STEPS))[0]
    assert solo.tokens == expected["1.tokens"].tolist()
