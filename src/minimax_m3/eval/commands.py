"""The ``minimax-m3 longbench`` and ``minimax-m3 needle`` sub-commands (wired in by ``cli.py`` through
:func:`register`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..load import load_engine
from ..errors import M3Error
from ..engine.spec import add_engine_options, spec_from_args
from .runner import LongBenchRunError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "longbench",
        help="run LongBench v1 / LongBench-E / v2 offline through an engine and score it to the official protocol",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_options(p)
    _add_source_options(p)
    p.add_argument("--data", required=True, help="folder with LongBench's <task>.jsonl (v1/E) and/or data.json (v2)")
    p.add_argument("--longbench-dir", default=None,
                   help="a THUDM/LongBench checkout (root or its LongBench/) for config/dataset2prompt.json, "
                        "dataset2maxlen.json and prompts/0shot.txt (default: the parent of --data)")  # fmt: skip
    p.add_argument("--tasks", default="all", help="all | e | v2 | a comma list such as hotpotqa,qasper_e")
    p.add_argument("--out", required=True, help="output folder: pred/<task>.jsonl, report.json, report.md")
    p.add_argument("--limit", type=int, default=None, help="first N samples of each task")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="middle-truncation budget (pred.py's max_length); default: max_seq_len - max_gen - chat "
                        "overhead - 16")
    p.add_argument("--strip-thinking", action="store_true",
                   help="v2: remove the thinking (M3's <mm:think>...</mm:think>, M2's <think>...</think>) before "
                        "extracting the answer (for reasoning models; not in the official protocol, which extracts "
                        "from the whole response)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_longbench)
    _register_needle(subparsers)


def _add_source_options(p) -> None:
    """Where the tokenizer comes from and ``--server``, shared by longbench and needle."""
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--server", default=None,
                   help="generate through an OpenAI-compatible completions server (e.g. vllm serve) at this base URL, "
                        "such as http://127.0.0.1:8000/v1, instead of loading an engine (--model: the checkpoint "
                        "directory for the tokenizer and config; needs the openai package)")
    p.add_argument("--served-model", default=None, help="--server: the model name (default: the first it lists)")


def cmd_longbench(args) -> None:
    from .runner import run_longbench

    data = Path(args.data)
    longbench_dir = Path(args.longbench_dir) if args.longbench_dir else data.resolve().parent
    try:
        engine = server_engine(args) if args.server else load_engine(spec_from_args(args))
        report = run_longbench(
            engine, tokenizer(args), data, longbench_dir, args.tasks, args.out, limit=args.limit,
            batch_size=args.batch_size,
            max_input_tokens=args.max_input_tokens, progress=not args.no_progress,
            meta=run_meta(args), strip_thinking=args.strip_thinking,
        )  # fmt: skip
    except OSError as exc:  # an unreadable or unwritable file or folder: one package error (the CLI exits 2)
        raise LongBenchRunError(str(exc)) from None
    from .report import render_markdown

    print(render_markdown(report))
    print(f"report: {Path(args.out) / 'report.json'} and report.md")


def tokenizer(args):
    """The tokenizer of ``--tokenizer`` (default ``--model``); transformers' refusal as one package error."""
    from transformers import AutoTokenizer

    path = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # transformers' own errors: no typed error below to pass on
        raise LongBenchRunError(f"tokenizer {path}: {exc}") from None


def run_meta(args) -> dict:
    """What a run records (and a resume must repeat): the model and where it ran."""
    if args.server:
        return {"model": str(args.model), "backend": "server", "server": args.server}
    return {"model": str(args.model), "backend": args.backend}


def server_engine(args):
    """``--server``: the runner's engine over an OpenAI-compatible server; engine options other than --model and
    --max-seq-len (used when the server reports no max_model_len) do not apply."""
    from ..config.m3 import M3Config
    from .server import ServerEngine

    if args.backend != "reference" or args.device:
        raise LongBenchRunError("--server generates on the server: drop --backend and --device")
    try:
        eos = M3Config.from_pretrained(args.model).eos_token_id
    except (M3Error, OSError):
        eos = None  # the tokenizer's EOS still stops generation
    return ServerEngine(args.server, args.served_model, max_seq_len=args.max_seq_len, eos_token_id=eos)


NEEDLE_HELP = """needle in a haystack: prompts of exactly --lengths tokens (the model's tokenizer) with a 7-digit number
hidden at --depths percent of a built-in filler text; greedy decoding; found when the number appears in the answer.
Writes <out>/needle.json (resumable: cells already there are skipped) and <out>/needle.png (columns = lengths, rows
= depths; green found, red not), and prints the table. A synthetic checkpoint (random weights, e.g. from
`minimax-m3 demo --out`) finds nothing: on it this checks the mechanics only."""


def _register_needle(subparsers) -> None:
    p = subparsers.add_parser("needle", help="needle-in-a-haystack retrieval over lengths x depths, table + PNG",
                              description=NEEDLE_HELP, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_options(p)
    _add_source_options(p)
    p.add_argument("--lengths", required=True,
                   help="prompt lengths in tokens, e.g. 4096,32K,128K (K = 1024, M = 1048576); each must leave "
                        "--max-new-tokens within --max-seq-len")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle positions, percent of the haystack (0..100)")
    p.add_argument("--out", required=True, help="output folder: needle.json, needle.png")
    p.add_argument("--seed", type=int, default=0, help="seeds the filler, the haystack order and the secrets")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens generated per cell (raise it for a model that thinks before answering)")
    p.add_argument("--batch-size", type=int, default=1, help="cells generated together")
    p.set_defaults(func=cmd_needle)


def cmd_needle(args) -> None:
    from transformers import AutoTokenizer

    from .needle import (
        PICTURE, RESULTS, NeedleBuilder, NeedleError, check_lengths, parse_depths, parse_lengths, render_table,
        run_needle,
    )  # fmt: skip

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        if not args.server:  # refuse what the spec cannot hold before anything is loaded or compiled
            spec = spec_from_args(args).resolve()
            check_lengths(lengths, max_seq_len=spec.max_seq_len, max_context_len=spec.max_context_len,
                          max_new_tokens=args.max_new_tokens, who=f"the {spec.backend} engine",
                          min_length=NeedleBuilder(tokenizer, args.seed).min_length())
        engine = server_engine(args) if args.server else load_engine(spec_from_args(args))
        results = run_needle(engine, tokenizer, lengths, depths, args.out, seed=args.seed,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, meta=run_meta(args))
    except M3Error:
        raise
    except (ValueError, OSError) as exc:  # unreadable tokenizer or output folder: one package error (exit 2)
        raise NeedleError(str(exc)) from None
    print(render_table(results["cells"], lengths, depths))
    asked = {(n, float(d)) for n in lengths for d in depths}
    if not any(c["found"] for c in results["cells"] if (c["length"], float(c["depth"])) in asked):
        print("nothing found: expected with random weights (a synthetic checkpoint), which test the mechanics only")
    print(f"results: {Path(args.out) / RESULTS}; picture: {Path(args.out) / PICTURE}")
