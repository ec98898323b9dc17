"""On-device sampling in the traced graphs (``neuron.sampling``; tiny checkpoint, TP 1, batch 2, buckets 128/256).

Every context-encoding and token-generation graph's first output is the sampled token ids, int32, one per row (the
logits output only with ``output_logits``); the sampling params input is ``[B, 5]`` (NxDI's three columns and the
seed words); the graphs hold no ``rng`` instruction (the draw is the seeded hash, not a device RNG). The same build
without on-device sampling returns fp32 logits ``[B, 1, V]`` instead (the figure the report compares).
"""

import json

import pytest

from .conftest import run_module

VOCAB = 512


def _graphs(ckpt, out, *flags):
    stdout, _ = run_module("test.support.hlo.sampling_graph_dry_run", str(ckpt), str(out), *flags)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def _topk_standin():
    from test.support.hlo import scribe

    if not hasattr(scribe, "TopK"):
        pytest.skip("the trace stand-ins have no TopK (torch_neuronx.xla_impl.ops.TopK, NxD's distributed top-k)")


def test_graphs_return_token_ids(tiny_ckpt, tmp_path, _topk_standin):
    graphs = _graphs(tiny_ckpt, tmp_path / "sampled")
    assert {(g["submodel"], g["bucket"]) for g in graphs} == {
        (m, b) for m in ("context_encoding_model", "token_generation_model") for b in (128, 256)}
    for g in graphs:
        batch = 2 if g["submodel"] == "token_generation_model" else 1  # continuous batching: one prefill per call
        assert g["outputs"][0] == f"s32[{batch}]", g
        assert g["inputs"]["input4"] == f"f32[{batch}, 5]", g
        assert g["rng_ops"] == 0, g
        assert not any(o.startswith("f32") and o.endswith(f", {VOCAB}]") for o in g["outputs"]), g


def test_logits_only_on_request(tiny_ckpt, tmp_path, _topk_standin):
    with_logits = _graphs(tiny_ckpt, tmp_path / "logits", "--output-logits")
    plain = _graphs(tiny_ckpt, tmp_path / "plain", "--no-sampling")
    for g in with_logits:
        batch = 2 if g["submodel"] == "token_generation_model" else 1
        assert g["outputs"][:2] == [f"s32[{batch}]", f"f32[{batch}, 1, {VOCAB}]"], g
    for g in plain:
        batch = 2 if g["submodel"] == "token_generation_model" else 1
        assert g["outputs"][0] == f"f32[{batch}, 1, {VOCAB}]", g
