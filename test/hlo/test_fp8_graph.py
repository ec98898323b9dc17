"""A ``--weights fp8`` build's token-generation graph reads what ``minimax-m3 plan --weights fp8`` says (issue 15,
item 5): the tiny synthetic model at TP 1, bf16, traced through NxDI's compile path with NxD's quantized routed
experts (e4m3 weights read one byte each, fp32 scales), counted by ``neuron.graphs`` against the planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import REASON, dry_run

FP8 = ["--tp", "1", "--ep", "1", "--lnc", "1", "--batch", "1", "--seq-len", "256", "--context-buckets", "256",
       "--token-buckets", "256", "--dtype", "bfloat16", "--weights", "fp8"]


@pytest.fixture(scope="module")
def dry_fp8(tiny_ckpt, tmp_path_factory):
    if REASON:
        pytest.skip(REASON)
    return dry_run(Path(tiny_ckpt), tmp_path_factory.mktemp("dry") / "fp8", FP8)


def test_fp8_decode_reads_one_byte_per_expert_weight(dry_fp8, tiny_ckpt):
    from minimax_m3.config import M3Config
    from minimax_m3.graphs import report as graphs
    from minimax_m3 import planner as plan

    report = graphs.analyze_dir(dry_fp8, write=False)
    (tkg,) = [g for g in report["graphs"] if g["submodel"] == "token_generation_model"]
    read = tkg["bytes_read"]["weights"]
    c = M3Config.from_pretrained(tiny_ckpt)
    fp8 = plan.decode_minimum_bytes(c, 1, 1, 1, 256, "fp8")["weights"]
    bf16 = plan.decode_minimum_bytes(c, 1, 1, 1, 256, "bf16")["weights"]
    assert tkg["analytic"]["bytes_read"]["weights"] == fp8  # the report grades the build against its own format
    assert 0.95 * fp8 <= read <= 1.05 * fp8, (read, fp8)
    # the saving is the routed experts': 3 MoE layers x top-2 x 3 x 128 x 64 weights, 2 bytes -> 1 byte + scales
    saved = 3 * 2 * 3 * 128 * 64 - 3 * 2 * (2 * 64 + 128) * 4
    assert bf16 - fp8 == saved and read <= bf16 - 0.9 * saved
