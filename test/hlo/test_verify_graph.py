"""The speculative verify step's graph (issue 24): NxDI's speculation graph of a build with an EAGLE3 draft
(``speculation_length = k + 1``) against the one-token step of the same build without one, rank 0 of TP 64 / EP 64 /
LNC 2, real M3 widths, bf16, the port's sequence-sharded caches.

Two dry runs (``conftest.dry_run``) with identical arguments (batch 4, cache 4096, one token bucket) of 1 dense + 2
sparse MoE layers, the second with ``--draft DIR --speculative-tokens 3`` (DIR holds only an EAGLE3 draft's
``config.json`` for M3 widths: all a build reads of a draft): T = k + 1 = 4 tokens per row, 16 tokens a step. Three
layers, not two: a draft reads three distinct target states, here the residual streams entering layers 0, 1 and 2.
Every figure is checked against a minimum written out here by hand (M3: head_dim D = index_head_dim = 128, 128-token
blocks, top-16, G = 16 ranks per KV group, one KV head and 16 query heads per group, 8 slots of a block per rank,
hidden 6144, bf16 = 2 bytes):

* weights: the verify step reads each weight once for its 16 tokens: at most 1.05 x the one-token step's weight bytes
  (the issue's target); exactly, 12 more embedding rows of the rank's 6144 / 64 = 96 columns (NxD shards the
  embedding along hidden): 12 x 96 x 2 = 2,304 bytes;
* state bytes, per rank: each row's dense K/V lines and index keys are read once, shared by its 4 queries; each query
  gathers its own 16 selected blocks:

  - dense K/V: 4 rows x 4096/16 slots x D x 2 (K, V) x 2 B = 524,288 (1 dense layer);
  - index-K: 2 sparse layers x 4 rows x 4096/16 x D x 2 B = 524,288;
  - sparse K/V: 2 layers x 16 queries x 16 blocks x 8 slots x D x 2 x 2 B = 2,097,152 (also the gathered K/V);

  target <= 1.1 x, no state copies;
* the collectives of each layer, kind, dtype, shape and bytes, over the 4 KV groups of 16 consecutive ranks: as a
  decode step's, 2 per layer (T = 4 < ``ops.step.ONE_GATHER_TOKENS``: query heads and candidates in ONE
  all-gather), at 16 tokens;
* the draft's target states: one more output after the caches, bf16 ``[4, 4, 3 x 6144]``, aliased to no parameter;
* FLOPs: each of the 16 tokens computed as a one-token step computes its token: the routed experts (NxD's token
  generation runs every token through the rank's 2 experts) 16 x 2 x 6 x 6144 x 3072 x 2 layers, the rest of the
  linear layers 4 x the one-token step's exactly; attention and indexer 4x to 4.05x (each query also scores the
  step's other active tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import REASON, collective_ops, draft_and_target, dry_run

K, B, BUCKET = 3, 4, 4096
T = K + 1
ARGS = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", str(B), "--seq-len", str(BUCKET), "--max-context-len",
        "128", "--context-buckets", "128", "--token-buckets", str(BUCKET)]


def _config():
    from minimax_m3.config import M3Config

    flags = (False, True, True)  # 1 dense + 2 sparse MoE layers
    return M3Config().replace(num_layers=3, moe_layers=flags, sparse_layers=flags)


def _graph(rep: dict, submodel: str) -> dict:
    return next(g for g in rep["graphs"] if (g["submodel"], g["bucket"]) == (submodel, BUCKET))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{"plain": report, "draft": report} of the two dry runs."""
    if REASON:
        pytest.skip(REASON)
    from minimax_m3.graphs import report as graphs

    draft, model = draft_and_target(tmp_path_factory, _config())
    plain = dry_run(model, tmp_path_factory.mktemp("dry") / "plain", ARGS)
    spec = dry_run(model, tmp_path_factory.mktemp("dry") / "draft", ARGS + ["--speculative-tokens", str(K)], draft)
    return {"plain": graphs.analyze_dir(plain, write=False), "draft": graphs.analyze_dir(spec, write=False)}


def test_the_draft_build_has_the_speculation_graph(builds):
    plain, spec = builds["plain"], builds["draft"]
    assert {g["submodel"] for g in plain["graphs"]} == {"context_encoding_model", "token_generation_model"}
    assert {g["submodel"] for g in spec["graphs"]} == {"context_encoding_model", "speculation_model"}
    g = _graph(spec, "speculation_model")
    assert (g["bucket"], g["batch"], g["tokens"]) == (BUCKET, B, T)
    assert _graph(plain, "token_generation_model")["tokens"] == 1
    man = json.loads((Path(spec["dir"]) / "dry_run.json").read_text())
    assert man["speculation_length"] == T and man["aux_hidden_layers"] == [0, 1, 2]
    assert spec["layout"]["kv_layout"] == "sharded" and spec["layout"]["kv_group"] == 16


def test_verify_reads_the_weights_once(builds):
    """The issue's target: a verify step of 4 rows x 4 tokens reads at most 1.05 x a one-token step's weights."""
    one = _graph(builds["plain"], "token_generation_model")["bytes_read"]["weights"]
    verify = _graph(builds["draft"], "speculation_model")["bytes_read"]["weights"]
    assert verify <= 1.05 * one, (verify, one, verify / one)
    assert verify - one == 12 * (6144 // 64) * 2  # the 12 more tokens' embedding rows, nothing else


def test_verify_state_bytes_by_hand(builds):
    g = _graph(builds["draft"], "speculation_model")
    slots = BUCKET // 16
    want = {"kv_dense": B * slots * 128 * 2 * 2, "index_k": 2 * B * slots * 128 * 2,
            "kv_sparse": 2 * B * T * 16 * 8 * 128 * 2 * 2}
    assert want == {"kv_dense": 524288, "index_k": 524288, "kv_sparse": 2097152}
    for kind, n in want.items():
        assert n <= g["bytes_read"][kind] <= 1.1 * n, (kind, g["bytes_read"][kind], n)
    assert g["gathered_kv"] == want["kv_sparse"]
    assert sum(g["state_copies"].values()) == 0 and sum(g["state_copy_bytes"].values()) == 0
    # the planner's minimum (the one formula: planner.decode_minimum_bytes with tokens = k + 1) is the hand one
    assert {k: g["analytic"]["bytes_read"][k] for k in want} == want


def test_verify_collectives_by_hand(builds):
    """16 tokens (4 rows x 4): the embedding all-gather (NxD's embedding is sharded along hidden); per layer the
    KV group's 2: the dense layer gathers its 16 query heads (bf16), each sparse layer packs its query head (f32) and
    the 16 ranks' top-16 (score, id) into ONE all-gather (``128 + 16 x 2`` floats per rank and token), every layer
    one all-to-all of the partial output, max and sum by head (f32 ``[16 ranks, 4, 1 head, 4, 128 + 2]``); the
    attention and MLP all-reduces over the 64 ranks; the logits of every token gathered (vocab padded to 64 x 3126)."""
    n = B * T
    g = _graph(builds["draft"], "speculation_model")
    assert collective_ops(g) == {
        ("all-gather", "bf16", (6144, T, B), 6144 * n * 2, "tp"): 1,
        ("all-gather", "bf16", (16, B, T, 128), 16 * n * 128 * 2, "kv"): 1,  # the dense layer's query heads
        ("all-gather", "f32", (16, B, T, 160), 16 * n * 160 * 4, "kv"): 2,  # query head + top-16, packed
        ("all-to-all", "f32", (16, B, 1, T, 130), 16 * n * 130 * 4, "kv"): 3,
        ("all-reduce", "bf16", (B, T, 6144), n * 6144 * 2, "tp"): 6,  # attention and MLP outputs
        ("all-gather", "bf16", (200064, T, B), n * 200064 * 2, "tp"): 1,
    }
    # as many as the one-token step: 2 per layer in the group, 2 all-reduces, the embedding and the logits
    plain = _graph(builds["plain"], "token_generation_model")
    assert sum(collective_ops(plain).values()) == sum(collective_ops(g).values()) == 14


def test_the_report_lists_the_planners_collectives(builds):
    from minimax_m3.graphs.table import collective_counts

    for rep in builds.values():
        for g in rep["graphs"]:
            counts = collective_counts(g)
            assert counts and all(graph == planner for graph, planner, _ in counts.values()), (g["submodel"], counts)


def test_the_target_states_are_one_more_output(builds):
    from minimax_m3.graphs import hlo_cost, hlo_schema

    def outputs(rep, submodel):
        g = _graph(rep, submodel)
        module = hlo_schema.parse_module((Path(rep["dir"]) / g["hlo"]).read_bytes())
        mod = hlo_cost.Module(module)
        root = mod.get(mod.root)
        return list(root.shape.tuple_shapes), hlo_cost.aliases(module)

    outs, alias = outputs(builds["draft"], "speculation_model")
    aux = outs[-1]
    assert list(aux.dimensions) == [B, T, 3 * 6144] and hlo_cost.dtype_name(aux) == "bf16"
    assert len(alias) == 3 * 2 + 2  # K, V of 3 layers; index-K of the 2 sparse layers
    assert len(outs) - 1 not in alias.values() and max(alias.values()) < len(outs) - 1  # after the caches
    plain, plain_alias = outputs(builds["plain"], "token_generation_model")
    assert len(plain) == len(outs) - 1 and len(plain_alias) == len(alias)


def test_verify_against_the_one_token_step(builds):
    """The figures side by side (docs/results.md): per rank, a verify step of 4 rows x 4 tokens and a one-token step
    of 4 rows."""
    one, verify = _graph(builds["plain"], "token_generation_model"), _graph(builds["draft"], "speculation_model")
    rows = [("weights (B)", one["bytes_read"]["weights"], verify["bytes_read"]["weights"])]
    rows += [(f"{k} (B)", one["bytes_read"][k], verify["bytes_read"][k]) for k in ("kv_dense", "kv_sparse", "index_k")]
    rows += [("gathered K/V (B)", one["gathered_kv"], verify["gathered_kv"]),
             ("dot FLOPs", sum(one["flops"].values()), sum(verify["flops"].values())),
             ("collectives", len(one["collective_ops"]), len(verify["collective_ops"])),
             ("collective bytes", sum(o["bytes"] for o in one["collective_ops"]),
              sum(o["bytes"] for o in verify["collective_ops"])),
             ("HLO instructions", one["instructions"], verify["instructions"])]
    print("\nper rank, batch 4, bucket 4096, 1 dense + 2 sparse MoE layers:  one-token step  verify (k = 3)  ratio")
    for label, a, b in rows:
        print(f"  {label:<18} {a:>16,} {b:>16,} {b / a if a else float('nan'):7.3f}")
    for cls in one["flops"]:
        print(f"  FLOPs {cls:<12} {one['flops'][cls]:>16,} {verify['flops'][cls]:>16,}")
    f1, fv = one["flops"], verify["flops"]
    assert fv["routed_experts"] == B * T * 2 * 6 * 6144 * 3072 * 2 == T * f1["routed_experts"]
    assert fv["rest"] == T * f1["rest"]
    for cls in ("attention", "indexer"):
        assert T * f1[cls] <= fv[cls] <= 1.05 * T * f1[cls], (cls, fv[cls], f1[cls])
