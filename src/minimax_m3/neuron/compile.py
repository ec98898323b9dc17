"""Compile-then-load on trn2.48xlarge (TP=64, EP=64, LNC=2), or a tiny synthetic model at TP=2 (``--synthetic``).

NOT RUN ON TRAINIUM YET: every setting below is read from NxDI 0.9 / NxD 0.18 sources and exercised only in
NxDI's CPU mode (``to_cpu()``); NEFF compilation and on-device loading await hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from ..config.m3 import ConfigError, M3Config
from ..engine.spec import (
    DEFAULT_CONTEXT_BUCKETS, EngineSpec, SpecError, add_engine_options, context_buckets, spec_from_args, token_buckets,
)

__all__ = ["DEFAULT_CONTEXT_BUCKETS", "add_args", "check_dry_run", "check_fit", "compile_spec", "context_buckets",
           "main", "run", "token_buckets"]

SYNTHETIC = dict(tp=2, ep=1, lnc=1)  # --synthetic: the tiny model's smoke-check layout


def add_args(p: argparse.ArgumentParser) -> None:
    """The shared engine options (``--backend neuron`` by default) and compile's own."""
    add_engine_options(p, backend="neuron", model_required=False)
    p.add_argument("--synthetic", action="store_true", help="tiny synthetic checkpoint at TP=2 (smoke check)")
    p.add_argument("--prompt-ids", default="1,100,200,300,400", help="comma-separated token ids to generate from")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--skip-compile", action="store_true", help="load an existing compiled directory")
    p.add_argument("--for-vllm", action="store_true",
                   help="write the artifact vllm-neuron 0.4.1 loads from $NEURON_COMPILED_ARTIFACTS (its neuron "
                        "config for --batch as --max-num-seqs and --max-seq-len as --max-model-len, sharded weights) "
                        "and print the matching `vllm serve` command line (README, 'Serving with vLLM')")
    p.add_argument("--structured-outputs", action="store_true",
                   help="with --for-vllm: sample on the host so vLLM applies structured outputs' grammar "
                        "(response_format, tool_choice required or named); without it the build samples on device "
                        "(vllm-neuron's default) and the server refuses such requests")
    p.add_argument("--dry-run", action="store_true",
                   help="trace every bucket to HLO (NxDI's compile(dry_run=True)), write the modules, the neuronx-cc "
                        "commands, dry_run.json and graphs.json to --compiled, and stop (no weights read)")


def compile_spec(args) -> EngineSpec:
    """The engine spec of compile's options (``--synthetic``: a tiny checkpoint, TP 2, buckets 64 and 128)."""
    check_backend(args)
    spec = spec_from_args(args)
    if args.synthetic:
        model = spec.model or str(Path(tempfile.mkdtemp(prefix="m3-synth-")) / "tiny")
        if not (Path(model) / "config.json").is_file():
            from ..checkpoint.synthetic import write_synthetic

            write_synthetic(model, "tiny", seed=0)
        fill = dict(SYNTHETIC, context_buckets=tuple(b for b in (64, 128) if b <= spec.max_seq_len) or None)
        spec = dataclasses.replace(spec, model=model, **{k: v for k, v in fill.items() if getattr(spec, k) is None})
    if not spec.model:
        raise SpecError(["--model is required: a checkpoint directory (or --synthetic)"], source="compile")
    return spec


def vllm_spec(args) -> EngineSpec:
    """``--for-vllm``: the resolved serving spec of compile's options (``neuron.vllm_artifact.vllm_spec``)."""
    from .vllm import artifact as vllm_artifact

    spec = compile_spec(args)
    return vllm_artifact.vllm_spec(spec, _config(spec.model), getattr(args, "structured_outputs", False))


def check_backend(args) -> None:
    if args.backend not in ("neuron", "neuron-cpu"):
        raise SpecError([f"compile builds the neuron backends (--backend neuron or neuron-cpu), not {args.backend}"])


def check_fit(args) -> None:
    """A trn2 build (``--backend neuron``, not a dry run) whose batch x length does not fit HBM is refused before
    anything compiles: the planner's :func:`~minimax_m3.planner.require_fit` (the build's cache layout and prefill
    chunk) names the bytes and the largest context and batch that fit, under each layout and decode-experts choice."""
    if args.backend != "neuron" or args.dry_run:
        return
    spec = compile_spec(args)
    config = _config(spec.model)
    if config is None:  # the spec's own checks name the unreadable config
        return
    s = spec.resolve(config)
    if min(s.tp, s.ep, s.max_batch, s.max_seq_len) < 1:
        return
    from ..errors import M3Error
    from ..planner import FitError, require_fit

    try:
        require_fit(config, s.tp, s.ep, s.max_batch, s.max_seq_len, weights=s.weights, layout=s.kv_layout,
                    chunk=s.prefill_chunk if s.kv_layout == "sharded" else None, decode_experts=s.decode_experts)
    except FitError:
        raise
    except M3Error:  # a layout or chunk the planner cannot size: the spec's own checks name it, with the rest
        return


def check_dry_run(args):
    """The checks of ``--dry-run``, without importing NxDI (:func:`minimax_m3.neuron.trace.check`): the resolved
    spec and the model config, or one error listing every problem."""
    from .trace import check

    return check(compile_spec(args))


def run(args) -> int:
    from ..engine.loop import GenerationConfig
    from .build import application, inference_config
    from .provider import load

    if args.dry_run:
        return _dry_run(args)
    if getattr(args, "for_vllm", False):
        from .vllm.artifact import compile_for_vllm

        return compile_for_vllm(vllm_spec(args), args.compiled, structured_outputs=args.structured_outputs)
    if getattr(args, "structured_outputs", False):
        raise SpecError(["--structured-outputs applies to --for-vllm builds (vLLM's grammar on host sampling); add "
                         "--for-vllm or drop it"], source="compile")
    spec = compile_spec(args)
    config = M3Config.from_pretrained(spec.model)  # parsed once, handed down
    spec = spec.validate(config)
    if spec.max_batch > 1:
        print(f"batch {spec.max_batch}: {'continuous' if spec.continuous_batching else 'static'} batching")
    if spec.backend == "neuron" and not args.skip_compile:
        path = spec.artifact_dir()
        app = application(spec.model, inference_config(spec, config))
        t0 = time.perf_counter()
        app.compile(path)
        spec.write_artifact(path)
        print(f"compiled prefill buckets {list(spec.context_buckets)} + decode buckets {list(spec.token_buckets)} in "
              f"{time.perf_counter() - t0:.0f} s -> {path}")
    t0 = time.perf_counter()
    eng = load(spec, config, compile_missing=False)
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    prompt = [int(x) for x in args.prompt_ids.split(",")]
    res = eng.generate([prompt], GenerationConfig(max_new_tokens=args.max_new_tokens))[0]
    t = res.timings
    itl = sorted(t["decode_step_s"])[len(t["decode_step_s"]) // 2] if t["decode_step_s"] else 0.0
    print(f"tokens: {res.tokens}")
    print(f"TTFT {t['ttft_s'] * 1e3:.1f} ms   ITL {itl * 1e3:.1f} ms/token (median)   total {t['total_s']:.2f} s   "
          f"({len(res.tokens)} tokens, batch {spec.max_batch}, TP {spec.tp}, EP {spec.ep}, LNC {spec.lnc})")
    return 0


def _config(model: str | None) -> M3Config | None:
    """``model``'s config (None when it cannot be read: the layout check then names the problem)."""
    try:
        return M3Config.from_pretrained(model) if model else None
    except (ConfigError, OSError):
        return None


def _dry_run(args) -> int:
    from . import trace as dry_run
    from .build import inference_config
    from .model import NeuronMiniMaxM3ForCausalLM

    spec, config = check_dry_run(args)
    out = args.compiled or spec.artifact_dir() + "-dry-run"
    # neither sharded weights nor all-position logits: a dry run reads only config.json
    app = NeuronMiniMaxM3ForCausalLM(spec.model, inference_config(spec, config, save_sharded_checkpoint=False))
    t0 = time.perf_counter()
    manifest = dry_run.trace(app, out, "minimax-m3", config)
    ctx, tkg = list(spec.context_buckets), list(spec.token_buckets)
    print(f"traced {len(ctx)} context-encoding bucket(s) {ctx} and {len(tkg)} token-generation bucket(s) {tkg} "
          f"at TP {spec.tp} / EP {spec.ep} / LNC {spec.lnc} in {time.perf_counter() - t0:.1f} s -> {manifest}")
    try:
        from ..graphs import report as graphs
    except ImportError:
        return 0
    print(graphs.format_report([graphs.analyze_dir(out)]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_and_load", description=__doc__)
    add_args(ap)
    return run(ap.parse_args(argv))
