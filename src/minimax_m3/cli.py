"""The ``minimax-m3`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import storage
from .load import load_engine
from .engine.loop import SPEC_TIMING_KEYS, TIMING_KEYS, GenerationConfig
from .errors import M3Error
from .engine.spec import EngineSpec, SpecError, add_engine_options, spec_from_args

# Packages that contribute sub-commands through a ``register(subparsers)`` function.
COMMAND_MODULES = ("minimax_m3.checkpoint.commands", "minimax_m3.eval.commands", "minimax_m3.planner",
                   "minimax_m3.neuron.commands", "minimax_m3.graphs.report")
# Contributed commands that take s3:// inputs (argument names) and upload an output directory.
STORAGE_WIRING = {
    "longbench": (("model", "tokenizer", "data", "longbench_dir"), "out"),
    "needle": (("model", "tokenizer"), "out"),
    "convert": (("path",), "out"),
    "inspect": (("path", "target"), None),
    "compile": (("model", "compiled"), "compiled"),  # --compiled s3://... is read only with --skip-compile
}


def _with_storage(func, inputs: tuple[str, ...], output: str | None):
    """Resolve ``s3://`` inputs to local copies before ``func`` runs; upload ``output`` after it."""

    def run(args) -> None:
        storage.check_upload_target(args.upload)
        for name in inputs:
            if name == output and not getattr(args, "skip_compile", False):
                continue  # an output directory that does not exist yet
            value = getattr(args, name, None)
            if value is not None and storage.is_s3(str(value)):
                setattr(args, name, str(storage.resolve(value, args.cache_dir)))
        rc = func(args)
        if output is not None and not rc:
            storage.maybe_upload(getattr(args, output), args.upload)
        return rc

    return run


def _add_route(p: argparse.ArgumentParser) -> None:
    """``compile --route``: NxDI (Neuron <= 2.33, the default) or the vLLM Neuron model (Neuron >= 2.34), whose only
    off-device build is the dry run (:mod:`minimax_m3.vllm_neuron.dry_run`)."""
    p.add_argument("--route", choices=("nxdi", "vllm-neuron"), default="nxdi",
                   help="nxdi: the NxDI port (Neuron SDK <= 2.33); vllm-neuron: the vLLM Neuron model's graphs "
                        "through torch.compile / torch-mlir to StableHLO (with --dry-run)")
    p.add_argument("--dcp", type=int, default=1,
                   help="--route vllm-neuron: vLLM's --decode-context-parallel-size (each KV head's pages dealt by "
                        "128-token block over this many of its ranks); the NxDI port shards by --kv-layout instead")
    nxdi = p.get_default("func")

    def run(args):
        if args.route == "nxdi":
            if args.dcp != 1:
                raise SpecError([f"--dcp {args.dcp} is the vLLM Neuron route's (vLLM's decode context parallelism); "
                                 "the NxDI port splits its caches by sequence with --kv-layout sharded (the default)"],
                                source="compile")
            return nxdi(args)
        if not args.dry_run:
            raise SpecError(["--route vllm-neuron builds graphs with --dry-run only: the plugin compiles on the trn2 "
                             "itself when `vllm serve` starts (README, 'Which stack for which Neuron SDK')"],
                            source="compile")
        from .vllm_neuron.dry_run import run as dry_run

        return dry_run(args)

    p.set_defaults(func=run)


def _engine_args(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    storage.add_storage_args(p)


def _load(args):
    return load_engine(spec_from_args(args))


def _upload_file(path: Path, uri: str | None) -> None:
    """``--upload``: send one output file (staged alone in a directory) to ``uri`` with its manifest."""
    if uri is None:
        return
    with tempfile.TemporaryDirectory() as stage:
        shutil.copy2(path, stage)
        storage.maybe_upload(stage, uri)


def cmd_golden(args) -> None:
    from .reference.golden import compute_golden, read_prompts, write_golden

    prompts = read_prompts(args.prompts)
    storage.check_upload_target(args.upload)
    engine = _load(args)
    t0 = time.perf_counter()
    tensors = compute_golden(engine, prompts, args.decode_steps)
    meta = {"model": str(args.model), "dtype": str(engine.spec.dtype), "decode_steps": str(args.decode_steps),
            "backend": args.backend, "prompts": str(len(prompts))}
    write_golden(tensors, args.out, meta)
    _upload_file(Path(args.out), args.upload)
    print(f"golden: {len(prompts)} prompt(s), {args.decode_steps} decode steps -> {args.out} "
          f"({time.perf_counter() - t0:.2f} s)")


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:  # no tokenizer files: one error, not transformers' traceback
        raise M3Error(f"cannot load a tokenizer from {model_dir} ({str(e).strip().splitlines()[0]}); it needs "
                      "tokenizer.json and tokenizer_config.json, or give token ids with --prompt-ids") from None


def _prompt(args) -> tuple[list[int], object, tuple[int, ...]]:
    """(prompt ids, tokenizer or None, extra stop ids): ``--prompt-ids``, ``--prompt`` (raw text), or chat
    (``--messages`` / ``--chat``, with ``--tools`` and ``--thinking-mode``) through the checkpoint's chat template,
    which then also stops at its end of turn. Read before the engine loads, so bad input fails at once."""
    from .checkpoint import chat_template as C

    chat = args.messages is not None or args.chat is not None
    if not chat and (args.tools or args.thinking_mode):
        raise C.ChatError("--tools and --thinking-mode apply to chat input: give --messages FILE.json or --chat TEXT")
    if args.prompt_ids:
        return [int(t) for t in args.prompt_ids.split(",")], None, ()
    tok = _tokenizer(storage.resolve(args.model, args.cache_dir))
    if not chat:
        return tok(args.prompt)["input_ids"], tok, ()
    messages, tools = C.read_chat(args.messages) if args.messages else ([{"role": "user", "content": args.chat}], None)
    if args.tools:
        tools = C.read_tools(args.tools)
    ids = C.chat_prompt_ids(tok, messages, tools, args.thinking_mode, where=f"checkpoint {args.model}")
    eot = tok.get_vocab().get(C.END_OF_TURN)
    return ids, tok, (eot,) if eot is not None else ()


def cmd_generate(args) -> None:
    ids, tok, stop = _prompt(args)
    engine = _load(args)
    eos = ((engine.config.eos_token_id,) if engine.config.eos_token_id is not None else ()) + stop
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, eos_token_ids=eos)
    res = engine.generate([ids], gen)[0]
    text = tok.decode(res.tokens) if tok is not None else None
    record = json.dumps({"prompt_tokens": len(ids), "tokens": res.tokens, "text": text,
                         "finish_reason": res.finish_reason, **_timing(res)}, ensure_ascii=False)
    print(record)
    if args.upload:
        with tempfile.TemporaryDirectory() as stage:
            (Path(stage) / "generation.json").write_text(record + "\n")
            storage.maybe_upload(stage, args.upload)


def _timing(res) -> dict:
    """The timing fields every backend reports (milliseconds): queueing, prefill, time to first token, median
    decode step, total."""
    t = res.timings
    steps = sorted(t["decode_step_s"])
    med = steps[len(steps) // 2] if steps else None
    ms = {f"{k.removesuffix('_s')}_ms": round(t[k] * 1e3, 2) for k in TIMING_KEYS if k != "decode_step_s"}
    spec = {k: t[k] for k in SPEC_TIMING_KEYS if k in t}  # speculative decoding: steps are verify steps
    return {**ms, "decode_ms_per_token_median" if not spec else "decode_ms_per_step_median":
            None if med is None else round(med * 1e3, 2), "decode_steps": len(steps), **spec}


def cmd_demo(args) -> None:
    from .checkpoint.synthetic import write_synthetic
    from .reference.engine import best_device

    with tempfile.TemporaryDirectory(prefix="minimax-m3-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / f"synthetic-{args.preset}"
        t0 = time.perf_counter()
        write_synthetic(out, args.preset, seed=args.seed, force=bool(args.out))
        print(f"demo: synthetic '{args.preset}' checkpoint (random weights) written to {out} "
              f"in {time.perf_counter() - t0:.2f} s")
        device = args.device or best_device()
        engine = load_engine(EngineSpec(model=str(out), backend="reference", device=device, dtype=args.dtype))
        c = engine.config
        tok = _tokenizer(out)
        text = "MiniMax Sparse Attention picks, per query and KV head, the most relevant key blocks. " * 4
        ids = tok(text)["input_ids"]
        print(f"demo: loaded on {device} ({engine.spec.dtype}); {c.num_layers} layers, {c.num_experts} experts top-"
              f"{c.top_k}, sparse attention keeps {c.index_topk} blocks of {c.index_block_size} tokens")
        res = engine.generate([ids], GenerationConfig(max_new_tokens=args.max_new_tokens))[0]
        t = _timing(res)
        blocks = -(-len(ids) // c.index_block_size)
        print(f"demo: prompt {len(ids)} tokens ({blocks} blocks: sparse selection "
              f"{'active' if blocks > c.index_topk else 'keeps every block'})")
        print(f"demo: prefill {t['prefill_ms']} ms ({len(ids) / max(res.timings['prefill_s'], 1e-9):.0f} tok/s), "
              f"TTFT {t['ttft_ms']} ms; decode {len(res.tokens)} tokens, median {t['decode_ms_per_token_median']} "
              f"ms/token; total {t['total_ms']} ms")
        print(f"demo: generated ids {res.tokens}")
        print(f"demo: text (random weights, so gibberish): {tok.decode(res.tokens)!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minimax-m3", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("golden", help="write golden logits (prefill + cached decode) for PROMPTS.jsonl")
    _engine_args(p)
    p.add_argument("--prompts", required=True, help='JSONL, one {"input_ids": [...]} per line')
    p.add_argument("--out", required=True, help="OUT.safetensors")
    p.add_argument("--decode-steps", type=int, default=16)
    p.set_defaults(func=cmd_golden)

    p = sub.add_parser("generate", help="generate from a prompt, token ids or chat messages")
    _engine_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="text (tokenized with the checkpoint's tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--messages", metavar="FILE.json",
                   help="chat: a JSON list of {role, content} messages (system, developer, user, assistant, tool; "
                        "tool_calls as in chat completions) or a request body with messages and tools, rendered "
                        "with the checkpoint's chat template")  # fmt: skip
    g.add_argument("--chat", metavar="TEXT", help="chat: one user message, rendered with the checkpoint's template")
    p.add_argument("--tools", metavar="FILE.json", help="chat: a JSON list of tools (chat-completions form)")
    p.add_argument("--thinking-mode", choices=["enabled", "disabled", "adaptive"], default=None,
                   help="chat: the template's thinking_mode (M3: the prompt ends <mm:think>, </mm:think> or nothing; "
                        "default: the template's, adaptive)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="synthesise a tiny checkpoint, load it, generate, print timings")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="keep the synthetic checkpoint here (default: a temp dir)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.set_defaults(func=cmd_demo)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _add_route(sub.choices["compile"])
    for command, (inputs, output) in STORAGE_WIRING.items():
        p = sub.choices[command]
        storage.add_storage_args(p)
        p.set_defaults(func=_with_storage(p.get_default("func"), inputs, output))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except M3Error as exc:  # every error the package raises on purpose: its problems, exit 2, no traceback
        print(f"minimax-m3 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as exc:  # a path given on the command line
        print(f"minimax-m3 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
