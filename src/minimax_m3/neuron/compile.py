"""Compile-then-load on trn2.48xlarge (TP=64, EP=64, LNC=2), or a tiny synthetic model at TP=2 (``--synthetic``).

NOT RUN ON TRAINIUM YET: every setting below is read from NxDI 0.9 / NxD 0.18 sources and exercised only in
NxDI's CPU mode (``to_cpu()``); NEFF compilation and on-device loading await hardware.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

# powers of two from 128, cut below the context length, which is added (NxDI's generate_buckets shape); batch > 1
# prefills one request per call (continuous batching), so no graph is batch x bucket tokens
DEFAULT_CONTEXT_BUCKETS = [2 ** i for i in range(7, 21)]
TRN2 = dict(tp_degree=64, moe_ep_degree=64, logical_nc_config=2)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (release layout)")
    p.add_argument("--compiled", help="where NEFFs + neuron_config.json + sharded weights go")
    p.add_argument("--synthetic", action="store_true", help="tiny synthetic checkpoint at TP=2 (smoke check)")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None, help="moe_ep_degree (moe_tp = tp / ep)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096, help="max total tokens per sequence")
    p.add_argument("--context-buckets", default=None,
                   help="comma-separated prefill buckets (default: powers of two from 128 below --seq-len, and "
                        "--seq-len)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-ids", default="1,100,200,300,400", help="comma-separated token ids to generate from")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated decode (token-generation) buckets, multiples of the indexer block size; "
                        "default: block-aligned powers of two from 128 below --seq-len, and --seq-len (a step at "
                        "context c reads the caches up to the smallest bucket >= c)")
    p.add_argument("--lnc", type=int, default=None, help="logical NeuronCore config (trn2: 2)")
    p.add_argument("--all-logits", action="store_true",
                   help="prefill returns every position's logits (a scoring build for prefill_logits; costs a "
                        "bucket x vocab fp32 output per prefill)")
    p.add_argument("--skip-compile", action="store_true", help="load an existing --compiled directory")
    p.add_argument("--dry-run", action="store_true",
                   help="trace every bucket to HLO (NxDI's compile(dry_run=True)), write the modules, the neuronx-cc "
                        "commands, dry_run.json and graphs.json to --compiled, and stop (no weights read)")


def run(args) -> int:
    from ..checkpoint.synthetic import write_synthetic
    from ..engine import GenerationConfig
    from .engine import NeuronEngine, application, build_neuron_config

    if args.dry_run:
        return _dry_run(args)
    model = args.model
    if args.synthetic:
        model = model or str(Path(tempfile.mkdtemp(prefix="m3-synth-")) / "tiny")
        if not (Path(model) / "config.json").is_file():
            write_synthetic(model, "tiny", seed=0)
        tp, ep, lnc = args.tp or 2, args.ep or 1, 1
        buckets = [b for b in (64, 128) if b <= args.seq_len] or [args.seq_len]
    else:
        if not model:
            from ..config import ConfigError

            raise ConfigError(["--model is required: a checkpoint directory (or --synthetic)"], source="compile")
        tp, ep, lnc = args.tp or TRN2["tp_degree"], args.ep or TRN2["moe_ep_degree"], TRN2["logical_nc_config"]
        buckets = [b for b in _buckets(args.context_buckets, DEFAULT_CONTEXT_BUCKETS, args.seq_len) if b <= args.seq_len]
    if args.batch > 1:
        print(f"batch {args.batch}: continuous batching (one request per prefill, {args.batch} decode slots)")
    compiled = args.compiled or str(Path(model) / f"neuron-tp{tp}-ep{ep}-b{args.batch}-s{args.seq_len}")
    nc = build_neuron_config(
        tp_degree=tp, moe_ep_degree=ep, batch_size=args.batch, max_seq_len=args.seq_len,
        max_context_length=max(buckets), dtype=args.dtype, logical_nc_config=lnc, enable_bucketing=True,
        context_encoding_buckets=buckets,
        token_generation_buckets=_buckets(args.token_buckets, token_buckets(args.seq_len, _block_size(model)),
                                          args.seq_len),
        save_sharded_checkpoint=True, attn_kernel_enabled=False, prefill_all_logits=args.all_logits,
    )
    config = _inference_config(nc, model)
    app = application(model, config)
    if not args.skip_compile:
        t0 = time.perf_counter()
        app.compile(compiled)
        print(f"compiled {len(buckets)} prefill bucket(s) {buckets} + decode in {time.perf_counter() - t0:.0f} s "
              f"→ {compiled}")
    t0 = time.perf_counter()
    app.load(compiled)
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    eng = NeuronEngine(app, config.m3_config())
    prompt = [int(x) for x in args.prompt_ids.split(",")]
    res = eng.generate([prompt], GenerationConfig(max_new_tokens=args.max_new_tokens))[0]
    n = len(res.tokens)
    ttft, total = res.timings["ttft_s"], res.timings["total_s"]
    itl = (total - ttft) / max(1, n - 1)
    print(f"tokens: {res.tokens}")
    print(f"TTFT {ttft * 1e3:.1f} ms   ITL {itl * 1e3:.1f} ms/token   ({n} tokens, batch {args.batch}, TP {tp}, "
          f"EP {ep}, LNC {lnc})")
    return 0


def _buckets(text: str | None, default: list[int], seq_len: int) -> list[int]:
    """Buckets from a comma-separated option; the default keeps those below the cache length and adds it (an
    explicit bucket beyond it is an error, reported by the layout check)."""
    if text:
        return sorted({int(b) for b in text.split(",") if b.strip()})
    return sorted({b for b in default if b < seq_len} | {seq_len})


def context_buckets(max_context_length: int) -> list[int]:
    """The default context-encoding buckets for prompts of up to ``max_context_length`` tokens."""
    return _buckets(None, DEFAULT_CONTEXT_BUCKETS, max_context_length)


def token_buckets(seq_len: int, block_size: int) -> list[int]:
    """The default decode buckets: ``block_size`` times powers of two from the first multiple of it >= 128 (NxDI's
    own smallest token-generation bucket), those below ``seq_len``, and ``seq_len``. Every one is a multiple of the
    indexer block when ``seq_len`` is (``validate_config`` says so otherwise)."""
    out, b = [], block_size * -(-128 // block_size)
    while b < seq_len:
        out.append(b)
        b *= 2
    return out + [seq_len]


def _block_size(model: str | None) -> int:
    """The indexer block size of ``model``'s config.json (128, the release's, when it cannot be read: the layout
    check then reports the missing config)."""
    from ..config import ConfigError, M3Config

    try:
        return M3Config.from_pretrained(model).index_block_size if model else 128
    except (ConfigError, OSError):
        return 128


def _dry_run_layout(args):
    tp, ep = args.tp or TRN2["tp_degree"], args.ep or TRN2["moe_ep_degree"]
    lnc = args.lnc or TRN2["logical_nc_config"]
    ctx = _buckets(args.context_buckets, DEFAULT_CONTEXT_BUCKETS, args.seq_len)
    tkg = _buckets(args.token_buckets, token_buckets(args.seq_len, _block_size(args.model)), args.seq_len)
    return tp, ep, lnc, ctx, tkg


def check_dry_run(args):
    """The layout checks of ``--dry-run``, without importing NxDI: the model config, or one error listing every
    problem."""
    from .dry_run import check_layout

    tp, ep, lnc, ctx, tkg = _dry_run_layout(args)
    return check_layout(args.model, tp, ep, lnc, args.batch, args.seq_len, ctx, tkg)


def _inference_config(nc, model: str):
    """The NxDI config, its ``validate_config`` problems (e.g. token-generation buckets off the indexer block) as
    the package's one-message :class:`ConfigError` (the CLI prints it and exits 2)."""
    from ..config import ConfigError
    from .config import MiniMaxM3InferenceConfig, load_m3_config

    try:
        return MiniMaxM3InferenceConfig(nc, load_config=load_m3_config(model))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError([str(exc)], source="compile") from None


def _dry_run(args) -> int:
    from . import dry_run

    tp, ep, lnc, ctx, tkg = _dry_run_layout(args)
    config = check_dry_run(args)
    out = args.compiled or str(Path(args.model) / f"neuron-tp{tp}-ep{ep}-b{args.batch}-s{args.seq_len}-dry-run")
    from .engine import build_neuron_config
    from .model import NeuronMiniMaxM3ForCausalLM

    nc = build_neuron_config(
        tp_degree=tp, moe_ep_degree=ep, batch_size=args.batch, max_seq_len=args.seq_len,
        max_context_length=max(ctx), dtype=args.dtype, logical_nc_config=lnc, enable_bucketing=True,
        context_encoding_buckets=ctx, token_generation_buckets=tkg, attn_kernel_enabled=False,
    )
    app = NeuronMiniMaxM3ForCausalLM(args.model, _inference_config(nc, args.model))
    t0 = time.perf_counter()
    manifest = dry_run.trace(app, out, "minimax-m3", config)
    print(f"traced {len(ctx)} context-encoding bucket(s) {ctx} and {len(tkg)} token-generation bucket(s) {tkg} "
          f"at TP {tp} / EP {ep} / LNC {lnc} in {time.perf_counter() - t0:.1f} s -> {manifest}")
    try:
        from . import graphs
    except ImportError:
        return 0
    print(graphs.format_report([graphs.analyze_dir(out)]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_and_load", description=__doc__)
    add_args(ap)
    return run(ap.parse_args(argv))
