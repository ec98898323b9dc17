"""The sparse prefill graph at the cost of the work it does, read from the HLO module torch-xla lowers (what NxD hands
to neuronx-cc) with ``minimax-m3 graphs``' own counter (``neuron.hlo_cost``):

* attention dot FLOPs <= 1.5x the block-sparse analytic ``S x topk x block x D x 4`` per query head, and indexer dot
  FLOPs <= 1.5x the all-keys analytic ``S^2 x Di x 2`` per index head (a dense-masked prefill does ``S^2 / 2`` keys
  per query: 8x the analytic at these shapes);
* with a constant number of query tiles (``ops.tile_for``) the graph does not grow with the prompt: the module at
  2048 tokens has at most 1.2x the instructions of the one at 512.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimax_m3 import ops
from minimax_m3.graphs import hlo_cost, hlo_schema

from .conftest import torch_xla
from test.support import layer_functions as L

B, HQ, G, D, DI, BS, TOPK, CHUNKS = 1, 2, 1, 16, 16, 32, 2, 4  # every chunk sparse at both lengths
SEL = ops.Selection(BS, TOPK)


def _figures(s: int) -> dict:
    import torch_xla

    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(B, n, s, D, generator=gen).to(dev) for n in (HQ, G, G))
    iq, ik = torch.randn(B, G, s, DI, generator=gen).to(dev), torch.randn(B, s, DI, generator=gen).to(dev)
    out = L.prefill_step(q, k, v, D ** -0.5, ops.tile_for(s, CHUNKS, BS), SEL, iq, ik)
    ctx = torch_xla._XLAC.lowering.LoweringContext("x")
    ctx.build([out])
    return hlo_cost.analyze_module(hlo_schema.parse_module(ctx.hlo()))


@pytest.fixture(scope="module")
def figures() -> dict:
    """Both lengths lowered in a subprocess with the debug metadata the FLOP classes read (the flags the dry run
    traces with; torch-xla reads them at import)."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla])")
    env = dict(os.environ, XLA_IR_DEBUG="1", XLA_HLO_DEBUG="1", PJRT_DEVICE="CPU")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "test.xla.test_prefill_graph_xla"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("s", [512, 2048])
def test_sparse_prefill_flops_at_most_1_5x_analytic(figures, s):
    f = figures[s]["flops"]
    attention = s * TOPK * BS * D * 4 * HQ
    indexer = s * s * DI * 2 * G
    assert f["attention"] <= 1.5 * attention, f"attention {f['attention'] / attention:.2f}x the block-sparse analytic"
    assert f["indexer"] <= 1.5 * indexer, f"indexer {f['indexer'] / indexer:.2f}x the all-keys analytic"
    assert f["attention"] >= 0.5 * attention and f["indexer"] > 0  # the work is there, in the right classes


def test_prefill_graph_does_not_grow_with_the_prompt(figures):
    small, large = figures[512]["instructions"], figures[2048]["instructions"]
    assert large <= 1.2 * small, f"{large} instructions at 2048 tokens vs {small} at 512"


if __name__ == "__main__":
    print(json.dumps({s: _figures(s) for s in (512, 2048)}, default=str))
