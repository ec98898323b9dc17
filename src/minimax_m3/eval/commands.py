"""The ``minimax-m3 longbench`` sub-command (wired in by ``cli.py`` through :func:`register`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine import BACKENDS, load_engine


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "longbench",
        help="run LongBench v1 / LongBench-E / v2 offline through an engine and score it to the official protocol",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="reference", choices=BACKENDS)
    p.add_argument("--model", required=True, help="checkpoint directory (or what the backend loads)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--data", required=True, help="folder with LongBench's <task>.jsonl (v1/E) and/or data.json (v2)")
    p.add_argument("--longbench-dir", default=None,
                   help="a THUDM/LongBench checkout (root or its LongBench/) for config/dataset2prompt.json, "
                        "dataset2maxlen.json and prompts/0shot.txt (default: the parent of --data)")  # fmt: skip
    p.add_argument("--tasks", default="all", help="all | e | v2 | a comma list such as hotpotqa,qasper_e")
    p.add_argument("--out", required=True, help="output folder: pred/<task>.jsonl, report.json, report.md")
    p.add_argument("--limit", type=int, default=None, help="first N samples of each task")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="middle-truncation budget (pred.py's max_length); default: max_seq_len - max_gen - chat overhead - 16")  # fmt: skip
    p.add_argument("--max-seq-len", type=int, default=None, help="engine context (prompt + generated ids)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, help="reference backend: cpu | cuda")
    p.add_argument("--strip-thinking", action="store_true",
                   help="v2: remove <think>...</think> blocks before extracting the answer (for reasoning models; "
                        "not in the official protocol, which extracts from the whole response)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_longbench)


def cmd_longbench(args) -> None:
    from transformers import AutoTokenizer

    from .runner import run_longbench

    data = Path(args.data)
    longbench_dir = Path(args.longbench_dir) if args.longbench_dir else data.resolve().parent
    kw = {k: v for k, v in (("max_seq_len", args.max_seq_len), ("dtype", args.dtype), ("device", args.device)) if v is not None}
    try:
        engine = load_engine(args.model, backend=args.backend, **kw)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        report = run_longbench(
            engine, tokenizer, data, longbench_dir, args.tasks, args.out, limit=args.limit, batch_size=args.batch_size,
            max_input_tokens=args.max_input_tokens, progress=not args.no_progress,
            meta={"model": str(args.model), "backend": args.backend}, strip_thinking=args.strip_thinking,
        )  # fmt: skip
    except (ValueError, OSError) as exc:  # LongBench data/task/config errors, unreadable files
        print(f"minimax-m3 longbench: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from .report import render_markdown

    print(render_markdown(report))
    print(f"report: {Path(args.out) / 'report.json'} and report.md")
