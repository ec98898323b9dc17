"""The planner models the query tile the port's attention really runs: a prefill through the NxDI port in CPU mode
(replicated caches, a prompt in one call) records the tile each attention layer hands to ``ops.attention_step``, and
``minimax-m3 plan`` must name the same one for that bucket (hand values: the tiny model's 16-token blocks, 8 tiles per
call)."""

import pytest

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("chunk") / "tiny", M3Config.preset("tiny"), seed=0))


@pytest.mark.parametrize("prompt, bucket, tile", [(100, 128, 16), (300, 512, 64)])
def test_the_planner_names_the_tile_the_port_runs(ckpt, monkeypatch, prompt, bucket, tile):
    from minimax_m3 import ops
    from minimax_m3.load import load_engine
    from minimax_m3.planner import plan

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    seen = []
    step = ops.attention_step

    def spy(q, *args, **kw):
        if q.shape[2] > 1:  # context encoding (decode steps carry one token per row)
            seen.append((q.shape[2], kw.get("tile")))
        return step(q, *args, **kw)

    monkeypatch.setattr(ops, "attention_step", spy)
    kw = neuron_cpu_engine_kwargs(batch_size=1, max_seq_len=512)
    eng = load_engine(ckpt, backend="neuron-cpu", **kw)
    eng.generate([random_ids(prompt, seed=3)], GenerationConfig(max_new_tokens=1))
    c = M3Config.preset("tiny")
    assert seen and set(seen) == {(bucket, tile)}, seen  # every layer: the bucket's length, one tile size
    tp = kw["tp_degree"]
    # the query tile of a one-call prefill: the replicated layout's (what the port runs when a KV head has one rank)
    assert plan(c, tp, tp, batch=1, seq=bucket, layout="replicated").chunk == tile  # 8 tiles of 16-token blocks
