"""TP / EP / TP x EP on gloo (CPU): world sizes 2 and 4 give the logits of the single-process model.

Each world size is one ``torch.multiprocessing.spawn`` whose ranks run every layout in turn (the start-up cost is paid
once). Layouts on the tiny preset (8 query heads, 2 KV heads, 8 experts): world 2 with ep=1 (pure TP) and ep=2 (pure
EP: each rank one expert range, whole experts); world 4 with ep=1 (TP 4: KV heads replicated x2, every expert's
intermediate split 4 ways), ep=2 (TP 2 x EP 2) and ep=4 (pure EP).

Tolerances, relative to the largest logit (~10 here): float32 1e-5 (partial sums are added in another order, so
rounding differs: measured 2.5e-6 relative at world 4); float64 1e-10, which shows the sharded math is the same sum
(the remaining float32 steps inside ``ops`` — router scores, softmax, index scores — absorb the float64 rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from minimax_m3 import GenerationConfig
from minimax_m3.reference.engine import ReferenceEngine
from minimax_m3.reference.loader import load_model
from test.conftest import random_ids
from test.support.distributed_rank import run

PROMPTS = [random_ids(70, seed=1), random_ids(41, seed=2)]  # > 2 blocks of 16 past the dense span: sparse paths
STEPS = 6
DTYPES = (torch.float32, torch.float64)
REL_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    out = {}
    for dt in DTYPES:
        eng = ReferenceEngine(load_model(tiny_ckpt, "cpu", dt), max_seq_len=256)
        out[dt] = (eng.prefill_logits(PROMPTS),
                   eng.generate(PROMPTS, GenerationConfig(max_new_tokens=STEPS, return_logits=True)),
                   sum(p.numel() for p in eng.model.parameters()))
    return out


def _close(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= REL_TOL[dt] * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("world,eps", [(2, [1, 2]), (4, [1, 2, 4])])
def test_parallel_layouts_match_single_process(tmp_path, tiny_ckpt, single, world, eps):
    out = tmp_path / "result.pt"
    mp.spawn(run, args=(world, str(tiny_ckpt), str(tmp_path / "pg"), str(out), eps, PROMPTS, STEPS, DTYPES),
             nprocs=world, join=True)
    res = torch.load(out, weights_only=False)
    for ep in eps:
        for dt in DTYPES:
            pre1, gen1, full = single[dt]
            r = res[ep, dt]
            for a, b in zip(pre1, r["prefill"]):
                assert _close(a, b, dt), f"ep={ep} {dt} prefill"
            for g1, (tokens, logits) in zip(gen1, r["generate"]):
                assert tokens == g1.tokens, f"ep={ep} {dt} greedy tokens"
                assert _close(g1.step_logits, logits, dt), f"ep={ep} {dt} decode"
        # each rank holds about its share: no rank holds the whole model, and together they hold all of it
        per_rank = res[ep, DTYPES[0]]["params_per_rank"]
        assert max(per_rank) < 0.75 * full and sum(per_rank) >= full
