"""``--decode-experts tp`` on the graph (issue 34 item 3): rank 0 of TP 64 / EP 64 / LNC 2, real M3 widths, fp8
experts, 1 dense + 1 sparse MoE layer, batch 1, cache 4K, traced by the harness beside the same build without the
copy and read by ``minimax-m3 graphs``.

By hand (hidden H = 6144, expert width I = 3072, 128 experts, top 4; fp8: one byte per weight and fp32 scales per
output channel, gate/up ``2 x I / moe_tp`` and down ``H`` per expert):

* without the copy (EP 64) a decode step reads both local experts whole: ``2 x (3 x H x I + (2 x I + H) x 6)``
  (scales fp32, biases bf16);
* with it, the 4 selected experts' 1/64 slices of the decode copy (NxD's selective loading gathers
  ``weight[expert_index]``): ``4 x (3 x H x I / 64 + (2 x I / 64 + H) x 6)``; the rest of the step is unchanged;
* the same collectives (the MoE's output is one all-reduce either way) and the same prefill graph (prefill keeps
  the expert-parallel shards).
"""

from __future__ import annotations

import pytest

from .conftest import REASON, collective_ops, dry_run, write_config

ARGS = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", "1", "--seq-len", "4096", "--max-context-len", "128",
        "--context-buckets", "128", "--token-buckets", "4096", "--weights", "fp8"]
H, INTER, TP = 6144, 3072, 64


def _expert(i: int) -> int:
    """Bytes of one fp8 expert whose intermediate width is ``i``: weights, fp32 scales and bf16 biases (gate/up
    ``2 x i``, down ``H``)."""
    return 3 * H * i + (2 * i + H) * 4 + (2 * i + H) * 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    from minimax_m3.config import M3Config
    from minimax_m3.graphs import report as graphs

    flags = (False, True)
    model = write_config(tmp_path_factory.mktemp("cfg") / "m3_1_1",
                         M3Config().replace(num_layers=2, moe_layers=flags, sparse_layers=flags))
    out = {}
    for mode in ("ep", "tp"):
        d = dry_run(model, tmp_path_factory.mktemp("dry") / f"experts_{mode}", ARGS + ["--decode-experts", mode])
        out[mode] = graphs.analyze_dir(d, write=False)
    return out


def _graph(rep: dict, submodel: str) -> dict:
    (g,) = [g for g in rep["graphs"] if g["submodel"] == submodel]
    return g


def test_decode_reads_the_selected_experts_slices_of_the_copy(reports):
    ep, tp = (_graph(reports[m], "token_generation_model") for m in ("ep", "tp"))
    assert reports["tp"]["layout"]["decode_experts"] == "tp" and reports["ep"]["layout"]["decode_experts"] == "ep"
    w_ep, w_tp = ep["bytes_read"]["weights"], tp["bytes_read"]["weights"]
    hand = 2 * _expert(INTER) - 4 * _expert(INTER // TP)  # one sparse MoE layer
    assert abs((w_ep - w_tp) - hand) <= 16, (w_ep - w_tp, hand)  # and a few bytes of expert ids
    for g in (ep, tp):  # each against the planner's minimum of its own build (the copy read at ep 1)
        minimum = g["analytic"]["bytes_read"]["weights"]
        assert abs(g["bytes_read"]["weights"] / minimum - 1) <= 0.01, (g["bytes_read"], minimum)
    assert collective_ops(ep) == collective_ops(tp)
    print(f"\ndecode step, 1 dense + 1 sparse MoE layer, fp8, batch 1 / 4K: weights read {w_ep / 1e6:.2f} MB -> "
          f"{w_tp / 1e6:.2f} MB with the decode copy ({tp['instructions']} HLO instructions, was "
          f"{ep['instructions']})")


def test_prefill_keeps_the_expert_parallel_shards(reports):
    ep, tp = (_graph(reports[m], "context_encoding_model") for m in ("ep", "tp"))
    assert ep["flops"] == tp["flops"] and collective_ops(ep) == collective_ops(tp)
    assert ep["bytes_read"]["weights"] == tp["bytes_read"]["weights"]
