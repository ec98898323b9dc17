"""``minimax-m3 compile --dry-run --route vllm-neuron``: every bucket captured whole, lowered to StableHLO with its
collectives, costed by ``minimax-m3 graphs`` beside the planner's minimum (the independent count). Rank 0 of TP 2 on
the tiny synthetic checkpoint, in a subprocess (the dry run joins torch's ``fake`` process group); M3's real widths
at TP 64 are in docs/results.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch_mlir", reason="torch-mlir is not installed here (scripts/test_vllm_neuron_offdevice.sh)")


def _dry_run(ckpt, out, *extra):
    return subprocess.run([sys.executable, "-m", "minimax_m3.cli", "compile", "--dry-run", "--route", "vllm-neuron",
                           "--model", str(ckpt), "--tp", "2", "--ep", "2", "--max-seq-len", "2048", "--dtype",
                           "bfloat16", "--compiled", str(out), *extra], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path_factory.mktemp("m3") / "tiny", "tiny", seed=0)
    out = tmp_path_factory.mktemp("dry") / "vllm-neuron"
    r = _dry_run(ckpt, out, "--prefill-chunk", "512", "--batch", "2", "--speculative-tokens", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "graphs.json").read_text()), r.stdout


def test_every_bucket_is_written_and_costed(report):
    out, rep, stdout = report
    man = json.loads((out / "dry_run.json").read_text())
    got = sorted((g["submodel"], g["batch"], g["tokens"]) for g in man["graphs"])
    # the plugin's buckets: one 512-token segment; decode batches 1 and 2, each also as a 1 + 2 verify graph
    assert got == [("context_encoding_model", 1, 512), ("speculation_model", 1, 3), ("speculation_model", 2, 3),
                   ("token_generation_model", 1, 1), ("token_generation_model", 2, 1)]
    for g in man["graphs"]:
        text = (out / g["stablehlo"]).read_text()
        assert '"func.func"' in text and text.count('"stablehlo.all_reduce"') == 9
        assert text.count('"stablehlo.all_gather"') == 1 and "m3-collective" not in text.split("#loc = ")[0]
        roles = [p["role"] for p in g["params"]]
        assert roles[:5] == ["input"] * 5 and roles.count("state") == 2 * 4 + 2 * 3  # K/V per layer, 3 index specs
    assert "== token_generation_model  bucket 2048  batch 2 ==" in stdout


def _by_kind(rows) -> dict:
    out: dict = {}
    for r in rows:
        out[r["kind"]] = out.get(r["kind"], 0) + r["count"]
    return out


def test_costs_equal_the_planners_minimum(report):
    _, rep, _ = report
    for g in rep["graphs"]:
        a = g["analytic"]
        kinds = {(c["kind"], c["group_size"]): c["count"] for c in g["collectives"]}
        # per layer an all-reduce after attention and one after the MLP / MoE, one for the embedding (the
        # vocabulary-parallel rows summed), the logits gathered once
        assert kinds == {("all-reduce", 2): 2 * 4 + 1, ("all-gather", 2): 1}
        if g["submodel"] == "context_encoding_model":
            # the last 512-token segment of a 2,048-token prompt: attention over the selected pages only (the segment's
            # own keys included) and the dense layer's causal keys, in a static graph of every page
            assert g["flops"]["attention"] <= 1.5 * a["flops"]["attention"]
            assert g["gathered_kv"] == a["gathered_kv"]
            continue
        # decode and verify: each cache read as the paged minimum (the selected pages of each row, its index keys,
        # the dense layers' pages), no K/V copied
        for kind in ("kv_dense", "kv_sparse", "index_k"):
            assert g["bytes_read"][kind] == a["bytes_read"][kind], (g["submodel"], kind)
        assert g["gathered_kv"] == a["gathered_kv"]
        assert g["state_copies"]["kv_dense"] == g["state_copies"]["kv_sparse"] == g["state_copies"]["index_k"] == 0
        # the planner's count for the paged layout: the same collectives, kind by kind
        assert _by_kind(g["collectives"]) == _by_kind(a["collectives"]), g["submodel"]


def test_bad_buckets_are_one_error(tmp_path):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    r = _dry_run(ckpt, tmp_path / "out", "--prefill-chunk", "300")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "prefill segment (--prefill-chunk) 300:" in r.stderr and "512, 1024, 2048, 4096, 8192" in r.stderr
    r = subprocess.run([sys.executable, "-m", "minimax_m3.cli", "compile", "--route", "vllm-neuron", "--model",
                        str(ckpt)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--dry-run only" in r.stderr and "Traceback" not in r.stderr


def test_issue_33_targets_at_m3_widths(tmp_path):
    """Rank 0 of TP 64 at M3's real widths (1 dense + 1 sparse MoE layer, experts tensor-parallel, the model's
    default), a 64-page table (8,192 tokens), the last 512-token segment and a decode step, against the planner's
    paged minimum: routed experts <= 2x the useful FLOPs, attention <= 1.5x the block-sparse FLOPs (the segment's own
    keys included), the indexer <= 1.1x (its queries split over a KV head's ranks), the planner's collectives,
    decode reads <= 1.1x the paged minimum; static shapes and no host transfer in either module."""
    from minimax_m3.config import M3Config

    cfg = tmp_path / "m3"
    cfg.mkdir()
    c = M3Config().replace(num_layers=2, moe_layers=(False, True), sparse_layers=(False, True))
    (cfg / "config.json").write_text(json.dumps(c.to_release_dict()))
    out = tmp_path / "dry"
    r = subprocess.run([sys.executable, "-m", "minimax_m3.cli", "compile", "--dry-run", "--route", "vllm-neuron",
                        "--model", str(cfg), "--tp", "64", "--max-seq-len", "8192", "--prefill-chunk", "512",
                        "--compiled", str(out)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "graphs.json").read_text())
    for g in rep["graphs"]:
        a = g["analytic"]
        if g["submodel"] == "context_encoding_model":
            assert g["flops"]["routed_experts"] <= 2.0 * a["flops"]["routed_experts"]
            assert g["flops"]["attention"] <= 1.5 * a["flops"]["attention"]
            # the segment's index selection split by query over the 16 ranks of a KV head (ops.QuerySplit): each
            # scores 512 / 16 queries, not all 512 (16x before); one int64 all-gather of the ids per sparse layer
            assert g["flops"]["indexer"] <= 1.1 * a["flops"]["indexer"], (g["flops"], a["flops"])
            assert _by_kind(g["collectives"]) == _by_kind(a["collectives"])
        else:
            for kind in ("kv_dense", "kv_sparse", "index_k"):
                assert g["bytes_read"][kind] <= 1.1 * a["bytes_read"][kind], kind
            assert g["bytes_read"]["weights"] <= 1.1 * a["bytes_read"]["weights"]
    for g in json.loads((out / "dry_run.json").read_text())["graphs"]:
        text = (out / g["stablehlo"]).read_text()
        assert "?x" not in text and "tensor<*" not in text  # static shapes only
        for op in ("send", "recv", "infeed", "outfeed", "custom_call"):  # nothing leaves the device inside a graph
            assert f'"stablehlo.{op}"' not in text, op


def test_fp8_experts_decode_reads_one_byte_per_expert_weight(report, tmp_path):
    """``--weights fp8`` (the plugin's ``quantization: "fp8"``): the same buckets lowered with e4m3 routed experts
    (torch-mlir keeps ``f8E4M3FN``). At decode batch 1 each MoE layer gathers its 2 chosen experts: per expert
    ``3 x 128 x 64`` weights at 1 byte instead of 2, plus the gathered fp32 scales ``(2 x 64 + 128) x 4``, over the 3
    MoE layers; everything else the bf16 build's. The planner's fp8 minimum within 10 %."""
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "fp8"
    r = _dry_run(ckpt, out, "--prefill-chunk", "512", "--batch", "1", "--weights", "fp8")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "graphs.json").read_text())
    assert json.loads((out / "dry_run.json").read_text())["weights"] == "fp8"
    (fp8,) = [g for g in rep["graphs"] if g["submodel"] == "token_generation_model"]
    (bf16,) = [g for g in report[1]["graphs"] if (g["submodel"], g["batch"]) == ("token_generation_model", 1)]
    saved = 3 * 2 * (3 * 128 * 64 * (2 - 1) - (2 * 64 + 128) * 4)
    assert bf16["bytes_read"]["weights"] - fp8["bytes_read"]["weights"] == saved
    a = fp8["analytic"]["bytes_read"]["weights"]
    assert 0.9 * a <= fp8["bytes_read"]["weights"] <= 1.1 * a
    text = (out / json.loads((out / "dry_run.json").read_text())["graphs"][1]["stablehlo"]).read_text()
    assert "f8E4M3FN" in text


def test_on_device_sampling_graphs_end_in_the_draw(report, tmp_path):
    """``--on-device-sampling`` (the plugin's default): every graph takes the runner's ``sampling_params`` (f32
    ``[rows, 3]``, the sixth input) and returns the drawn ids (i32 ``[rows]``) beside the logits, through one
    ``stablehlo.rng`` (a uniform per row) and the candidates' sort; the weights, cache reads and collectives of each
    decode graph are the host-sampling build's. A ``1 + k`` verify graph decides the step on the device: it draws
    at every token and returns the kept tokens (i32 ``[rows, 1 + k]``), the logits at every token and the last
    kept token (i32 ``[rows]``)."""
    from minimax_m3.checkpoint.synthetic import write_synthetic

    host_out, host, _ = report
    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "ods"
    r = _dry_run(ckpt, out, "--prefill-chunk", "512", "--batch", "2", "--speculative-tokens", "2",
                 "--on-device-sampling")
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((out / "dry_run.json").read_text())
    assert man["on_device_sampling"] is True
    rep = json.loads((out / "graphs.json").read_text())
    for g in man["graphs"]:
        assert [p["name"] for p in g["params"][:6]] == ["input_ids", "positions", "slot_mapping", "block_table",
                                                        "sampling_positions", "sampling_params"]
        text = (out / g["stablehlo"]).read_text()
        rows = g["batch"]
        assert text.count('"stablehlo.rng"') == 1
        assert f"tensor<{rows}x3xf32>" in text.split('"func.return"')[0]
        results = text.split('"func.return"')[-1].split(") -> ()")[0]
        if g["submodel"] == "speculation_model":
            assert f"tensor<{rows * 3}x3xf32>" in text  # each row's parameters on each of its tokens
            assert results.rstrip().endswith(f"tensor<{rows}x3xi32>, tensor<{rows * 3}x512xf32>, tensor<{rows}xi32>"), \
                results[-200:]
        else:
            assert results.rstrip().endswith(f"tensor<{rows}xi32>, tensor<{rows}x512xf32>"), results[-200:]
    assert {g["submodel"] for g in man["graphs"]} == {"context_encoding_model", "token_generation_model",
                                                      "speculation_model"}
    hosted = {(g["submodel"], g["batch"]): g for g in host["graphs"]}
    for g in rep["graphs"]:
        if g["submodel"] != "token_generation_model":
            continue
        h = hosted[(g["submodel"], g["batch"])]
        assert g["bytes_read"] == h["bytes_read"] and g["collectives"] == h["collectives"], g["batch"]
    host_man = json.loads((host_out / "dry_run.json").read_text())
    assert not any('"stablehlo.rng"' in (host_out / g["stablehlo"]).read_text() for g in host_man["graphs"])


def test_decode_context_parallel_graphs_read_the_planners_minimum(tmp_path):
    """``--dcp 2`` at TP 4 (each of the tiny model's 2 KV heads on 2 ranks, their pages dealt by block): rank 0's
    graphs, costed beside the planner's minimum for the paged layout with DCP. Decode reads the rank's own half of the
    dense layers' pages and index keys, and the selected pages of every row (gathered whole, the other rank's
    masked: not reduced by DCP); its collectives are the planner's kind by kind, the step's all-gather and
    all-to-all per layer over the 2 DCP ranks among them."""
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "dcp"
    r = subprocess.run([sys.executable, "-m", "minimax_m3.cli", "compile", "--dry-run", "--route", "vllm-neuron",
                        "--model", str(ckpt), "--tp", "4", "--ep", "1", "--dcp", "2", "--max-seq-len", "2048",
                        "--dtype", "bfloat16", "--prefill-chunk", "512", "--batch", "2", "--compiled", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "graphs.json").read_text())
    man = json.loads((out / "dry_run.json").read_text())
    assert man["layout"]["dcp"] == 2 and man["max_length"] == 2048
    for g in rep["graphs"]:
        a = g["analytic"]
        assert "error" not in a, a
        kinds = {(c["kind"], c["group_size"]) for c in g["collectives"]}
        assert ("all-to-all", 2) in kinds, g["submodel"]
        if g["submodel"] == "context_encoding_model":
            assert g["gathered_kv"] == a["gathered_kv"]
            continue
        for kind in ("kv_dense", "kv_sparse", "index_k"):
            assert g["bytes_read"][kind] == a["bytes_read"][kind], (g["submodel"], kind)
        assert _by_kind(g["collectives"]) == _by_kind(a["collectives"]), g["submodel"]
    bad = subprocess.run([sys.executable, "-m", "minimax_m3.cli", "compile", "--dry-run", "--route", "vllm-neuron",
                          "--model", str(ckpt), "--tp", "4", "--dcp", "4", "--max-seq-len", "2048",
                          "--compiled", str(tmp_path / "bad")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "use one of [1, 2]" in bad.stderr and "Traceback" not in bad.stderr
