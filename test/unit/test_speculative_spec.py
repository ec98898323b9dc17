"""The engine spec's draft fields and the commands that build a speculating engine: ``--draft DIR
--speculative-tokens K`` (default 3), refused where it cannot run (reference tp > 1, K < 1, K
without a draft) in the one SpecError, and ``generate`` reporting the acceptance statistics."""

import json

import pytest

from minimax_m3.checkpoint.draft import write_synthetic_draft
from minimax_m3.cli import build_parser, main
from minimax_m3.config import M3Config
from minimax_m3.engine.spec import EngineSpec, SpecError, spec_from_args

TINY = M3Config.preset("tiny")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_draft_fields_default_and_problems(monkeypatch):
    assert EngineSpec("m", device="cpu", draft="d").resolve(TINY).num_speculative_tokens == 3
    assert EngineSpec("m", device="cpu").resolve(TINY).num_speculative_tokens is None
    assert EngineSpec("m", device="cpu", draft="d", num_speculative_tokens=5).validate(TINY).num_speculative_tokens == 5
    for backend in ("neuron", "neuron-cpu"):  # the neuron backends verify on the device, with or without sampling
        for odsc in (False, True):
            spec = EngineSpec("m", backend=backend, draft="d", on_device_sampling=odsc)
            assert not [p for p in spec.problems(TINY) if "draft" in p or "speculat" in p]
    assert EngineSpec("m", device="cpu", num_speculative_tokens=2).problems(TINY) == [
        "num_speculative_tokens (--speculative-tokens) applies with a draft: add --draft DIR"]
    assert EngineSpec("m", device="cpu", draft="d", num_speculative_tokens=0).problems(TINY) == [
        "num_speculative_tokens (--speculative-tokens) must be >= 1, got 0"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SpecError, match="a draft with reference tp 2: not yet"):
        EngineSpec("m", device="cpu", draft="d").validate(TINY)


def test_fused_speculation_is_the_neuron_backends_with_on_device_sampling():
    """``--fused-speculation`` (NxDI's fused EAGLE3 speculation): a neuron backend, a draft and on-device sampling,
    each missing one named in the one SpecError; CPU mode then defaults to last-position prefill (the fused graph
    returns token ids only). A prefill chunk below the longest prompt is no problem (the draft prefills in calls)."""
    ok = EngineSpec("m", backend="neuron-cpu", draft="d", fused_speculation=True, on_device_sampling=True,
                    max_seq_len=256, max_context_len=128, prefill_chunk=128)
    def fused(spec):  # (without the SDK here, CPU mode's own "needs NxD Inference importable" is listed too)
        return [p for p in spec.problems(TINY) if "fused" in p]

    assert fused(ok) == [] and ok.resolve(TINY).all_logits is False
    assert "fused_speculation" in str(ok.resolve(TINY).artifact_key())
    problems = fused(EngineSpec("m", backend="neuron-cpu", draft="d", fused_speculation=True, max_seq_len=256,
                                max_context_len=128, prefill_chunk=64, all_logits=True))
    assert [p.split(":")[0] for p in problems] == [
        "fused_speculation (--fused-speculation) accepts drafts on the device",
        "fused_speculation returns token ids only"]
    assert fused(EngineSpec("m", backend="neuron-cpu", draft="d", fused_speculation=True, on_device_sampling=True,
                            max_seq_len=256, max_context_len=128, prefill_chunk=64)) == []
    assert EngineSpec("m", device="cpu", fused_speculation=True).problems(TINY) == [
        "fused_speculation (--fused-speculation) needs a draft: add --draft DIR"]
    assert EngineSpec("m", device="cpu", draft="d", fused_speculation=True).problems(TINY)[0].startswith(
        "fused_speculation (--fused-speculation) is NxDI's")
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--draft", "d",
                                      "--fused-speculation", "--backend", "neuron-cpu"])
    assert spec_from_args(args).fused_speculation is True


def test_the_engine_options_carry_the_draft():
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--draft", "d",
                                      "--speculative-tokens", "4"])
    spec = spec_from_args(args)
    assert (spec.draft, spec.num_speculative_tokens) == ("d", 4)
    assert spec_from_args(build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1"])).draft is None


def test_generate_with_a_draft_reports_acceptance(tiny_ckpt, tmp_path, capsys):
    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(tiny_ckpt))
    ids = ",".join(str(3 + (7 * i) % 500) for i in range(60))
    argv = ["generate", "--model", str(tiny_ckpt), "--prompt-ids", ids, "--device", "cpu", "--max-new-tokens", "8",
            "--max-seq-len", "256"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--draft", str(draft), "--speculative-tokens", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["spec_steps"] == spec["decode_steps"] >= 1
    assert spec["acceptance_length"] == (spec["spec_steps"] + spec["accepted_tokens"]) / spec["spec_steps"]
    assert "acceptance_length" not in plain
    bad = tmp_path / "bad"
    write_synthetic_draft(bad, M3Config.preset("small"))  # a draft for another target
    assert main(argv + ["--draft", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "problem(s)" in err and "hidden_size is 128" in err and "Traceback" not in err
