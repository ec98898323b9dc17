"""Compile-then-load on trn2.48xlarge (TP=64, EP=64, LNC=2), or a tiny synthetic model at TP=2 (``--synthetic``).

NOT RUN ON TRAINIUM YET: every setting below is read from NxDI 0.9 / NxD 0.18 sources and exercised only in
NxDI's CPU mode (``to_cpu()``); NEFF compilation and on-device loading await hardware.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

TRN2 = dict(tp_degree=64, moe_ep_degree=64, logical_nc_config=2)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (release layout)")
    p.add_argument("--compiled", help="where NEFFs + neuron_config.json + sharded weights go")
    p.add_argument("--synthetic", action="store_true", help="tiny synthetic checkpoint at TP=2 (smoke check)")
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--ep", type=int, default=None, help="moe_ep_degree (moe_tp = tp / ep)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096, help="max total tokens per sequence")
    p.add_argument("--context-buckets", default="512,1024,2048,4096",
                   help="comma-separated prefill buckets (explicit, not auto-generated)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-ids", default="1,100,200,300,400", help="comma-separated token ids to generate from")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--skip-compile", action="store_true", help="load an existing --compiled directory")


def run(args) -> int:
    from ..checkpoint.synthetic import write_synthetic
    from ..engine import GenerationConfig
    from .config import MiniMaxM3InferenceConfig, load_m3_config
    from .engine import NeuronEngine, build_neuron_config
    from .model import NeuronMiniMaxM3ForCausalLM

    model = args.model
    if args.synthetic:
        model = model or str(Path(tempfile.mkdtemp(prefix="m3-synth-")) / "tiny")
        if not (Path(model) / "config.json").is_file():
            write_synthetic(model, "tiny", seed=0)
        tp, ep, lnc = args.tp or 2, args.ep or 1, 1
        buckets = [b for b in (64, 128) if b <= args.seq_len] or [args.seq_len]
    else:
        if not model:
            raise SystemExit("--model is required (or --synthetic)")
        tp, ep, lnc = args.tp or TRN2["tp_degree"], args.ep or TRN2["moe_ep_degree"], TRN2["logical_nc_config"]
        buckets = [int(b) for b in args.context_buckets.split(",") if int(b) <= args.seq_len]
    compiled = args.compiled or str(Path(model) / f"neuron-tp{tp}-ep{ep}-b{args.batch}-s{args.seq_len}")
    nc = build_neuron_config(
        tp_degree=tp, moe_ep_degree=ep, batch_size=args.batch, max_seq_len=args.seq_len,
        max_context_length=max(buckets), dtype=args.dtype, logical_nc_config=lnc, enable_bucketing=True,
        context_encoding_buckets=buckets, token_generation_buckets=[args.seq_len],
        save_sharded_checkpoint=True, attn_kernel_enabled=False,
    )
    config = MiniMaxM3InferenceConfig(nc, load_config=load_m3_config(model))
    app = NeuronMiniMaxM3ForCausalLM(model, config)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_and_load", description=__doc__)
    add_args(ap)
    return run(ap.parse_args(argv))
