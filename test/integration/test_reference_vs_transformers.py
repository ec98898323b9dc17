"""The whole reference model against transformers' MiniMax-M3 (independent oracle) on the same checkpoint.

Tolerances: float32 max |Δlogit| <= 2e-4 with identical greedy tokens; bfloat16 is graded against the float32
oracle (see test_bfloat16_within_stated_tolerance). The tiny preset has 16-token blocks and keeps 2 blocks, so
at 160 tokens the indexer keeps 2 of up to 10 blocks per query and KV group.
"""

import pytest
import torch

from minimax_m3 import GenerationConfig
from minimax_m3.reference.engine import ReferenceEngine
from test.conftest import random_ids

F32_TOL = 2e-4
BF16_TOL = 0.5  # where every block is kept; see test_bfloat16_within_stated_tolerance


def hf_logits(hf, ids):
    x = torch.tensor([ids])
    with torch.no_grad():
        return hf(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()


def hf_greedy(hf, ids, steps):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, 1)[0].float()


@pytest.mark.parametrize("length", [24, 160])
def test_prefill_logits_match(ref_engine, hf_tiny, length):
    c = ref_engine.config
    if length == 160:
        assert length >= 4 * c.index_topk * c.index_block_size
    ids = random_ids(length, seed=length)
    got = ref_engine.prefill_logits([ids])[0]
    want = hf_logits(hf_tiny, ids)
    assert (got - want).abs().max().item() <= F32_TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cached_decode_matches_beyond_the_sparse_point(ref_engine, hf_tiny):
    ids = random_ids(160, seed=7)
    want_tokens, want_logits = hf_greedy(hf_tiny, ids, 20)
    res = ref_engine.generate([ids], GenerationConfig(max_new_tokens=20, return_logits=True))[0]
    assert res.tokens == want_tokens
    assert (res.step_logits - want_logits).abs().max().item() <= F32_TOL


def test_sparse_selection_really_matters(tiny_ckpt, ref_engine):
    """The same weights with dense attention everywhere move the logits by orders of magnitude more than the
    tolerance: a port that silently runs dense attention fails the tests above."""
    from minimax_m3.reference.loader import build_model

    c = ref_engine.config
    dense_cfg = c.replace(sparse_layers=(False,) * c.num_layers)
    state = {k: v for k, v in ref_engine.model.state_dict().items() if ".index_" not in k}
    dense = ReferenceEngine(build_model(dense_cfg, state, "cpu"))
    ids = random_ids(160, seed=160)
    short = random_ids(24, seed=24)
    assert (dense.prefill_logits([ids])[0] - ref_engine.prefill_logits([ids])[0]).abs().max() > 100 * F32_TOL
    # below topk x block_size every block is kept: sparse == dense up to rounding
    assert (dense.prefill_logits([short])[0] - ref_engine.prefill_logits([short])[0]).abs().max() < 1e-4


def test_bfloat16_within_stated_tolerance(tiny_ckpt, hf_tiny):
    """bfloat16 against the float32 oracle. Where every block is kept the error is rounding only (measured
    0.28 max on logits of magnitude ~20; transformers' own bf16 run: 0.25). Where the indexer drops blocks,
    bf16 rounding of index scores flips some block choices, so single positions can move by several units in
    ANY bf16 implementation (transformers' own bf16 run: 13.5 max, 92.5% argmax agreement); there we grade
    greedy agreement instead (measured 93.75%)."""
    eng = ReferenceEngine.from_pretrained(tiny_ckpt, device="cpu", dtype="bfloat16")
    dense_ids, sparse_ids = random_ids(24, seed=11), random_ids(160, seed=11)
    got = eng.prefill_logits([dense_ids])[0]
    assert got.dtype == torch.float32
    assert (got - hf_logits(hf_tiny, dense_ids)).abs().max().item() <= BF16_TOL
    got, want = eng.prefill_logits([sparse_ids])[0], hf_logits(hf_tiny, sparse_ids)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
