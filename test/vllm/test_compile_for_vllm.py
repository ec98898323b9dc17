"""``minimax-m3 compile --for-vllm`` writes the artifact vllm-neuron 0.4.1 loads (README, 'Serving with vLLM').

Oracles: vllm-neuron's own ``get_neuron_model`` fed the vLLM config that vLLM's own argument parser and
``EngineArgs.create_engine_config`` make of the README's ``vllm serve`` line (the NxDI config it builds, caught
where it would compile), and the golden file of the reference backend (``test_vllm_smoke.golden``) for the tokens
vLLM generates from the directory compile wrote."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from minimax_m3.config import M3Config

from .conftest import vllm_missing
from .test_vllm_smoke import golden, model  # noqa: F401  (module fixtures)

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> dict[str, list[str]]:
    """The ``minimax-m3 compile --for-vllm`` and ``vllm serve`` command lines of the README's serving block."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Serving with vLLM"):]
    block = section[section.index("```bash\nminimax-m3 compile --for-vllm") + len("```bash\n"):]
    block = block[:block.index("```")]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    heads = (["minimax-m3", "compile"], ["vllm", "serve"], ["export"], ["curl"])
    starts = [i for i in range(len(words)) if any(words[i:i + len(h)] == h for h in heads)] + [len(words)]
    cmds = {words[a]: words[a:b] for a, b in zip(starts, starts[1:])}
    return {"compile": cmds["minimax-m3"], "serve": cmds["vllm"]}


class _Built(Exception):
    pass


def test_readme_compile_line_builds_the_nxdi_config_vllm_neuron_builds_for_the_readme_serve_line(
        tmp_path, monkeypatch):
    """Field by field, the whole NxDI config (neuron config and model fields) at M3 widths, TP 64 / EP 64 / LNC 2."""
    import argparse

    import m3_vllm_standin_platform

    m3_vllm_standin_platform.setup()  # vllm-neuron's source on sys.path, NxDI through the stand-ins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_neuron.worker import neuronx_distributed_model_loader as loader

    from minimax_m3.neuron import compile as m3_compile
    from minimax_m3.neuron.vllm import artifact as vllm_artifact

    m3 = tmp_path / "MiniMax-M3"
    m3.mkdir()
    (m3 / "config.json").write_text(json.dumps(M3Config.preset("m3").to_release_dict()))
    cmds = readme_commands()
    assert cmds["compile"][:3] == ["minimax-m3", "compile", "--for-vllm"] and cmds["serve"][:2] == ["vllm", "serve"]

    # compile's side: its own argument parser, the config it hands NxDI's compile()
    ap = argparse.ArgumentParser()
    m3_compile.add_args(ap)
    args = ap.parse_args([w.replace("/data/MiniMax-M3", str(m3)) for w in cmds["compile"][2:]])
    spec = m3_compile.vllm_spec(args)
    ours = json.loads(vllm_artifact.vllm_inference_config(spec, vllm_artifact.serving_override(spec)).to_json_string())

    # vllm-neuron's side: vLLM's parser and config, then get_neuron_model up to the point where it would compile
    from vllm.entrypoints.openai.api_server import validate_api_server_args
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

    serve = cmds["serve"][2:]
    p = make_arg_parser(FlexibleArgumentParser())  # `vllm serve`'s own: the server's flags and the engine's
    # --swap-space 0: vLLM checks its 4 GiB per rank of CPU swap against this machine's memory (no neuron field)
    served = p.parse_args(["--model", str(m3), *serve[1:], "--swap-space", "0"])
    validate_parsed_serve_args(served)
    validate_api_server_args(served)  # the tool-call and reasoning parsers it names are registered (our plugin)
    cfg = EngineArgs.from_cli_args(served).create_engine_config()
    built = {}

    def catch(self, model_path, cls, config, compiled_path):
        built["config"] = config
        raise _Built

    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "empty"))  # nothing there: the compile branch
    monkeypatch.setattr(loader.NeuronCausalLM, "_compile_and_load_model", catch)
    with pytest.raises(_Built):
        loader.get_neuron_model(cfg.model_config, cache_config=cfg.cache_config, parallel_config=cfg.parallel_config,
                                scheduler_config=cfg.scheduler_config, lora_serving_config=None,
                                speculative_config=cfg.speculative_config, additional_config=cfg.additional_config)
    theirs = json.loads(built["config"].to_json_string())

    diff = sorted(k for k in set(ours["neuron_config"]) | set(theirs["neuron_config"])
                  if ours["neuron_config"].get(k) != theirs["neuron_config"].get(k))
    assert not diff, {k: (ours["neuron_config"].get(k), theirs["neuron_config"].get(k)) for k in diff}
    assert ours == theirs
    nc = theirs["neuron_config"]
    assert (nc["tp_degree"], nc["moe_ep_degree"], nc["moe_tp_degree"], nc["logical_nc_config"]) == (64, 64, 1, 2)
    assert nc["batch_size"] == 8 and nc["is_continuous_batching"] and nc["save_sharded_checkpoint"]
    assert nc["on_device_sampling_config"]["dynamic"] and nc["pa_block_size"] == 8192


def test_vllm_neuron_loads_what_compile_wrote_and_compiles_nothing(model, golden, tmp_path):  # noqa: F811
    """CPU mode: compile writes the config (no NEFFs); vLLM started with ``NEURON_COMPILED_ARTIFACTS`` and no
    ``override_neuron_config`` takes vllm-neuron's load branch (the stand-in runs it on CPU instead of loading NEFFs)
    and gives the golden greedy tokens for the smoke test's prompts."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "test.support.vllm.compile_then_generate", model,
                           str(tmp_path / "art"), str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["branch"] == "precompiled" and Path(report["model_path"]) == tmp_path / "art"
    assert report["files"] == ["minimax-m3-spec.json", "neuron_config.json"]
    assert report["tokens"] == golden
    printed = re.search(r"^vllm serve .*$", proc.stdout, re.M)
    assert printed and "--max-num-seqs 4" in printed.group(0) and "--max-model-len 64" in printed.group(0)
    # M3's tool calls and thinking read by the package's parsers (registered by its plugin; README's serve line)
    assert "--enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser minimax_m3" in printed.group(0)


def test_vllm_neuron_loads_a_fused_speculation_artifact(model, golden, tmp_path):  # noqa: F811
    """``compile --for-vllm --draft DIR --fused-speculation``: the artifact holds NxDI's fused config (the port's
    draft class and the draft path); vLLM started with ``NEURON_COMPILED_ARTIFACTS`` and the printed
    ``--speculative-config`` loads it (compiling nothing) and gives the golden greedy tokens."""
    from minimax_m3.checkpoint.draft import write_synthetic_draft

    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(model), seed=1)
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "test.support.vllm.compile_then_generate", model,
                           str(tmp_path / "art"), str(out), str(draft)], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["branch"] == "precompiled" and report["fused"] and len(report["prompts"]) >= 4
    assert report["tokens"] == [golden[i] for i in report["prompts"]]
    saved = json.loads((tmp_path / "art" / "neuron_config.json").read_text())
    assert saved["fused_spec_config"]["draft_model_cls"]["__name__"] == "M3Eagle3DraftForCausalLM"
    printed = re.search(r"^vllm serve .*$", proc.stdout, re.M).group(0)
    assert all(w in printed for w in ('"method": "eagle"', '"num_speculative_tokens": 4', '"is_eagle3": true'))


@pytest.mark.parametrize("override", [{}, {"moe_ep_degree": 2, "context_encoding_buckets": [16, 64]},
                                      {"quantized": True, "quantization_dtype": "f8e4m3"}])
@pytest.mark.parametrize("seqs", [1, 4])
def test_written_down_rules_equal_vllm_neurons_functions(nxdi, override, seqs):
    """Where vllm-neuron is not importable (compile on a host without vLLM), the same config comes out."""
    import m3_vllm_standin_platform

    m3_vllm_standin_platform.setup()
    import vllm_neuron.worker.neuronx_distributed_model_loader  # noqa: F401  (else both sides are the copy)

    from minimax_m3.neuron.vllm.defaults import vllm_neuron_config

    kw = dict(tp=2, max_num_seqs=seqs, max_model_len=64, dtype="bfloat16", override=override)
    theirs, ours = vllm_neuron_config(**kw), vllm_neuron_config(**kw, use_vllm_neuron=False)
    assert vars(theirs.pop("on_device_sampling_config")) == vars(ours.pop("on_device_sampling_config"))
    assert theirs == ours


def _compile(checkpoint, *args, cwd=REPO):
    """``minimax-m3 compile --backend neuron-cpu --for-vllm ...`` in a process of its own (NxDI through the
    stand-ins), as a user runs it."""
    code = ("import sys, m3_vllm_standin_platform; m3_vllm_standin_platform.setup(); "
            "from minimax_m3.cli import main; sys.exit(main(['compile'] + sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "--backend", "neuron-cpu", "--model", checkpoint, "--dtype",
                           "float32", "--batch", "2", "--max-seq-len", "64", "--context-buckets", "16,32,64",
                           "--token-buckets", "64", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_structured_outputs_build_samples_on_the_host_and_prints_its_serve_line(model, tmp_path):  # noqa: F811
    """``--structured-outputs``: the artifact's neuron config samples on the host (so vllm-neuron applies vLLM's
    grammar), the printed serve line carries the same override, and the server's guard reads the artifact as a
    host-sampling build; the default build reads as on-device (its guard refuses grammars)."""
    from minimax_m3.neuron.vllm.structured import samples_on_device

    proc = _compile(model, "--for-vllm", "--structured-outputs", "--compiled", str(tmp_path / "host"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    nc = json.loads((tmp_path / "host" / "neuron_config.json").read_text())["neuron_config"]
    assert nc["on_device_sampling_config"] is None
    line = re.search(r"^vllm serve .*$", proc.stdout, re.M).group(0)
    override = json.loads(shlex.split(line)[shlex.split(line).index("--additional-config") + 1])
    assert override["override_neuron_config"]["on_device_sampling_config"] is None
    assert "structured outputs (response_format, tool_choice required/named): honoured" in proc.stdout
    assert samples_on_device(None, str(tmp_path / "host")) is False
    proc = _compile(model, "--for-vllm", "--compiled", str(tmp_path / "ods"))
    assert proc.returncode == 0 and "refused with HTTP 400" in proc.stdout, proc.stderr[-3000:]
    assert samples_on_device(None, str(tmp_path / "ods")) is True


def test_decode_experts_tp_build_carries_the_hybrid_sharding_to_the_serve_line(model, tmp_path):  # noqa: F811
    """``--decode-experts tp``: the artifact's neuron config has NxD's hybrid sharding (decode experts over every
    rank, prefill's as the layout), and the printed serve line's override carries the same, so vllm-neuron builds
    the decode copy whether it loads the artifact or compiles from the line."""
    proc = _compile(model, "--for-vllm", "--decode-experts", "tp", "--compiled", str(tmp_path / "art"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    nc = json.loads((tmp_path / "art" / "neuron_config.json").read_text())["neuron_config"]
    want = {"moe_cte_tp_degree": 1, "moe_cte_ep_degree": 1, "moe_tkg_tp_degree": 1, "moe_tkg_ep_degree": 1}
    assert {k: nc["hybrid_sharding_config"][k] for k in want} == want
    line = re.search(r"^vllm serve .*$", proc.stdout, re.M).group(0)
    override = json.loads(shlex.split(line)[shlex.split(line).index("--additional-config") + 1])
    assert {k: override["override_neuron_config"]["hybrid_sharding_config"][k] for k in want} == want


@pytest.mark.parametrize("args,want", [
    (["--structured-outputs"], "--structured-outputs applies to --for-vllm builds"),
    (["--for-vllm", "--structured-outputs", "--draft", "DRAFT", "--speculative-tokens", "3", "--fused-speculation",
      "--on-device-sampling"], "--structured-outputs with --fused-speculation"),
    (["--for-vllm", "--kv-layout", "replicated"], "--kv-layout replicated: vllm-neuron builds the model's config"),
])
def test_structured_outputs_a_build_cannot_honour_is_refused_naming_the_option(model, tmp_path, args, want):  # noqa: F811
    proc = _compile(model, *args, "--compiled", str(tmp_path / "x"))
    assert proc.returncode != 0 and want in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "x").exists()
