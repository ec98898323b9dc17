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

The copy on NxDI's GQA copies of the caches (``--kv-layout replicated``, the planner's fastest batch-1 build): the
same weights read, none of the KV group's collectives (per layer the attention and MoE all-reduces only: 2 x 2 + 2
for these two layers, where the sharded caches run 4 x 2 + 2), and each decode query's selected K/V read whole on
the rank, 16x the sharded layout's share.
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
    for name, extra in (("ep", []), ("tp", []), ("tp_replicated", ["--kv-layout", "replicated"])):
        mode = name.split("_")[0]
        d = dry_run(model, tmp_path_factory.mktemp("dry") / f"experts_{name}",
                    ARGS + ["--decode-experts", mode] + extra)
        out[name] = graphs.analyze_dir(d, write=False)
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


def test_the_copy_on_replicated_caches_runs_two_collectives_per_layer(reports):
    sharded, rep = (_graph(reports[m], "token_generation_model") for m in ("tp", "tp_replicated"))
    assert reports["tp_replicated"]["layout"]["kv_layout"] == "replicated"
    assert reports["tp_replicated"]["layout"]["decode_experts"] == "tp"
    assert abs(rep["bytes_read"]["weights"] - sharded["bytes_read"]["weights"]) <= 16
    minimum = rep["analytic"]["bytes_read"]["weights"]
    assert abs(rep["bytes_read"]["weights"] / minimum - 1) <= 0.01, (rep["bytes_read"], minimum)
    ops_rep, ops_sharded = collective_ops(rep), collective_ops(sharded)
    assert sum(ops_rep.values()) == 2 * 2 + 2 and sum(ops_sharded.values()) == 4 * 2 + 2, (ops_rep, ops_sharded)
    assert not [k for k in ops_rep if k[-1] == "kv"]
    assert sum(n for k, n in ops_sharded.items() if k[-1] == "kv") == 2 * 2
    assert sum(r["count"] for r in rep["analytic"]["collectives"]) == sum(ops_rep.values())
    # the sparse layer's selected K/V: the whole 2,048 keys on the rank against 1/16 of them
    assert rep["gathered_kv"] == 16 * sharded["gathered_kv"] > 0, (rep["gathered_kv"], sharded["gathered_kv"])
    print(f"\ndecode step with the copy, replicated caches: {sum(ops_rep.values())} collectives (sharded "
          f"{sum(ops_sharded.values())}), weights read {rep['bytes_read']['weights'] / 1e6:.2f} MB, gathered K/V "
          f"{rep['gathered_kv'] / 1024:.0f} KiB (sharded {sharded['gathered_kv'] / 1024:.0f} KiB)")
