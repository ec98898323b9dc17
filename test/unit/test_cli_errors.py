"""Every command on bad input: exit code 2 and the problem (with its fix) on stderr, never a traceback. The CLI maps
the package's one error base class (``M3Error``) once; these run ``main`` in-process, so any other exception would
escape and fail the test."""

import json
import shutil

import pytest

from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.cli import main
from minimax_m3.config import M3Config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("cli-errors") / "tiny", M3Config.preset("tiny"), seed=0)


def _fails(capsys, argv, *messages):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for m in messages:
        assert m in err, err
    return err


def test_generate_on_a_truncated_shard(ckpt, tmp_path, capsys):
    bad = tmp_path / "truncated"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _fails(capsys, ["generate", "--model", str(bad), "--prompt-ids", "1,2", "--device", "cpu"],
           "minimax-m3 generate: error:", shard.name)


def test_golden_on_a_malformed_config(ckpt, tmp_path, capsys):
    bad = tmp_path / "badconfig"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text("{not json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    _fails(capsys, ["golden", "--model", str(bad), "--prompts", str(prompts), "--out", str(tmp_path / "g.st")],
           "minimax-m3 golden: error:", "config.json")


def test_longbench_unknown_task(ckpt, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    _fails(capsys, ["longbench", "--model", str(ckpt), "--data", str(tmp_path / "data"), "--tasks", "nosuchtask",
                    "--out", str(tmp_path / "out"), "--device", "cpu"], "minimax-m3 longbench: error:", "nosuchtask")


def test_generate_prompt_too_long(ckpt, capsys):
    _fails(capsys, ["generate", "--model", str(ckpt), "--prompt-ids", ",".join(["5"] * 20), "--max-seq-len", "16",
                    "--device", "cpu"], "prompt 0 has 20 tokens", "--max-context-len")


def test_a_spec_the_backend_cannot_run_lists_every_problem(ckpt, capsys):
    err = _fails(capsys, ["generate", "--model", str(ckpt), "--prompt-ids", "1", "--tp", "3", "--lnc", "2",
                          "--context-buckets", "128"], "engine spec (--backend reference): 9 problem(s)")
    assert "lnc applies to the neuron backend only" in err and "tp 3 does not divide the 8 attention heads" in err
    _fails(capsys, ["compile", "--backend", "reference", "--model", str(ckpt)],
           "compile builds the neuron backends (--backend neuron or neuron-cpu), not reference")


def test_a_trn2_build_that_does_not_fit_is_refused_before_any_compile(tmp_path, capsys):
    """``compile --backend neuron`` at M3's widths: 64 sequences of 1M tokens need more HBM than a rank has (the
    planner: 2.77 GiB of sharded caches per sequence and rank at 1M); refused with the largest batch and context
    that fit, before the Neuron SDK is imported (it is not installed here). The same build at batch 1 passes this
    check and stops only at the missing SDK."""
    m3 = tmp_path / "m3"
    m3.mkdir()
    (m3 / "config.json").write_text(json.dumps(M3Config.preset("m3").to_release_dict()))
    argv = ["compile", "--model", str(m3), "--max-seq-len", "1048576", "--max-context-len", "1048576",
            "--prefill-chunk", "8192", "--weights", "fp8"]
    err = _fails(capsys, argv + ["--batch", "64"], "batch 64 x 1048576 tokens (sharded caches, prefill calls of 8192",
                 "largest batch at 1048576 tokens: ")
    assert "largest context at batch 64" in err
    err = _fails(capsys, argv + ["--batch", "1"])
    assert "largest batch" not in err and "Neuron SDK" in err
