"""The graphs of the sequence-sharded caches (issue 23), rank 0 of TP 64 / EP 64 / LNC 2, real M3 widths, bf16.

Traced by the harness (``conftest.dry_run``: NxDI's ``compile(dry_run=True)`` through NxD's ``ModelBuilder.trace``,
which builds the KV group of ``num_cores_per_group`` = 16 ranks) and read by ``minimax-m3 graphs``. Every target is
checked against a minimum written out here by hand (M3: head_dim D = index_head_dim = 128, 128-token blocks, top-16,
G = 16 ranks per KV head, one KV head and 16 query heads per group, hidden 6144, bf16 = 2 bytes):

* a decode step reads its rank's 1/G of the bucket's lines: per dense layer ``bucket/16 x D x 2 (K, V) x 2`` bytes,
  per sparse layer the 16 selected blocks' ``16 x 128/16 x D x 2 x 2 = 65,536`` bytes and the index keys
  ``bucket/16 x D x 2``; target <= 1.1x;
* a sparse layer's prefill gathers, per query, 16 blocks x 8 keys of K and V for the 16 heads of its group:
  ``T x 65,536`` bytes (= T/16 queries per rank x 1 MiB); target <= 1.5x, and >= 10x less than the replicated layout
  (each rank ``T x 1 MiB`` for its own head) at 8K and 32K;
* the collectives of each layer, kind, dtype, shape and bytes, over the 4 groups of 16 consecutive ranks (2 per
  layer in decode: one all-gather, one all-to-all);
* the context-encoding graph of a chunk C is one graph whatever chunk of a 128K prompt it serves (the same module
  when lowered at the positions of chunk 2 and chunk 16);
* the decode floor at batch 32 / 4K of the 60-layer model, from three traced layer mixes: <= 20 ms bf16, <= 11 ms fp8,
  within 10 % of the planner;
* a prefill call's attention FLOPs <= 1.5x the analytic minimum (the call's own keys read by selected block too).
"""

from __future__ import annotations

import pytest

from .conftest import REASON, collective_ops, dry_run, write_config

TP64 = ["--tp", "64", "--ep", "64", "--lnc", "2"]
LONG = TP64 + ["--batch", "1", "--seq-len", "32768", "--context-buckets", "8192,32768", "--token-buckets", "32768",
                "--prefill-chunk", "32768"]
CHUNK = TP64 + ["--batch", "1", "--seq-len", "131072", "--max-context-len", "8192", "--context-buckets", "8192",
                "--token-buckets", "131072", "--probe-chunks", "1,15"]
DECODE32 = TP64 + ["--batch", "32", "--continuous-batching", "--seq-len", "4096", "--max-context-len", "128",
                   "--context-buckets", "128", "--token-buckets", "4096"]
MS_PER_BYTE = 1e3 / 725e9  # the planner's HBM rate per logical core


def _config(n_dense: int, n_sparse: int):
    from minimax_m3.config import M3Config

    flags = (False,) * n_dense + (True,) * n_sparse
    return M3Config().replace(num_layers=n_dense + n_sparse, moe_layers=flags, sparse_layers=flags)


def _trace(factory, name: str, config, args: list[str]):
    if REASON:
        pytest.skip(REASON)
    from minimax_m3.graphs import report as graphs

    model = write_config(factory.mktemp("cfg") / name, config)
    out = dry_run(model, factory.mktemp("dry") / name, args)
    return graphs.analyze_dir(out, write=False)


def _graph(rep: dict, submodel: str, bucket: int) -> dict:
    return next(g for g in rep["graphs"] if (g["submodel"], g["bucket"]) == (submodel, bucket))


@pytest.fixture(scope="module")
def long(tmp_path_factory):
    """1 dense + 1 sparse MoE layer, cache 32K, prefill buckets 8K and 32K, both layouts."""
    return {lay: _trace(tmp_path_factory, f"long_{lay}", _config(1, 1), LONG + ["--kv-layout", lay])
            for lay in ("sharded", "replicated")}


@pytest.fixture(scope="module")
def m3_report(dry_m3):
    from minimax_m3.graphs import report as graphs

    return graphs.analyze_dir(dry_m3, write=False)


# ---- the KV group and its collectives --------------------------------------------------------------------------
def test_the_layout_is_sharded_over_kv_groups_of_16(long, m3_report):
    for rep in (long["sharded"], m3_report):  # the port's default layout
        assert rep["layout"]["kv_layout"] == "sharded" and rep["layout"]["kv_group"] == 16
    assert long["replicated"]["layout"]["kv_layout"] == "replicated"


def test_collectives_per_layer_by_hand(long):
    """A 8192-token call and a decode step (batch 1) of 1 dense + 1 sparse layer (``ops.step.COLLECTIVES``),
    over the 4 groups of 16 consecutive ranks (rank r with KV head r // 16); the TP all-reduces over all 64 ranks.
    Prefill (a prompt in one call), the sparse layer: the group's 16 query heads all-gathered (bf16), the 16 ranks'
    top-16 (score, id) all-gathered, the partials all-to-all by head (f32 ``[16 ranks, 1, 1 head, T, 128 + 2]``:
    output, max, sum); the dense layer attends the call's own keys on the rank (NxDI's flash kernel): none. Decode:
    the sparse layer packs its query head (f32) and its top-16 into ONE all-gather (``128 + 16 x 2`` floats per
    rank), the dense layer gathers its query head alone; each layer one all-to-all."""
    lm = (200064, 1, 1)  # logits of the last token (vocab padded to 64 x 3126)
    t = 8192
    g = _graph(long["sharded"], "context_encoding_model", t)
    assert collective_ops(g) == {
        ("all-gather", "bf16", (6144, t, 1), 6144 * t * 2, "tp"): 1,  # NxD's embedding is sharded along hidden
        ("all-gather", "bf16", (16, 1, t, 128), 16 * t * 128 * 2, "kv"): 1,  # the group's 16 query heads
        ("all-gather", "f32", (16, 1, 1, t, 16, 2), 16 * t * 16 * 2 * 4, "kv"): 1,  # top-16 (score, id) x 16 ranks
        ("all-to-all", "f32", (16, 1, 1, t, 130), 16 * t * 130 * 4, "kv"): 1,  # partial output, max, sum by head
        ("all-reduce", "bf16", (1, t, 6144), t * 6144 * 2, "tp"): 4,  # attention and MLP outputs
        ("all-gather", "bf16", lm, 200064 * 2, "tp"): 1,
    }
    g = _graph(long["sharded"], "token_generation_model", 32768)
    assert collective_ops(g) == {
        ("all-gather", "bf16", (6144, 1, 1), 6144 * 2, "tp"): 1,
        ("all-gather", "bf16", (16, 1, 1, 128), 16 * 128 * 2, "kv"): 1,  # the dense layer's query heads
        ("all-gather", "f32", (16, 1, 1, 160), 16 * 160 * 4, "kv"): 1,  # query head + top-16 (score, id), packed
        ("all-to-all", "f32", (16, 1, 1, 1, 130), 16 * 130 * 4, "kv"): 2,
        ("all-reduce", "bf16", (1, 1, 6144), 6144 * 2, "tp"): 4,
        ("all-gather", "bf16", lm, 200064 * 2, "tp"): 1,
    }


def test_the_report_lists_the_planners_collectives(long):
    """The report's collective rows: every op of the graph matches a planner row of the same kind, dtype, group and
    bytes, as many times as the planner counts it."""
    from minimax_m3.graphs.table import collective_counts

    for rep in long.values():
        for g in rep["graphs"]:
            counts = collective_counts(g)
            assert counts and all(graph == planner for graph, planner, _ in counts.values()), (g["bucket"], counts)


# ---- decode: each rank reads its 1/G ----------------------------------------------------------------------------
@pytest.mark.parametrize("bucket", [4096, 8192])
def test_decode_reads_its_shard_of_the_caches(m3_report, bucket):
    """4 layers (1 dense + 3 sparse), batch 1: K/V and index-K bytes per step <= 1.1x the sharded minimum."""
    g = _graph(m3_report, "token_generation_model", bucket)
    slots = bucket // 16
    want = {"kv_dense": 1 * slots * 128 * 2 * 2, "kv_sparse": 3 * 16 * 8 * 128 * 2 * 2,
            "index_k": 3 * slots * 128 * 2}
    for kind, n in want.items():
        assert n <= g["bytes_read"][kind] <= 1.1 * n, (kind, g["bytes_read"][kind], n)
    assert g["gathered_kv"] == want["kv_sparse"]
    assert sum(g["state_copies"].values()) == 0


# ---- prefill: one gather per block for the 16 heads of a group --------------------------------------------------
@pytest.mark.parametrize("t", [8192, 32768])
def test_prefill_gathers_each_block_once_per_group(long, t):
    sharded = _graph(long["sharded"], "context_encoding_model", t)["gathered_kv"]  # one sparse layer
    replicated = _graph(long["replicated"], "context_encoding_model", t)["gathered_kv"]
    minimum = t * 16 * 8 * 128 * 2 * 2  # T/16 queries per rank x 1 MiB
    assert minimum <= sharded <= 1.5 * minimum
    assert replicated >= 10 * sharded, (replicated, sharded)


# ---- prefill attention: block-sparse, the call's own keys included (issue 34) --------------------------------------
def test_prefill_attention_reads_only_selected_blocks(long, m3_report):
    """Attention dot FLOPs of a prefill call <= 1.5x the report's analytic minimum (the selected blocks of every
    query, the call's own keys included): an 8K call over 8K lines in 4 layers (1.10x) and a 32K prompt in one call
    (1.01x). Before the call's own keys were gathered by block (ops.step._sparse), 4.97x and 5.46x."""
    for g in (_graph(m3_report, "context_encoding_model", 8192),
              _graph(long["sharded"], "context_encoding_model", 32768)):
        ratio = g["flops"]["attention"] / g["analytic"]["flops"]["attention"]
        assert 1.0 <= ratio <= 1.5, (g["bucket"], ratio)


# ---- the chunk graph ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunk(tmp_path_factory):
    """The context-encoding graph of C = 8192 over 128K cache lines (8,192 slots per rank), lowered again as chunks
    2 and 16 of a 128K prompt."""
    return _trace(tmp_path_factory, "chunk128k", _config(1, 1), CHUNK)


def test_one_graph_serves_every_chunk_of_a_128k_prompt(chunk, long):
    from pathlib import Path

    from minimax_m3.graphs import hlo_cost, hlo_schema

    g = _graph(chunk, "context_encoding_model", 8192)
    # the module lowered with positions 8192.. (chunk 2) and 122880.. (chunk 16) is the same module: one graph, one
    # instruction count; the call's start is data (position_ids), not shape
    assert g["trace_checks"]["same_graph_at_chunks"] == {"1": True, "15": True}
    # over the sharded lines of a 128K cache: 131072 / 16 = 8192 slots per rank
    module = hlo_schema.parse_module((Path(chunk["dir"]) / g["hlo"]).read_bytes())
    params = hlo_cost.entry_parameters(module)
    states = [list(params[p["number"]].dimensions) for p in g["params"] if p["role"] == "state"]
    assert states == [[1, 1, 8192, 128]] * 4 + [[1, 8192, 128]], states  # K, V x 2 layers; index-K
    # it gathers for its 8192 queries whatever the prompt; its instruction count grows with the cache lines only
    # through the dense layer's query tiles (ops.step.TILE_ELEMENTS over 16 heads x the rank's slots)
    assert g["gathered_kv"] == 8192 * 16 * 8 * 128 * 2 * 2
    short = _graph(long["sharded"], "context_encoding_model", 8192)
    print(f"\nC = 8192 context-encoding graph, 1 dense + 1 sparse layer: {g['instructions']} HLO instructions over "
          f"128K lines, {short['instructions']} over 32K lines")


# ---- the decode floor at batch 32 / 4K ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode32(tmp_path_factory):
    """Batch 32 (continuous batching), cache 4K, three layer mixes in bf16 and one in fp8 experts."""
    out = {(d, s, "bf16"): _trace(tmp_path_factory, f"d32_{d}_{s}", _config(d, s), DECODE32)
           for d, s in ((1, 1), (1, 3), (2, 1))}
    out[(1, 3, "fp8")] = _trace(tmp_path_factory, "d32_1_3_fp8", _config(1, 3), DECODE32 + ["--weights", "fp8"])
    return out


def test_decode_floor_at_batch_32_4k(decode32):
    from minimax_m3 import planner as plan
    from minimax_m3.config import M3Config
    from minimax_m3.graphs import layers

    step = {k: _graph(r, "token_generation_model", 4096) for k, r in decode32.items()}
    for k, g in step.items():  # each traced model against the planner's minimum for the same layers
        read, minimum = sum(g["bytes_read"].values()), sum(g["analytic"]["bytes_read"].values())
        assert abs(read / minimum - 1) <= 0.1, (k, read, minimum)
    # 60 layers (3 dense + 57 sparse MoE) from the three bf16 mixes
    terms = layers.fit({(d, s): sum(g["bytes_read"].values()) for (d, s, w), g in step.items() if w == "bf16"})
    bf16 = layers.project(terms, 3, 57)
    # fp8 experts change only the routed experts: per sparse layer 2 local experts x 3 x 6144 x 3072 weights, 2 bytes
    # -> 1 byte + fp32 scales (2 x (2 x 3072 + 6144) x 4)
    saved = 2 * 3 * 6144 * 3072 - 2 * (2 * 3072 + 6144) * 4
    assert sum(step[(1, 3, "bf16")]["bytes_read"].values()) - sum(step[(1, 3, "fp8")]["bytes_read"].values()) \
        == 3 * saved
    fp8 = bf16 - 57 * saved
    m3 = M3Config()
    for graph, weights, target in ((bf16, "bf16", 20.0), (fp8, "fp8", 11.0)):
        ms, planner_ms = graph * MS_PER_BYTE, plan.decode_floor_ms(m3, 64, 64, 32, 4096, weights)
        print(f"\ndecode floor, batch 32 / 4K, {weights}: graph {ms:.2f} ms, planner {planner_ms:.2f} ms")
        assert ms <= target and abs(ms / planner_ms - 1) <= 0.1


# ---- both layouts side by side -------------------------------------------------------------------------------------
def test_the_report_sets_both_layouts_side_by_side(long):
    from minimax_m3.graphs.table import format_report

    text = format_report([long["sharded"], long["replicated"]])
    header = next(line for line in text.splitlines() if "analytic" in line)
    assert header.split() == ["minimax-m3", "(sharded)", "minimax-m3", "(replicated)", "analytic", "sharded",
                              "analytic", "replicated", "minimax-m3", "(sharded)/analytic", "minimax-m3",
                              "(replicated)/analytic"]
    decode = text.split("== token_generation_model  bucket 32768  batch 1 ==")[1].split("==")[0]
    row = next(line for line in decode.splitlines() if line.startswith("bytes read: index-K"))
    assert row.split()[-2:] == ["1.00", "1.00"]  # each layout against its own minimum
