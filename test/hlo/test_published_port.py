"""The published community port (NxDI ``contrib/models/MiniMax-M3``) traced by the same harness at the same shapes, and
``minimax-m3 graphs`` putting both ports side by side (issue 13, item 5).

Needs ``M3_CONTRIB_SRC`` (its ``src/`` folder in an NxDI checkout) besides the NxDI/NxD sources; skipped with one line
otherwise. Shape: M3's head and expert counts at tiny widths (index head dim 64: the published port shards its index
projections over TP, so the index-key width must divide by 64), batch 32 (it cannot decode at batch < 32 with expert
parallelism), cache 1024, prefill bucket 512, decode buckets 512 and 1024, TP 64 / EP 64 / LNC 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test.hlo.conftest import run_module, write_config

SHAPE = ["--tp", "64", "--ep", "64", "--lnc", "2", "--batch", "32", "--seq-len", "1024", "--context-buckets", "512",
         "--token-buckets", "512,1024"]


@pytest.fixture(scope="module")
def both_ports(tmp_path_factory):
    if not (Path(os.environ.get("M3_CONTRIB_SRC", "")) / "modeling_minimax_m3.py").is_file():
        pytest.skip("side-by-side with the published port: set M3_CONTRIB_SRC to contrib/models/MiniMax-M3/src of an "
                    "NxDI checkout")
    from test.support.hlo.nxd_shard_tp64 import narrow_config

    model = write_config(tmp_path_factory.mktemp("cfg") / "m3heads", narrow_config().replace(index_head_dim=64))
    ours, theirs = tmp_path_factory.mktemp("ours") / "d", tmp_path_factory.mktemp("contrib") / "d"
    run_module("test.support.hlo.dry_run", "--model", str(model), "--compiled", str(ours), *SHAPE)
    run_module("test.support.hlo.contrib_dry_run", "--model", str(model), "--compiled", str(theirs), *SHAPE)
    return ours, theirs


def test_graphs_prints_both_ports_side_by_side(both_ports):
    from minimax_m3.cli import main

    ours, theirs = both_ports
    assert main(["graphs", str(ours), str(theirs)]) == 0
    from minimax_m3.graphs import report as graphs

    reports = [graphs.analyze_dir(d, write=False) for d in both_ports]
    text = graphs.format_report(reports)
    assert "minimax-m3" in text and "contrib" in text
    keys = [{(g["submodel"], g["bucket"]) for g in r["graphs"]} for r in reports]
    assert keys[0] == keys[1] == {("context_encoding_model", 512), ("token_generation_model", 512),
                                  ("token_generation_model", 1024)}


def test_only_our_decode_uses_the_indexer(both_ports):
    """The published port's sparse attention does not take effect in decode (no index-K cache, no index scores);
    ours reads the index-K up to the bucket, as the analytic minimum says."""
    from minimax_m3.graphs import report as graphs

    ours, theirs = (graphs.analyze_dir(d, write=False) for d in both_ports)
    for a, b in zip(ours["graphs"], theirs["graphs"]):
        if a["submodel"] != "token_generation_model":
            continue
        assert a["flops"]["indexer"] > 0 and b["flops"]["indexer"] == 0
        assert b["bytes_read"]["index_k"] == 0
        want = a["analytic"]["bytes_read"]["index_k"]
        assert abs(a["bytes_read"]["index_k"] - want) <= 0.1 * want
