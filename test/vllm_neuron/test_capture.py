"""The vLLM Neuron model captured as the plugin compiles it (``minimax_m3.vllm_neuron.capture``): ``torch.compile``
with ``fullgraph=True, dynamic=False``, one graph per bucket, and no recompile within a bucket across positions,
prompt segments after cached tokens and other block tables (``fail_on_recompile``). One rank of a tensor-parallel
group on torch's ``fake`` process group: the collectives are in the graph as ops.

Runs where torch's Dynamo does (any torch >= 2.9); tiny widths here, the real widths in ``docs/results.md``."""

from __future__ import annotations

import pytest
import torch

from minimax_m3.config.m3 import M3Config
from minimax_m3.vllm_neuron.capture import Bucket, CaptureError, capture, rank_model

TINY = M3Config.preset("tiny")  # 16-token blocks, top-2: a 64-block table selects


@pytest.fixture(scope="module")
def rank0():
    """Rank 0 of TP 2 on torch's fake process group, torn down after this module (the suite shares the process)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left a process group behind"
    yield rank_model(TINY, world=2, rank=0, ep=2, dtype=torch.float32, num_blocks=96)
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket, starts", [
    (Bucket("prefill", 64, 16), (0, 48, 130)),  # a prompt from 0, segments after 48 and 130 cached tokens
    (Bucket("decode", 1, 16, batch=4), (40, 200)),  # decode rows at other positions
    (Bucket("decode", 4, 16, batch=2), (33,)),  # a verify step of 1 + 3 drafts
])
def test_one_graph_per_bucket_no_recompile(rank0, bucket, starts):
    cap = capture(rank0, bucket, starts)
    assert len(cap.graphs) == 1
    # rank 0 of TP 2: per layer one all-reduce after attention and one after the MLP, one for the embedding, and the
    # vocabulary-parallel logits gathered once
    coll = cap.collectives()
    assert coll.get("all_reduce") == 2 * TINY.num_layers + 1 and coll.get("all_gather_into_tensor") == 1


def test_a_graph_break_is_named_with_its_line(rank0, monkeypatch):
    """A host read inside the forward (what a model change might add) fails the capture, naming the call and line."""
    layer = rank0.m3.layers[1].moe

    def host_read(x, *a, **k):
        if x.sum().item() > 0:  # data-dependent branch: a graph break
            return x
        return x

    monkeypatch.setattr(layer.shared, "forward", host_read)
    # Dynamo stops at the .item() (a graph break) or, where scalar outputs are captured (seen in the vLLM 0.24
    # environment), at the branch on its value (a data-dependent guard): either way the error names this line
    with pytest.raises(CaptureError, match=r"(?s)item\(\).*test_capture.py.*x.sum\(\).item\(\)"):
        capture(rank0, Bucket("decode", 1, 16, batch=1))


def test_stablehlo_of_a_prefill_segment_and_a_decode_step():
    """torch.export → torch-mlir → StableHLO, the module neuronx-cc receives on the plugin's native route: the
    whole forward lowers (matmuls as dot_general, the page writes as scatter, the selected pages as gather)."""
    pytest.importorskip("torch_mlir", reason="torch-mlir is not installed here (scripts/test_vllm_neuron_offdevice.sh)")
    from minimax_m3.vllm_neuron.capture import stablehlo

    model = rank_model(TINY, dtype=torch.float32, num_blocks=40)
    for bucket in (Bucket("prefill", 64, 16), Bucket("decode", 1, 16, batch=2)):
        text = stablehlo(model, bucket)
        assert '"func.func"' in text and 'sym_name = "main"' in text  # generic form, with debug locations
        assert text.count('"stablehlo.dot_general"') >= 4 * TINY.num_layers
        assert '"stablehlo.scatter"' in text and '"stablehlo.gather"' in text
