#!/usr/bin/env python
"""Speculative decoding on the reference backend: tokens per target forward (and wall time per token) without a
draft, with drafters agreeing with the target on known patterns, and with a synthetic EAGLE3 draft, side by side.

The agreeing drafters (``reference.speculative.ScriptedDrafter``) propose the target's own greedy continuation where
a pattern says and a wrong token elsewhere, so the acceptance length is known before the run: ``1/2`` builds the
acceptance of an i.i.d. agreement rate of 1/2 with k = 3 (verify steps accepting 0, 0, 0, 0, 1, 1, 2, 3 drafts:
1.875 tokens per step), ``all`` accepts every draft (k + 1 tokens per step), ``none`` rejects every one. The synthetic
EAGLE3 draft has random weights: its acceptance says nothing about a real draft. Every run's tokens are checked equal
to plain greedy's before a figure is printed. A benchmark, not a test: figures depend on the machine and its load.

    python scripts/bench_speculative.py                      # tiny synthetic target, prompt 150 tokens, k = 3
    python scripts/bench_speculative.py --preset small --prompt 600 --k 4
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minimax_m3 import GenerationConfig  # noqa: E402
from minimax_m3.checkpoint.draft import write_synthetic_draft  # noqa: E402
from minimax_m3.checkpoint.synthetic import write_synthetic  # noqa: E402
from minimax_m3.config import M3Config  # noqa: E402
from minimax_m3.engine import EngineSpec  # noqa: E402
from minimax_m3.load import load_engine  # noqa: E402
from minimax_m3.reference.engine import ReferenceEngine  # noqa: E402
from minimax_m3.reference.speculative import ScriptedDrafter, acceptance_blocks  # noqa: E402


def patterns(k: int, cycles: int) -> dict[str, list[int]]:
    """Drafts accepted per verify step, by pattern name (see the module docstring)."""
    half = [0, 0, 0, 0, 1, 1, 2, 3] if k == 3 else [min(a, k) for a in (0, 0, 0, 0, 1, 1, 2, 3)]
    half = half * cycles
    random.Random(0).shuffle(half)
    return {"1/2": half, "all": [k] * (2 * cycles), "none": [0] * (8 * cycles)}


def run(engine, prompt: list[int], new: int) -> tuple[list[int], int, float]:
    """(tokens, target forwards after the prefill, seconds) of one greedy generation."""
    t0 = time.perf_counter()
    res = engine.generate([prompt], GenerationConfig(max_new_tokens=new))[0]
    dt = time.perf_counter() - t0
    return res.tokens, len(res.timings["decode_step_s"]), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--prompt", type=int, default=150, help="prompt tokens (random ids)")
    ap.add_argument("--k", type=int, default=3, help="drafts per verify step")
    ap.add_argument("--cycles", type=int, default=4, help="repeats of the patterns (more steps)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        target = write_synthetic(Path(tmp) / "target", args.preset, seed=args.seed)
        c = M3Config.from_pretrained(target)
        draft = write_synthetic_draft(Path(tmp) / "draft", c, seed=args.seed)
        spec = EngineSpec(model=str(target), device="cpu", dtype="float32", max_seq_len=args.prompt + 1024,
                          max_batch=1)
        plain = load_engine(spec)
        eagle = load_engine(EngineSpec(**{**spec.__dict__, "draft": str(draft), "num_speculative_tokens": args.k}))
        g = torch.Generator().manual_seed(args.seed + 1)
        prompt = torch.randint(3, c.vocab_size, (args.prompt,), generator=g).tolist()
        runs = {name: acceptance_blocks(steps, args.k) for name, steps in patterns(args.k, args.cycles).items()}
        new = max(len(p) for p in runs.values())
        ref, ref_fwd, ref_s = run(plain, prompt, new)
        print(f"reference backend, {args.preset} synthetic target ({c.num_layers} layers, hidden {c.hidden_size}), "
              f"prompt {args.prompt} tokens, greedy, k = {args.k}, CPU float32, batch 1")
        print(f"{'drafter':<26}{'tokens':>8}{'target fwd':>12}{'tokens/fwd':>12}{'expected':>10}{'ms/token':>10}")
        print(f"{'none (plain decode)':<26}{len(ref) - 1:>8}{ref_fwd:>12}{(len(ref) - 1) / ref_fwd:>12.3f}"
              f"{1.0:>10.3f}{ref_s * 1e3 / len(ref):>10.1f}")
        for name, agree in runs.items():
            steps = patterns(args.k, args.cycles)[name]
            n = len(agree)
            eng = ReferenceEngine(plain.model, max_seq_len=spec.max_seq_len, max_batch_size=1,
                                  drafter=ScriptedDrafter([ref[:n]], agree, c.vocab_size), speculative_tokens=args.k)
            toks, fwd, dt = run(eng, prompt, n)
            if toks != ref[:n]:
                raise SystemExit(f"{name}: drafted greedy differs from plain greedy")
            expected = sum(a + 1 for a in steps) / len(steps)
            print(f"{'agreeing ' + name:<26}{n - 1:>8}{fwd:>12}{(n - 1) / fwd:>12.3f}{expected:>10.3f}"
                  f"{dt * 1e3 / n:>10.1f}")
        toks, fwd, dt = run(eagle, prompt, new)
        if toks != ref:
            raise SystemExit("EAGLE3: drafted greedy differs from plain greedy")
        print(f"{'EAGLE3 synthetic (random)':<26}{len(toks) - 1:>8}{fwd:>12}{(len(toks) - 1) / fwd:>12.3f}"
              f"{'-':>10}{dt * 1e3 / len(toks):>10.1f}")
        print("tokens: after the prefill's first; target fwd: verify steps (plain: decode steps); every run's tokens "
              "equal plain greedy's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
