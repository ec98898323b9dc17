#!/usr/bin/env python
"""Reference backend vs transformers 5.23 (``MiniMaxM3SparseForConditionalGeneration``, eager): prefill tokens/s,
decode ms/token and peak memory at several contexts, on the same device, weights and inputs, in one run.

Every implementation runs in its own process, so peak memory is its own (CPU: peak RSS of the process, weights and
runtime included; CUDA: ``max_memory_allocated``). The processes are loaded and warmed up one after the other, then
driven **interleaved**: prefill repetitions alternate between the implementations, and decode runs in rounds that
alternate too, so every comparison is made under the same load (on a shared machine the load can double a run's
time within minutes). The first step of every decode round is a warm-up, run but not timed, for every
implementation alike: it pays for the caches the other process evicted in between, a cost that steps run back to
back (as in serving) never see (small preset at 8K: our first step after another process ran takes ~1.5x a steady
step). Every process runs with glibc's allocator settings pinned (``MALLOC_MMAP_THRESHOLD_`` at its 32 MiB maximum,
trimming off; unless already set): with the default, adaptive ones, transformers' decode at 8K measured 21 or 71 ms
per step depending on the allocator's history (fresh pages for its growing caches), with them 24 ms in each run. Before
any time is quoted the logits are checked equal: the prefill's last-position logits
and every decode step's logits (decode is teacher-forced with the same token ids for both implementations). A
context whose estimated memory would not fit is skipped for that implementation with the estimate, so the machine
is never pushed into the OOM killer.

    python scripts/bench_reference.py --preset small --contexts 2048 8192 32768          # CPU targets
    python scripts/bench_reference.py --preset m3-slice --layers 2 --dtype bfloat16      # H200: full-width slice
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

IMPLS = ("transformers", "reference", "reference-flex")


def _config(args):
    from minimax_m3.config import M3Config

    if args.preset != "m3-slice":
        return M3Config.preset(args.preset)
    n = args.layers  # real hidden size, heads and 128 experts; layer 0 dense like the release, the rest sparse MoE
    return M3Config().replace(num_layers=n, moe_layers=(False,) + (True,) * (n - 1),
                              sparse_layers=(False,) + (True,) * (n - 1))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Runner:
    """One implementation, loaded and warmed up: ``prefill()`` (resets the decode state) and ``decode(i, j)``
    (teacher-forced steps ``i .. j-1``), each timed in wall and CPU time."""

    def __init__(self, impl, ckpt, device, dtype, n, steps):
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(0)
        from minimax_m3.config import M3Config

        vocab = M3Config.from_pretrained(ckpt).vocab_size
        ids = torch.randint(3, vocab, (1, n + steps), generator=g).to(device)
        self.prompt, self.forced, self.n, self.device, self.state = ids[:, :n], ids[:, n:], n, device, None
        if impl == "transformers":
            from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

            model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
                ckpt, dtype=dt, attn_implementation="eager").to(device).eval()

            def prefill(x):
                out = model(x, use_cache=True, logits_to_keep=1)
                return out.logits[:, -1].float(), out.past_key_values

            def step(state, tok, pos):
                out = model(tok, past_key_values=state, use_cache=True)
                return out.logits[:, -1].float(), state
        else:
            from minimax_m3.reference.loader import load_model

            model = load_model(ckpt, device=device, dtype=dt)
            if impl == "reference-flex":
                model.paths.prefill, model.paths.flex_compile = "flex", True

            def prefill(x):
                cache = model.new_cache(1, n + steps)
                pos = torch.arange(x.shape[1], device=device).unsqueeze(0)
                last = torch.tensor([x.shape[1] - 1], device=device)
                return model(x, pos, cache, x.shape[1], decode=False, logits_at=last)[:, 0], cache

            def step(cache, tok, pos):
                p = torch.tensor([[pos]], device=device)
                return model(tok, p, cache, pos + 1, decode=True)[:, 0], cache
        self._prefill, self._step = prefill, step
        prefill(self.prompt[:, :min(n, 256)])  # warm-up (allocator, lazy init, kernel compilation at that shape)
        if impl == "reference-flex":
            prefill(self.prompt)  # compile at this context's shape before timing
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    def prefill(self) -> dict:
        self.state = None  # free the previous repetition's cache first
        _sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        logits, self.state = self._prefill(self.prompt)
        _sync(self.device)
        return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "logits": logits.cpu().numpy()}

    def decode(self, i: int, j: int) -> dict:
        wall, cpu, logits = [], [], []
        for k in range(i, j):
            t0, c0 = time.perf_counter(), time.process_time()
            lg, self.state = self._step(self.state, self.forced[:, k:k + 1], self.n + k)
            _sync(self.device)
            wall.append(1000 * (time.perf_counter() - t0))
            cpu.append(1000 * (time.process_time() - c0))
            logits.append(lg.float().cpu().numpy())
        return {"wall": wall, "cpu": cpu, "logits": logits}


def _server(impl: str, ckpt: str, device: str, dtype: str, n: int, steps: int, threads: int, conn) -> None:
    """Child process: build a :class:`_Runner`, then answer the parent's commands until ``exit``."""
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():  # both implementations, so neither pays autograd bookkeeping
            run = _Runner(impl, ckpt, device, dtype, n, steps)
            conn.send("ready")
            while True:
                cmd = conn.recv()
                if cmd[0] == "exit":
                    conn.send({"peak_gb": _peak_bytes(device) / 2**30})
                    return
                conn.send(run.prefill() if cmd[0] == "prefill" else run.decode(*cmd[1:]))
    except BaseException as exc:  # report, never hang the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _measure(impls: list[str], args, ckpt: str, n: int) -> dict:
    """All ``impls`` at context ``n``, interleaved: each process is loaded and warmed up before the next starts,
    then prefill repetitions alternate (best of up to ``--reps``, no new repetition after ~60 s per implementation)
    and decode runs in ``--rounds`` alternating rounds. Returns one result (or error) per implementation."""
    ctx = mp.get_context("spawn")  # children read the allocator settings at start (see the module docstring)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 2**20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**40))
    procs, conns, res = {}, {}, {}

    class Failed(RuntimeError):
        def __init__(self, impl, msg):
            super().__init__(msg)
            self.impl = impl

    def ask(impl, cmd):
        conns[impl].send(cmd)
        r = conns[impl].recv()
        if isinstance(r, dict) and "error" in r:
            raise Failed(impl, r["error"])
        return r

    try:
        for impl in impls:
            conns[impl], child = ctx.Pipe()
            procs[impl] = ctx.Process(target=_server, args=(impl, ckpt, args.device, args.dtype, n, args.steps,
                                                            args.threads, child))
            procs[impl].start()
            msg = conns[impl].recv()
            if msg != "ready":
                raise Failed(impl, msg["error"])
        runs = {i: [] for i in impls}
        t0 = time.perf_counter()
        for rep in range(args.reps):
            if rep and time.perf_counter() - t0 > 60 * len(impls):
                break
            for impl in impls:
                runs[impl].append(ask(impl, ("prefill",)))
        dec = {i: [] for i in impls}  # one entry per round
        chunk = max(1, -(-args.steps // args.rounds))
        for i in range(0, args.steps, chunk):
            for impl in impls:
                dec[impl].append(ask(impl, ("decode", i, min(args.steps, i + chunk))))
        on_cpu = args.device == "cpu"
        key = "cpu" if on_cpu else "wall"  # CPU time on a shared CPU (wall time measures the neighbours)
        for impl in impls:
            peak = ask(impl, ("exit",))
            prefill_s = min(r[key] for r in runs[impl])
            timed = [r[key][args.round_warmup:] for r in dec[impl]]  # each round's warm-up steps are not timed
            steps = [t for r in timed for t in r]
            wall = [t for r in dec[impl] for t in r["wall"][args.round_warmup:]]
            res[impl] = {"prefill_s": prefill_s, "prefill_tok_s": n / prefill_s,
                         "decode_ms": statistics.median(steps),
                         "round_ms": [statistics.median(r) for r in timed],
                         "wall_prefill_s": min(r["wall"] for r in runs[impl]),
                         "wall_decode_ms": statistics.median(wall), **peak,
                         "logits": [torch.from_numpy(x) for x in
                                    [runs[impl][-1]["logits"]] + [lg for r in dec[impl] for lg in r["logits"]]]}
    except Failed as exc:
        res = {i: {"error": str(exc) if i == exc.impl else f"not measured: {exc.impl} failed"} for i in impls}
    except (EOFError, BrokenPipeError) as exc:  # a process died without a word (e.g. the OOM killer)
        codes = {i: p.exitcode for i, p in procs.items()}
        res = {i: {"error": f"{type(exc).__name__}; process exit codes {codes}"} for i in impls}
    finally:
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return res


def _estimate_gb(impl: str, c, n: int, dtype_bytes: int) -> float:
    """Peak-memory estimate of one run (what is guarded against; deliberately generous)."""
    weights = 2.0 * c.hidden_size * c.vocab_size + c.num_layers * (
        4 * c.hidden_size * c.num_heads * c.head_dim + 3 * c.num_experts * c.hidden_size * c.intermediate_size)
    base = weights * dtype_bytes + 1.5 * 2**30
    if impl == "transformers":  # eager: [B, Hq, S, S] additive mask + scores + probs, index scores [B, G, S, S]
        return (base + n * n * (4 * c.num_heads * 4 + 3 * c.num_kv_heads * 4)) / 2**30
    tile = 256  # per query tile: scores + probs for all heads, index scores, masks
    return (base + tile * n * (3 * c.num_heads * 4 + 4 * c.num_kv_heads * 4) + 64 * n * c.hidden_size * 4) / 2**30


def _available_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0] / 2**30
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="tiny | small | m3-slice (real width, --layers layers)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ckpt", help="existing checkpoint directory (default: a synthetic one of --preset)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=256, help="decode steps per context (the median is quoted)")
    ap.add_argument("--rounds", type=int, default=8, help="decode rounds the steps are split into, alternating")
    ap.add_argument("--round-warmup", type=int, default=1, help="untimed steps at the start of every decode round")
    ap.add_argument("--reps", type=int, default=3, help="prefill repetitions (the best is quoted)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--mem-fraction", type=float, default=0.8, help="share of free memory the runs of one context "
                    "(all alive together) may be estimated at")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per run (1: CPU time = work done)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.steps // args.rounds <= args.round_warmup:
        ap.error(f"--steps {args.steps} in --rounds {args.rounds} leaves no timed step after --round-warmup "
                 f"{args.round_warmup}; raise --steps or lower --rounds")

    from minimax_m3.checkpoint.synthetic import write_synthetic

    c = _config(args)
    ckpt = args.ckpt or str(write_synthetic(Path(tempfile.mkdtemp(prefix="bench-")) / "ckpt", c, seed=0))
    dbytes = 4 if args.dtype == "float32" else 2
    tol = 2e-3 if args.dtype == "float32" else 5e-2  # relative to the largest |logit|
    name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else
            f"CPU x{args.threads} threads (times are CPU seconds of the run's process)")
    print(f"# {args.preset} ({c.num_layers} layers, hidden {c.hidden_size}, {c.num_experts} experts) on {name}, "
          f"{args.dtype}, torch {torch.__version__}; implementations measured interleaved", flush=True)
    rows, ok = [], True
    for n in args.contexts:
        res, live, budget = {}, [], args.mem_fraction * _available_gb(args.device)
        for impl in args.impls:  # the processes of one context are alive together: their estimates add up
            need = _estimate_gb(impl, c, n, dbytes)
            if need > budget:
                res[impl] = {"skipped": f"needs ~{need:.0f} GiB, {budget / args.mem_fraction:.0f} GiB free"}
            else:
                live.append(impl)
                budget -= need
        res.update(_measure(live, args, ckpt, n) if live else {})
        base = next((res[i] for i in args.impls if "logits" in res.get(i, {})), None)
        for r in res.values():
            if "logits" in r and r is not base:
                scale = max(1.0, max(float(x.abs().max()) for x in base["logits"]))
                r["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(base["logits"], r["logits"])) / scale
                if r["max_diff"] > tol:
                    ok = False
                    r["error"] = f"logits differ by {r['max_diff']:.2e} (relative) > {tol}: timings not quoted"
        hf = res.get("transformers", {})
        for impl in args.impls:
            r = res[impl]
            row = {"context": n, "impl": impl, **{k: v for k, v in r.items() if k != "logits"}}
            if "error" not in r and "skipped" not in r and "prefill_s" in hf and impl != "transformers":
                row["prefill_speedup"] = r["prefill_tok_s"] / hf["prefill_tok_s"]
                row["decode_speedup"] = hf["decode_ms"] / r["decode_ms"]
                per_round = [a / b for a, b in zip(hf["round_ms"], r["round_ms"])]  # paired: same load
                row["decode_speedup_paired"] = statistics.median(per_round)
                row["decode_speedup_rounds"] = [min(per_round), max(per_round)]
            ok &= "error" not in r
            rows.append(row)
            print(_fmt(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": name, "preset": args.preset, "dtype": args.dtype,
                                              "rows": rows}, indent=1))
    return 0 if ok else 1


def _fmt(row: dict) -> str:
    head = f"ctx {row['context']:>6}  {row['impl']:<15}"
    if "skipped" in row or "error" in row:
        return f"{head}  {'skipped: ' + row['skipped'] if 'skipped' in row else 'ERROR: ' + row['error']}"
    s = (f"{head}  prefill {row['prefill_tok_s']:9.1f} tok/s ({row['prefill_s']:7.2f} s; wall "
         f"{row['wall_prefill_s']:7.2f} s)  decode {row['decode_ms']:8.2f} ms/tok (wall {row['wall_decode_ms']:8.2f})"
         f"  peak {row['peak_gb']:6.2f} GiB")
    if "max_diff" in row:
        s += f"  logits diff {row['max_diff']:.1e}"
    if "prefill_speedup" in row:
        lo, hi = row["decode_speedup_rounds"]
        s += (f"  vs transformers: prefill x{row['prefill_speedup']:.1f}, decode x{row['decode_speedup']:.1f} "
              f"(per round: median x{row['decode_speedup_paired']:.1f}, x{lo:.1f}-x{hi:.1f})")
    return s


if __name__ == "__main__":
    sys.exit(main())
