"""``minimax-m3 plan``: the plan of one layout at ``--batch`` / ``--seq`` (its decode ITL estimate, plain and with a
fused EAGLE3 step, at ``--collective-latency-us`` per collective), the sharded layout's collectives, the three
layouts side by side for contexts 4K..1M, the largest context and batch that fit, and with ``--speculative K`` the
projection of speculative decoding (tokens/s per sequence, batch 1-32, acceptance 1.5-3.5). ``--layout paged`` is
the vLLM Neuron model's (``--chunk``: its prefill segment; ``--dcp``: vLLM's decode context parallelism); its TTFT and
fused EAGLE3 step are not modelled."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..config import parallel
from ..config.parallel import KV_LAYOUTS
from ..config.draft import DraftConfig, parse_draft_config
from ..config.m3 import M3Config
from .cost import COLLECTIVE_LATENCY_S, HBM_BYTES_PER_S, PEAK_FLOPS_PER_S, Itl, collectives, decode_floor_ms, \
    decode_itl, link_seconds, ttft
from .fit import largest_batch, largest_context
from .base import GIB, HBM_PER_RANK_GIB, LAYOUTS, PAGED, PAGED_SEGMENTS, PAGED_TILE, cache_tokens, ChunkError, PlanError
from .memory import MemoryPlan, plan, weight_bytes
from .speculative import ITL_ACCEPTANCE, ITL_K, M3_DRAFT, format_projection, fused_itl, project

CONTEXTS = (4096, 32768, 131072, 524288, 1048576)


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _ctx(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _us(latency_s: float) -> str:
    return f"{latency_s * 1e6:g} us"


def format_ttft(c: M3Config, p: MemoryPlan, latency_s: float = COLLECTIVE_LATENCY_S) -> str:
    if p.layout == PAGED:
        return (f"TTFT estimate: not covered for the paged layout (planner/cost.py models the sharded layout's calls "
                f"and the replicated layout's one call, not vLLM Neuron's segments of {p.chunk} tokens)")
    t = ttft(c, p.tp, p.ep, p.seq, p.layout, p.chunk if p.layout == "sharded" else None, p.weights, p.kv_dtype,
             latency_s)
    calls = (f"{t.calls} call{'s' if t.calls > 1 else ''} of {t.chunk} tokens" if p.layout == "sharded" else
             f"one call of {t.chunk} tokens")
    return (f"TTFT estimate, a {p.seq}-token prompt: {t.total_s:.2f} s ({calls}; summed FLOP {t.flop_s:.2f} s at "
            f"{PEAK_FLOPS_PER_S / 1e12:.0f} TFLOP/s, HBM {t.hbm_s:.2f} s, link {t.link_s:.2f} s; the larger per call: "
            f"{t.bound_s:.2f} s; + {t.collectives} collectives x {_us(latency_s)} = "
            f"{t.latency_s:.2f} s)")


def _itl(i: Itl, latency_s: float) -> str:
    return (f"HBM {i.hbm_s * 1e3:.2f} ms (bytes a step must read / {HBM_BYTES_PER_S / 1e9:.0f} GB/s) + "
            f"{i.collectives} collectives, each max({_us(latency_s)}, its link time): "
            f"{i.collective_s * 1e3:.2f} ms")


def format_itl(c: M3Config, p: MemoryPlan, latency_s: float = COLLECTIVE_LATENCY_S, k: int = ITL_K,
               draft: DraftConfig = M3_DRAFT) -> list[str]:
    """The two ``decode ITL estimate`` lines of a plan: a plain decode step (:func:`.cost.decode_itl`) and a fused
    EAGLE3 step of ``k`` drafts at mean acceptance :data:`.speculative.ITL_ACCEPTANCE` (:func:`.speculative.fused_itl`),
    per step and per token; the paged layout's second line says it is not covered. With expert parallelism, a third
    line gives the other ``--decode-experts`` choice (:func:`format_decode_experts`). A decode step reads the
    experts at :attr:`MemoryPlan.decode_ep`."""
    plain = decode_itl(c, p.tp, p.decode_ep, p.batch, cache_tokens(c, p.tp, p.seq, p.layout, p.dcp), p.weights,
                       p.kv_dtype, p.layout, latency_s, p.dcp)
    at = f"at batch {p.batch}, {p.seq} tokens"
    line = f"decode ITL estimate {at}: {plain.total_s * 1e3:.2f} ms per step = {_itl(plain, latency_s)}"
    if p.layout not in KV_LAYOUTS:
        return [line, "decode ITL estimate, fused EAGLE3 step: not covered for the paged layout (vLLM Neuron verifies "
                      "and drafts in two forwards, the EagleProposer's call apart; planner/speculative.py models "
                      "NxDI's fused step)"]
    fused = fused_itl(c, p.tp, p.decode_ep, p.batch, p.seq, k, p.weights, p.kv_dtype, draft, p.layout, latency_s)
    lines = [line,
             f"decode ITL estimate, fused EAGLE3 step (k={k}, acceptance {ITL_ACCEPTANCE}) {at}: "
             f"{fused.total_s * 1e3:.2f} ms per step, {fused.total_s / ITL_ACCEPTANCE * 1e3:.2f} ms per token = "
             f"{_itl(fused, latency_s)}"]
    if p.ep > 1:
        lines.append(format_decode_experts(c, p, latency_s))
    lines.append(format_kv_layout(c, p, latency_s, k, draft))
    return lines


def format_kv_layout(c: M3Config, p: MemoryPlan, latency_s: float = COLLECTIVE_LATENCY_S, k: int = ITL_K,
                     draft: DraftConfig = M3_DRAFT) -> str:
    """The port's other cache layout (``--kv-layout``) beside a plan of one: its plain and fused decode ITL and its
    memory at the same batch, context and experts. The replicated layout runs 2 collectives per layer in decode
    where the sharded one runs 4, and reads each KV head's selected blocks on all G ranks where the sharded one
    reads 1/G on each: the faster one depends on batch x context (and only the sharded one fits long contexts)."""
    other = KV_LAYOUTS[1 - KV_LAYOUTS.index(p.layout)]
    q = plan(c, p.tp, p.ep, p.batch, p.seq, p.weights, p.kv_dtype, layout=other, decode_experts=p.decode_experts,
             reserve_gib=p.reserve_bytes / GIB, hbm_gib=p.hbm_bytes / GIB)  # one request per prefill call
    itl = decode_itl(c, q.tp, q.decode_ep, q.batch, cache_tokens(c, q.tp, q.seq, other), q.weights, q.kv_dtype,
                     other, latency_s)
    fused = fused_itl(c, q.tp, q.decode_ep, q.batch, q.seq, k, q.weights, q.kv_dtype, draft, other, latency_s)
    return (f"with --kv-layout {other}: {itl.total_s * 1e3:.2f} ms per step ({itl.collectives} collectives), fused "
            f"EAGLE3 {fused.total_s / ITL_ACCEPTANCE * 1e3:.2f} ms per token; {q.total_bytes / GIB:.2f} GiB, "
            f"{'fits' if q.fits else 'does not fit'}")


def format_decode_experts(c: M3Config, p: MemoryPlan, latency_s: float = COLLECTIVE_LATENCY_S) -> str:
    """The other ``--decode-experts`` choice beside a plan: its plain decode ITL and its memory (the decode copy of
    the routed experts, ``weight_bytes(..., decode_experts="tp")``, added or taken away)."""
    other = "ep" if p.decode_experts == "tp" else "tp"
    itl = decode_itl(c, p.tp, parallel.decode_ep(p.ep, other), p.batch, cache_tokens(c, p.tp, p.seq, p.layout),
                     p.weights, p.kv_dtype, p.layout, latency_s)
    copy = weight_bytes(c, p.tp, p.ep, p.weights, "tp")[1]["decode expert copy"]
    total = p.total_bytes + (copy if other == "tp" else -copy)
    fits = "fits" if total <= p.hbm_bytes else "does not fit"
    what = (f"a decode copy of the routed experts over all {p.tp} ranks, read by selected expert: adds "
            if other == "tp" else "decode reads the prefill's expert shards, no copy: saves ")
    return (f"with --decode-experts {other} ({what}{copy / GIB:.2f} GiB per rank): {itl.total_s * 1e3:.2f} ms per "
            f"step = {_itl(itl, latency_s)}; {total / GIB:.2f} GiB, {fits}")


def format_plan(p: MemoryPlan, c: M3Config, parts: dict[str, int] | None = None,
                latency_s: float = COLLECTIVE_LATENCY_S, k: int = ITL_K, draft: DraftConfig = M3_DRAFT) -> str:
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    lines = [f"MiniMax-M3 on tp={p.tp} ep={p.ep} (moe_tp={parallel.moe_tp(p.tp, p.ep)}), batch={p.batch}, seq={p.seq}, "
             f"prefill batch={p.ctx_batch}, weights {p.weights}"
             f"{', decode experts tp (a copy)' if p.decode_experts == 'tp' else ''}, KV {p.kv_dtype}, {p.layout} caches"
             f"{(' (vLLM Neuron' + (f', DCP {p.dcp}' if p.dcp > 1 else '') + ')') if p.layout == PAGED else ''}; "
             "per rank:"]
    lines.append(f"  weights              {gib(p.weight_bytes)}")
    for name, n in (parts or {}).items():
        lines.append(f"    {name:<19}{gib(n)}")
    what = {"replicated": f"{p.chunk} queries", "sharded": f"one call of {p.chunk} tokens",
            PAGED: f"{min(PAGED_TILE, p.chunk)} queries + a row's key line"}[p.layout]
    of = f"activations of one {p.chunk}-token segment" if p.layout == PAGED else "activations"
    phases = [(name + (f" ({what})" if name.startswith("attention") else ""), n) for name, n in p.phases]
    width = max(36, *(len(name) + 1 for name, _ in phases))
    lines += [
        f"  KV cache             {gib(p.kv_bytes)}",
        f"  index-K cache        {gib(p.index_k_bytes)}",
        f"  prefill working mem  {gib(p.prefill_bytes)}  ({of} + the larger of:)",
        *(f"    {name:<{width}}{gib(n)}" for name, n in phases),
        f"  runtime reserve      {gib(p.reserve_bytes)}  (assumed)",
        f"  total                {gib(p.total_bytes)}  of {p.hbm_bytes / GIB:.2f} GiB per logical core",
    ]
    free = p.hbm_bytes - p.total_bytes
    verdict = "FITS" if p.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: {'headroom' if p.fits else 'short by'} {abs(free) / GIB:.2f} GiB")
    lines += format_itl(c, p, latency_s, k, draft)
    lines.append(format_ttft(c, p, latency_s))
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def format_collectives(c: M3Config, tp: int, ep: int, batch: int, chunk: int, latency_s: float = COLLECTIVE_LATENCY_S
                       ) -> str:
    """The sharded layout's collectives per pass: a decode step at ``batch`` and one prefill call of ``chunk``."""
    dec = collectives(c, tp, ep, batch, "sharded")
    pre = collectives(c, tp, ep, chunk, "sharded", logit_rows=1, phase="prefill")
    lines = ["collectives of the sharded layout (bytes: the full buffer on each rank; count: per pass):",
             f"  {'':<38}{'kind':<16}{'ranks':>5}  {'dtype':<6}{f'decode b={batch}':>22}{f'prefill C={chunk}':>24}"]
    names = list(dict.fromkeys(r["name"] for r in dec + pre))
    for name in names:
        d = next((r for r in dec if r["name"] == name), None)
        p = next((r for r in pre if r["name"] == name), None)
        r = d or p
        cell = lambda x: f"{x['count']} x {_size(x['bytes'])}" if x else "-"  # noqa: E731
        lines.append(f"  {name:<38}{r['kind']:<16}{r['ranks']:>5}  {r['dtype']:<6}{cell(d):>22}{cell(p):>24}")
    rep = collectives(c, tp, ep, batch, "replicated")
    for what, rows in (("decode step", dec), ("prefill call", pre), ("decode step, replicated layout", rep)):
        n = sum(r["count"] for r in rows)
        link = sum(link_seconds(r) * r["count"] for r in rows)
        lines.append(f"  per {what}: {n} collectives, {n * latency_s * 1e3:.2f} ms at {_us(latency_s)} each, link "
                     f"time {link * 1e3:.2f} ms")
    return "\n".join(lines)


def _cells(c: M3Config, tp: int, ep: int, batch: int, seq: int, kw: dict, layout: str, chunk: int | None,
           latency_s: float, dcp: int = 1) -> str:
    width = 29 if layout == PAGED else 38
    try:
        p = plan(c, tp, ep, batch, seq, layout=layout, chunk=chunk, **kw, **({"dcp": dcp} if dcp > 1 else {}))
    except ChunkError:
        return f"{'chunk > context':>{width}}"
    except PlanError:  # the paged layout refusing the options
        return f"{_refused(kw):>{width}}"
    floor = decode_floor_ms(c, tp, p.decode_ep, batch, cache_tokens(c, tp, seq, layout, p.dcp), p.weights, p.kv_dtype,
                            layout, p.dcp)
    head = f"{p.chunk:>6} " if layout != "replicated" else ""
    if layout == PAGED:  # no TTFT model
        return f"{head}{p.total_bytes / GIB:7.2f} {'yes' if p.fits else 'no':>4} {floor:9.2f}"
    t = ttft(c, tp, ep, seq, layout, p.chunk if layout == "sharded" else None, p.weights, p.kv_dtype, latency_s)
    return f"{head}{p.total_bytes / GIB:7.2f} {'yes' if p.fits else 'no':>4} {floor:9.2f} {t.total_s:8.2f}"


def _refused(kw: dict) -> str:
    """What a layout's cell says when :func:`plan` refuses the options (the paged layout: bf16 pages, decode
    experts as prefill's)."""
    if kw.get("kv_dtype") == "fp8":
        return "bf16 pages only"
    return "decode ep only" if kw.get("decode_experts") == "tp" else "not served"


def _segment(chunk: int | None) -> int | None:
    """A paged segment to hold at every context: ``chunk`` when it is one of the plugin's segment sizes (a
    single-shot one, ``--chunk = --seq``, holds at that context only)."""
    return chunk if chunk in PAGED_SEGMENTS else None


def format_table(c: M3Config, tp: int, ep: int, batch: int, kw: dict, chunk: int | None = None,
                 contexts: tuple[int, ...] = CONTEXTS, latency_s: float = COLLECTIVE_LATENCY_S,
                 segment: int | None = None, dcp: int = 1) -> str:
    """The layouts side by side per context: total GiB, fits, decode floor (ms), TTFT (s, prompt = context; not for
    the paged layout). ``chunk``: the sharded layout's; ``segment``, ``dcp``: the paged layout's."""
    g = parallel.kv_group_size(c, tp)
    lines = [f"batch {batch}, tp {tp} / ep {ep}, {kw.get('weights', 'bf16')} experts, KV {kw.get('kv_dtype', 'bf16')}"
             f", GiB per rank of {kw.get('hbm_gib', HBM_PER_RANK_GIB):.2f}; TTFT of a prompt as long as the context:",
             f"{'':>8} | {'replicated (GQA copies)':<32} | {f'sharded (caches / {g}, chunked prefill)':<47} | "
             f"paged (vLLM Neuron, segments{f', DCP {dcp}' if dcp > 1 else ''})",
             f"{'context':>8} | {'GiB':>7} {'fits':>4} {'decode ms':>9} {'TTFT s':>8} | {'chunk':>6} {'GiB':>7} "
             f"{'fits':>4} {'decode ms':>9} {'TTFT s':>8} | {'seg':>6} {'GiB':>7} {'fits':>4} {'decode ms':>9}"]
    for s in contexts:
        lines.append(f"{_ctx(s):>8} | {_cells(c, tp, ep, batch, s, kw, 'replicated', None, latency_s)} | "
                     f"{_cells(c, tp, ep, batch, s, kw, 'sharded', chunk, latency_s)} | "
                     f"{_cells(c, tp, ep, batch, s, kw, PAGED, _segment(segment), latency_s, dcp)}")
    return "\n".join(lines)


def format_largest(c: M3Config, tp: int, ep: int, batch: int, seq: int, kw: dict, chunk: int | None = None,
                   segment: int | None = None, dcp: int = 1) -> str:
    """The largest context at ``batch`` and the largest batch at ``seq`` of each layout (``chunk``: the sharded
    layout's, ``segment`` and ``dcp``: the paged layout's; a layout the options rule out says why instead)."""
    chunks = {"replicated": None, "sharded": chunk, PAGED: segment}
    at_any = {**chunks, PAGED: _segment(segment)}  # the chunks held while the context varies
    ctx, bat = {}, {}
    for lay in LAYOUTS:
        kw_lay = {**kw, "dcp": dcp} if lay == PAGED and dcp > 1 else kw
        try:
            n = largest_context(c, tp, ep, batch, layout=lay, chunk=at_any[lay], **kw_lay)
            ctx[lay] = f"{n:,} tokens"
        except PlanError:  # the paged layout refusing the options
            ctx[lay] = _refused(kw)
        try:
            bat[lay] = str(largest_batch(c, tp, ep, seq, layout=lay, chunk=chunks[lay], **kw_lay))
        except ChunkError:
            bat[lay] = "chunk > context"
        except PlanError:
            bat[lay] = _refused(kw)
    named = {PAGED: f"{PAGED} (DCP {dcp})"} if dcp > 1 else {}
    return (f"largest context at batch {batch}: " + "; ".join(f"{named.get(lay, lay)} {n}" for lay, n in ctx.items())
            + f" (the model has {c.max_position_embeddings:,} positions)\n"
            + f"largest batch at {seq:,} tokens: " + "; ".join(f"{named.get(lay, lay)} {n}" for lay, n in bat.items()))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tp", type=int, default=parallel.TRN2["tp"], help="tensor-parallel degree (ranks; default: "
                    "trn2.48xlarge's %(default)s)")
    ap.add_argument("--ep", type=int, default=parallel.TRN2["ep"], help="expert-parallel degree for the MoE (default: "
                    "%(default)s)")
    ap.add_argument("--batch", type=int, required=True, help="sequences decoded together")
    ap.add_argument("--seq", type=int, required=True, help="maximum tokens per sequence (prompt + output)")
    ap.add_argument("--layout", choices=LAYOUTS, default="sharded",
                    help="cache layout of the detailed plan (default sharded, the port's; replicated: NxDI's GQA "
                         "copies; paged: the vLLM Neuron model's pages, prompts in segments)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="sharded: tokens per prefill call, a multiple of lcm(block, G) (default: chosen); with "
                         "--layout paged: the prefill segment, vLLM Neuron's max_num_batched_tokens, one of "
                         "512..8192 (default 8192, or --seq when shorter)")
    ap.add_argument("--dcp", type=int, default=1, metavar="N",
                    help="vLLM Neuron's --decode-context-parallel-size, paged layout only: each request's pages dealt "
                         "by whole blocks over N of the ranks that share a KV head (N divides tp / KV heads; "
                         "default 1)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="routed-expert weight format")
    ap.add_argument("--decode-experts", choices=parallel.DECODE_EXPERTS, default="ep",
                    help="how decode reads the routed experts: ep (default), the prefill's expert shards, every "
                         "local expert each step; tp, a second copy split over all --tp ranks, a step reading only "
                         "its tokens' experts' slices (the port's --decode-experts; costs the copy's memory)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="KV and index-K cache dtype")
    ap.add_argument("--ctx-batch", type=int, default=None,
                    help="replicated: sequences prefilled together (default 1: continuous batching; B: static; "
                         "the sharded and paged layouts prefill one)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="runtime/scratchpad reserve (default 3)")
    ap.add_argument("--hbm-gib", type=float, default=HBM_PER_RANK_GIB, help="HBM per rank (default 24)")
    ap.add_argument("--config", default=None, help="config.json or checkpoint folder (default: the M3 release)")
    ap.add_argument("--collective-latency-us", default=None, metavar="US",
                    help="fixed latency per collective in microseconds, >= 0, for the decode ITL estimate (where a "
                         "collective's link time is larger, that), the TTFT estimate and the speculative projection "
                         f"(default {COLLECTIVE_LATENCY_S * 1e6:g}: planner/cost.py's assumption)")
    ap.add_argument("--speculative", type=int, default=None, metavar="K",
                    help="also project speculative decoding with K drafts per step: tokens/s per sequence at batch "
                         "1-32 for acceptance lengths 1.5-3.5 against plain decode (planner/speculative.py); the "
                         f"fused step's ITL estimate takes K too (default {ITL_K})")
    ap.add_argument("--draft", default=None, help="--speculative: the EAGLE3 draft checkpoint (or its config.json) "
                                                  "whose size to count (default: an assumed M3 draft)")


def _draft(path: str | None) -> DraftConfig:
    if path is None:
        return M3_DRAFT
    f = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        dc, problems = parse_draft_config(json.loads(f.read_text()))
    except (OSError, ValueError) as exc:
        raise PlanError([f"--draft {path}: unreadable config ({exc})"]) from None
    if dc is None or problems:
        raise PlanError([f"--draft {path}: {p}" for p in problems])
    return dc


def latency_seconds(us: str | float | None) -> float:
    """``--collective-latency-us`` in seconds (None: ``COLLECTIVE_LATENCY_S``): a finite number >= 0, else one
    :class:`PlanError` naming the option."""
    if us is None:
        return COLLECTIVE_LATENCY_S
    try:
        s = float(us) * 1e-6
    except (TypeError, ValueError):
        s = math.nan
    if not (math.isfinite(s) and s >= 0):
        raise PlanError(f"--collective-latency-us {us!r}: expected a latency in microseconds, a number >= 0")
    return s


def run(args: argparse.Namespace) -> int:
    c = M3Config.from_pretrained(args.config) if args.config else M3Config.preset("m3")
    kw = dict(weights=args.weights, kv_dtype=args.kv_dtype, reserve_gib=args.reserve_gib, hbm_gib=args.hbm_gib,
              decode_experts=args.decode_experts)
    try:
        lat = latency_seconds(args.collective_latency_us)
        draft = _draft(args.draft)
        segment = args.chunk if args.layout == PAGED else None  # --chunk is the paged layout's segment there
        p = plan(c, args.tp, args.ep, args.batch, args.seq, ctx_batch=args.ctx_batch, layout=args.layout,
                 chunk=None if args.layout == "replicated" else args.chunk, dcp=args.dcp, **kw)
        shard_chunk = None if args.layout == PAGED else args.chunk
        sharded_chunk = plan(c, args.tp, args.ep, args.batch, args.seq, layout="sharded", chunk=shard_chunk,
                             **kw).chunk
        print(format_plan(p, c, weight_bytes(c, args.tp, args.ep, args.weights, args.decode_experts)[1], lat,
                          args.speculative or ITL_K, draft))
        print()
        print(format_collectives(c, args.tp, args.ep, args.batch, sharded_chunk, lat))
        print()
        print(format_table(c, args.tp, args.ep, args.batch, kw, shard_chunk, latency_s=lat, segment=segment,
                           dcp=args.dcp))
        print(format_largest(c, args.tp, args.ep, args.batch, args.seq, kw, shard_chunk, segment, args.dcp))
        if args.speculative:
            print()
            rows = project(c, args.tp, p.decode_ep, args.seq, args.speculative, args.weights, args.kv_dtype, draft,
                           latency_s=lat)
            print(format_projection(rows, args.seq, args.weights))
    except PlanError as e:
        print(f"minimax-m3 plan: {e}")
        return 2
    return 0 if p.fits else 1


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``minimax-m3`` command; the handler is ``args.func(args)`` → exit code."""
    ap = subparsers.add_parser("plan", help="per-rank HBM, decode floor and TTFT of a TP x EP layout on trn2 "
                                            "(no Neuron SDK)", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.set_defaults(func=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minimax-m3 plan")
    add_arguments(ap)
    return run(ap.parse_args(argv))
