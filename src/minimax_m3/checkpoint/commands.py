"""``minimax-m3 synth | inspect | convert`` (targets; synth and inspect also EAGLE3 drafts): ``register(subparsers)``
adds them to the CLI."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..config.m3 import M3Config
from ..errors import M3Error
from .reader import CheckpointError


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic checkpoint in the release layout (bf16, MXFP8 or NVFP4), or "
                                      "with --draft eagle3 a synthetic EAGLE3 draft for a target")
    p.add_argument("dest", nargs="?", default=None, help="output directory (or --out)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--out", default=None)
    p.add_argument("--draft", choices=["eagle3"], default=None,
                   help="write an EAGLE3 draft head for --target (default: the --preset's config) instead")
    p.add_argument("--target", default=None, help="--draft: the target checkpoint directory the draft is for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", dest="fmt", default="bf16", choices=["bf16", "mxfp8", "nvfp4"])
    p.add_argument("--shards", type=int, default=None)
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("inspect", help="format, counts, config summary and every problem of a checkpoint (a target "
                                        "or an EAGLE3 draft)")
    p.add_argument("path")
    p.add_argument("--target", default=None, help="a draft: also check it against this target checkpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--deep", action="store_true", help="also read every scale tensor (NaN E8M0/E4M3 scales)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="stream a checkpoint to bf16 (release layout) or the NxDI state dict")
    p.add_argument("path")
    p.add_argument("--to", required=True, choices=["bf16", "neuron"])
    p.add_argument("--out", required=True)
    p.add_argument("--verify", action="store_true", help="audit: every tensor and byte accounted for, CRC re-read")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (neuron rank_util tensors)")
    p.add_argument("--fused-qkv", action="store_true", help="neuron: write qkv_proj.Wqkv instead of q/k/v")
    p.add_argument("--force", action="store_true", help="replace --out / discard an unrelated unfinished run")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_convert)


def cmd_synth(args) -> int:
    from .synthetic import write_synthetic

    dest = args.out or args.dest
    if dest is None or (args.out and args.dest and args.out != args.dest):
        raise M3Error("give one output directory: `minimax-m3 synth OUT` or `--out OUT`")
    if args.draft:
        from .draft import write_synthetic_draft

        target = M3Config.from_pretrained(args.target) if args.target else M3Config.preset(args.preset)
        out = write_synthetic_draft(dest, target, seed=args.seed, force=args.force)
        print(f"wrote a synthetic {args.draft} draft for {args.target or 'the ' + args.preset + ' preset'} to {out}")
        return 0
    out = write_synthetic(dest, args.preset, seed=args.seed, num_shards=args.shards, force=args.force, fmt=args.fmt)
    print(f"wrote {args.fmt} synthetic checkpoint ({args.preset}) to {out}")
    return 0


def _is_draft(path) -> bool:
    from ..config.draft import is_draft_config

    try:
        return is_draft_config(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def inspect(path) -> dict:
    """Everything ``inspect`` prints, as a dict (never raises for a bad checkpoint: problems are listed)."""
    from .audit import coverage
    from .mapping import REFERENCE, unit_of
    from .validate import check

    rep = check(path, deep=False)
    info: dict = {"path": str(path), "problems": rep.problems}
    if rep.config is not None:
        c: M3Config = rep.config
        info["config"] = {"layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
                          "kv_heads": c.num_kv_heads, "experts": c.num_experts, "top_k": c.top_k,
                          "moe_layers": sum(c.moe_layers), "sparse_layers": sum(c.sparse_layers),
                          "vocab": c.vocab_size}
    s = rep.source
    if s is not None:
        r = s.reader
        enc: dict[str, int] = {}
        for lg in s.logical.values():
            enc[lg.encoding] = enc.get(lg.encoding, 0) + 1
        info.update({
            "format": s.format.kind, "format_description": s.format.describe(),
            "shards": len({i.shard for i in r.infos.values()}), "stored_tensors": len(r.infos),
            "stored_bytes": sum(i.nbytes for i in r.infos.values()), "release_tensors": len(s.logical),
            "encodings": enc,
            "layers_present": len({u for k in s.logical if (u := unit_of(k)) is not None}),
        })
        if rep.config is not None and not rep.problems:
            used, skipped, left = coverage(s, rep.config, REFERENCE)
            reasons: dict[str, int] = {}
            for why in skipped.values():
                reasons[why] = reasons.get(why, 0) + 1
            info["text_backbone"] = {"consumed": len(used), "skipped": reasons, "unaccounted": left}
    return info


def cmd_inspect(args) -> int:
    draft = _is_draft(args.path)
    if draft:
        from .draft import draft_info

        info = draft_info(args.path, M3Config.from_pretrained(args.target) if args.target else None)
    else:
        info = inspect(args.path)
    if args.deep and not info["problems"] and not draft:
        from .validate import check

        info["problems"] = check(args.path, deep=True).problems
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{info['path']}: {info.get('format_description', 'unreadable')}")
        if "config" in info:
            print("  config: " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
        if "stored_tensors" in info and draft:
            shared = ", ".join(info["shared_with_target"]) or "nothing"
            print(f"  {info['shards']} shard(s), {info['stored_tensors']} stored tensors, {info['stored_bytes']:,} "
                  f"bytes; shared with the target: {shared}")
        elif "stored_tensors" in info:
            print(f"  {info['shards']} shard(s), {info['stored_tensors']} stored tensors, "
                  f"{info['stored_bytes']:,} bytes; {info['release_tensors']} release tensors "
                  f"{info['encodings']}; {info['layers_present']} layers")
        if "text_backbone" in info:
            tb = info["text_backbone"]
            print(f"  text backbone: {tb['consumed']} stored tensors consumed, {len(tb['unaccounted'])} unaccounted")
            for why, n in tb["skipped"].items():
                print(f"    skipped {n}: {why}")
        print(f"  problems: {len(info['problems'])}")
        for p in info["problems"]:
            print(f"    - {p}")
    return 1 if info["problems"] else 0


def cmd_convert(args) -> int:
    from .convert import ConversionError, convert

    try:
        aud = convert(args.path, args.out, to=args.to, dtype=torch.bfloat16, tp=args.tp, verify=args.verify,
                      force=args.force, progress=not args.no_progress, fused_qkv=args.fused_qkv)
    except (CheckpointError, ConversionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(aud.summary())
    print(f"wrote {args.out}")
    return 0 if aud.ok else 1


def main(argv=None) -> int:  # standalone entry: python -m minimax_m3.checkpoint.commands
    ap = argparse.ArgumentParser(prog="minimax-m3")
    register(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
