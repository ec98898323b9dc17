"""``compile --dry-run --route vllm-neuron`` without torch-mlir: the plugin's buckets (docs/notes/vllm_neuron_runner.md,
"Buckets") and the start-up errors, each one line naming the option (the lowering itself: test/vllm_neuron)."""

from __future__ import annotations

import pytest

from minimax_m3.cli import main
from minimax_m3.config import M3Config
from minimax_m3.vllm_neuron.capture import Bucket
from minimax_m3.vllm_neuron.dry_run import DryRunError, buckets

M3 = M3Config()


def test_the_plugins_buckets():
    # one segment size; decode batches 1, 2, 4 up to max_num_seqs (5: 1, 2, 4, 5), each with its 1 + K verify graph;
    # every graph over a cdiv(max_model_len, 128)-page table
    got = buckets(M3, 10_000, 5, 2048, drafts=3)
    w = -(-10_000 // 128)
    assert got == [Bucket("prefill", 2048, w)] + [b for n in (1, 2, 4, 5) for b in (
        Bucket("decode", 1, w, batch=n), Bucket("decode", 4, w, batch=n))]
    # without a segment: 8,192 tokens, or the whole context when shorter
    assert buckets(M3, 4096, 1, None)[0] == Bucket("prefill", 4096, 32)


@pytest.mark.parametrize("seq, seg", [(32768, 300), (32768, 16384), (20000, 20000)])
def test_a_segment_the_plugin_does_not_compile_is_refused(seq, seg):
    with pytest.raises(DryRunError, match=rf"prefill segment \(--prefill-chunk\) {seg}: .*512, 1024, 2048, 4096, 8192"):
        buckets(M3, seq, 1, seg)


def test_bad_options_are_one_error(capsys, tmp_path):
    rc = main(["compile", "--dry-run", "--route", "vllm-neuron", "--model", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"--model {tmp_path / 'none'}: a directory with config.json" in err
    rc = main(["compile", "--route", "vllm-neuron", "--model", str(tmp_path)])
    assert rc == 2 and "--route vllm-neuron builds graphs with --dry-run only" in capsys.readouterr().err
