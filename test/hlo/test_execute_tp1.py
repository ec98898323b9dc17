"""At TP=1 in float32 the traced modules, executed through XLA, give the golden logits and greedy tokens (issue 13).

The modules are the ones ``compile --dry-run`` wrote for the tiny checkpoint (2 context-encoding and 2 token-generation
buckets); ``test.support.hlo.execute_graphs`` runs them with the weights NxD shards for rank 0. The oracle is the golden
of the reference backend (``compute_golden``), itself graded against transformers in the shared suite. One prompt spans
8 indexer blocks (sparse selection drops blocks), the other decodes across the 128-token bucket boundary, so both decode
buckets and the cache hand-over between graphs are exercised. The execution's output is a pure function of the traced
modules, the checkpoint and the request and is kept with the traces (``test.support.neuron.result_cache``).
"""

from __future__ import annotations

import json

import torch

from test.conftest import random_ids
from test.hlo.conftest import run_module
from test.support.neuron import result_cache

TOL = 1e-4


def test_traced_graphs_give_the_golden_logits(dry_tiny, tiny_ckpt, tmp_path):
    from minimax_m3.reference.engine import ReferenceEngine
    from minimax_m3.reference.golden import compute_golden

    prompts = [random_ids(37, seed=1), random_ids(125, seed=2)]
    steps = 6
    req, out = tmp_path / "req.json", tmp_path / "out"
    req.write_text(json.dumps({"prompts": prompts, "steps": steps}))
    out.mkdir()

    def execute() -> str:
        return run_module("test.support.hlo.execute_graphs", str(dry_tiny), str(tiny_ckpt), str(req),
                          str(out / "o.pt"), timeout=2400)[0]

    # a pure function of the traced modules, the checkpoint and the request: kept with the traces (conftest)
    result_cache.cached("test.support.hlo.execute_graphs", [], [dry_tiny, tiny_ckpt, req], out, execute)
    got = torch.load(out / "o.pt")
    ref = ReferenceEngine.from_pretrained(tiny_ckpt, device="cpu", dtype="float32", max_seq_len=256)
    golden = compute_golden(ref, prompts, steps + 1)
    for i in range(len(prompts)):
        want = golden[f"{i}.step_logits"]
        err = (got["step_logits"][i, : want.shape[0]] - want).abs().max().item()
        assert err <= TOL, (i, err)
        assert got["tokens"][i, : want.shape[0]].tolist() == golden[f"{i}.tokens"].tolist()
    # the decode crossed into the second token-generation bucket
    assert len(prompts[1]) + steps > 128
