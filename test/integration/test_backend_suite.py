"""The shared backend suite: ``pytest --backend reference|neuron|neuron-cpu test/integration``.

Golden logits come from ``minimax-m3 golden`` on the reference backend (float32), which is itself graded
against transformers here (test_golden_agrees_with_transformers). Every backend is then graded against the
golden file: prefill logits at every prompt position, cached decode-step logits and greedy tokens, a prompt
long enough that the indexer drops blocks in prefill and in decode, and batch/padding invariance.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3.cli import main as cli
from test.conftest import random_ids

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
def engine(backend, tiny_ckpt):
    """The engine under test, built from the same synthetic checkpoint."""
    if backend == "reference":
        from minimax_m3.reference.engine import ReferenceEngine

        return ReferenceEngine.from_pretrained(tiny_ckpt, device="cpu", dtype="float32", max_seq_len=512)
    if backend == "neuron-cpu" and not (os.environ.get("NXDI_SRC") and os.environ.get("NXD_SRC")):
        pytest.skip("neuron-cpu needs NxDI/NxD sources: set NXDI_SRC and NXD_SRC (see README, NxDI CPU mode)")
    from minimax_m3.backends import load_engine

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


def test_golden_agrees_with_transformers(golden, hf_tiny):
    for i, p in enumerate(PROMPTS):
        x = torch.tensor([p])
        with torch.no_grad():
            out = hf_tiny.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=DECODE_STEPS,
                                   do_sample=False, output_logits=True, return_dict_in_generate=True,
                                   eos_token_id=None, pad_token_id=0)
            pre = hf_tiny(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()
        assert (golden[f"{i}.prefill_logits"] - pre).abs().max() <= TOLERANCE["float32"]
        assert (golden[f"{i}.step_logits"] - torch.stack(out.logits, 1)[0]).abs().max() <= TOLERANCE["float32"]
        assert golden[f"{i}.tokens"].tolist() == out.sequences[0, len(p):].tolist()


def test_prefill_logits_against_golden(engine, golden):
    for i, got in enumerate(engine.prefill_logits(PROMPTS)):
        assert (got - golden[f"{i}.prefill_logits"]).abs().max() <= TOLERANCE["float32"]


def test_decode_against_golden_with_sparse_selection_active(engine, golden):
    from minimax_m3 import GenerationConfig

    c = engine.config
    assert len(PROMPTS[1]) > c.index_topk * c.index_block_size  # the indexer drops blocks here
    res = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=DECODE_STEPS, return_logits=True))
    for i, r in enumerate(res):
        assert r.tokens == golden[f"{i}.tokens"].tolist()
        assert (r.step_logits - golden[f"{i}.step_logits"]).abs().max() <= TOLERANCE["float32"]


def test_batch_invariance_against_golden(engine, golden):
    from minimax_m3 import GenerationConfig

    solo = engine.generate([PROMPTS[1]], GenerationConfig(max_new_tokens=DECODE_STEPS))[0]
    assert solo.tokens == golden["1.tokens"].tolist()
