"""The vLLM Neuron model under decode context parallelism captured as the plugin compiles it: rank 1 of TP 4 with
``decode_context_parallel_size`` 2 (its DCP group ranks 0-1, a sub-group of torch's ``fake`` process group), whose
pages hold every other block of each request (``ops.paged.slot_mapping``'s DCP rule; a segment's slots cut to the
rank's blocks). One graph per bucket, no recompile across positions and block tables, and the block-interleaved
step's collectives in it, counted by hand: per attention layer one all-gather (decode: the query heads and the
candidates packed; a prefill segment's sparse layer: the query heads, then the candidates) and one all-to-all."""

from __future__ import annotations

import pytest
import torch

from minimax_m3.config.m3 import M3Config
from minimax_m3.vllm_neuron.capture import Bucket, CaptureError, capture, rank_model

TINY = M3Config.preset("tiny")  # 2 KV heads: at TP 4 each is held by 2 ranks, one DCP group of 2


@pytest.fixture(scope="module")
def rank1():
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left a process group behind"
    yield rank_model(TINY, world=4, rank=1, ep=1, dtype=torch.float32, num_blocks=96, dcp=2)
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket, starts", [
    (Bucket("prefill", 64, 16), (0, 64, 128)),  # segments on laps of 2 blocks: from 0, after 64 and 128 tokens
    (Bucket("decode", 1, 16, batch=4), (40, 200)),  # decode rows at other positions (either rank's blocks)
])
def test_one_graph_per_bucket_with_the_dcp_collectives(rank1, bucket, starts):
    cap = capture(rank1, bucket, starts)
    assert len(cap.graphs) == 1
    layers, sparse = TINY.num_layers, sum(TINY.sparse_layers)
    coll = cap.collectives()
    gathers = layers if bucket.kind == "decode" else layers + sparse
    assert coll.get("all_reduce") == 2 * layers + 1  # TP: after attention, after the MLP, the embedding
    assert coll.get("all_gather_into_tensor") == 1 + gathers  # the logits, then the step's
    assert coll.get("all_to_all_single") == layers


def test_a_dcp_size_that_splits_no_kv_head_is_refused():
    with pytest.raises(CaptureError, match=r"use one of \[1, 2\]"):
        rank_model(TINY, world=4, rank=0, dcp=4)


def test_stablehlo_of_a_dcp_decode_step(rank1):
    """The DCP rank's decode step lowers whole to StableHLO: the step's exchange as ``stablehlo.all_to_all`` (split
    and concatenated along dim 0 over the 2 ranks), one per layer, beside the all-gathers and all-reduces."""
    pytest.importorskip("torch_mlir", reason="torch-mlir is not installed here (scripts/test_vllm_neuron_offdevice.sh)")
    from minimax_m3.graphs.stablehlo import to_hlo
    from minimax_m3.vllm_neuron.capture import lower

    low = lower(rank1, Bucket("decode", 1, 16, batch=2))
    assert low.text.count('"stablehlo.all_to_all"') == TINY.num_layers
    assert "split_count = 2 : i64" in low.text
    kinds = [i.opcode for c in to_hlo(low.text, low.aliases).computations for i in c.instructions]
    assert kinds.count("all-to-all") == TINY.num_layers
