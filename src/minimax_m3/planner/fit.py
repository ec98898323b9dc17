"""The largest context and batch that fit (bisection on :func:`plan`), and :func:`require_fit`, which a compile
calls before any compile: one :class:`FitError` naming the largest context and batch that do fit."""

from __future__ import annotations

from ..config.m3 import M3Config
from ..config.parallel import KV_LAYOUTS
from .base import GIB, PORT_LAYOUT, cache_multiple, PlanError
from .memory import MemoryPlan, plan

CONTEXT_LIMIT = 1 << 26  # the context search stops here (64M tokens, 64x M3's positions)
BATCH_LIMIT = 1 << 20


class FitError(PlanError):
    """A batch x context that does not fit one rank's HBM; ``largest_context`` (at the batch) and
    ``largest_batch`` (at the context) say what does (0: nothing)."""

    def __init__(self, problems: list[str], largest_context: int, largest_batch: int):
        super().__init__(problems, heading="MiniMax-M3 does not fit one rank's HBM:")
        self.largest_context, self.largest_batch = largest_context, largest_batch


def _largest(fits, step: int, lo: int, limit: int) -> int:
    """The largest ``n`` in ``lo, lo + step, ...`` (``<= limit``) with ``fits(n)``, for a ``fits`` true up to some
    point and false after it; 0 when ``fits(lo)`` is false. Doubling, then bisection in whole steps."""
    if not fits(lo):
        return 0
    good, bad = lo, None
    while bad is None:
        n = min(good * 2, limit) // step * step
        if n <= good:
            return good
        good, bad = (n, None) if fits(n) else (good, n)
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def largest_context(c: M3Config, tp: int, ep: int, batch: int, limit: int = CONTEXT_LIMIT, **kw) -> int:
    """The largest context (a multiple of the layout's cache multiple) that fits at ``batch``; ``kw`` as
    :func:`plan` (``layout``, ``chunk``, ``weights``, ...). With a fixed sharded ``chunk`` contexts start at the
    chunk (a paged segment may be longer than the context: the plugin compiles it all the same; with ``dcp`` contexts
    are whole virtual blocks of ``block x dcp``)."""
    layout = kw.get("layout", PORT_LAYOUT)
    step = cache_multiple(c, tp, layout, kw.get("dcp", 1))
    lo = max(step, kw.get("chunk") or step) if layout == "sharded" else step
    return _largest(lambda s: plan(c, tp, ep, batch, s, **kw).fits, step, lo, limit)


def largest_batch(c: M3Config, tp: int, ep: int, seq: int, limit: int = BATCH_LIMIT, **kw) -> int:
    """The largest batch that fits at ``seq`` tokens (0: not even one); ``kw`` as :func:`plan`."""
    return _largest(lambda b: plan(c, tp, ep, b, seq, **kw).fits, 1, 1, limit)


def _alternative(c: M3Config, tp: int, ep: int, batch: int, seq: int, option: str, kw: dict) -> str:
    """What ``option`` (the plan keywords ``kw``) would give instead: that it fits, else its largest context and
    batch."""
    if plan(c, tp, ep, batch, seq, **kw).fits:
        return f"with {option}: it fits"
    return (f"with {option}: largest context at batch {batch} {largest_context(c, tp, ep, batch, **kw)} tokens, "
            f"largest batch at {seq} tokens {largest_batch(c, tp, ep, seq, **kw)}")


def require_fit(c: M3Config, tp: int, ep: int, batch: int, seq: int, **kw) -> MemoryPlan:
    """The plan of ``batch`` x ``seq`` (``kw`` as :func:`plan`) when it fits; else one :class:`FitError` with the
    numbers and the largest context (at ``batch``) and batch (at ``seq``) that fit. A chunk the layout cannot use
    is refused first (:class:`~minimax_m3.planner.base.ChunkError`, with the sizes that work)."""
    p = plan(c, tp, ep, batch, seq, **kw)
    if p.fits:
        return p
    ctx, bat = largest_context(c, tp, ep, batch, **kw), largest_batch(c, tp, ep, seq, **kw)
    g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    calls = {"sharded": f", prefill calls of {p.chunk} tokens",
             "paged": f", prefill segments of {p.chunk} tokens" + (f", DCP {p.dcp}" if p.dcp > 1 else "")
             }.get(p.layout, "")
    copy = ", a decode copy of the experts (--decode-experts tp)" if p.decode_experts == "tp" else ""
    problems = [
        f"batch {batch} x {seq} tokens ({p.layout} caches{calls}, {p.weights} experts{copy}) needs "
        f"{g(p.total_bytes)} GiB per rank of {g(p.hbm_bytes)}: weights {g(p.weight_bytes)}, KV {g(p.kv_bytes)}, "
        f"index-K {g(p.index_k_bytes)}, prefill {g(p.prefill_bytes)}, reserve {g(p.reserve_bytes)}",
        f"largest context at batch {batch}: {ctx} tokens" if ctx else f"no context fits at batch {batch}",
        f"largest batch at {seq} tokens: {bat}" if bat else f"not even batch 1 fits at {seq} tokens",
    ]
    if p.decode_experts == "tp" or ep > 1 and p.layout != "paged":  # the other choice of how decode reads experts
        other = "ep" if p.decode_experts == "tp" else "tp"
        problems.append(_alternative(c, tp, ep, batch, seq, f"--decode-experts {other}",
                                     {**kw, "decode_experts": other}))
    if p.layout in KV_LAYOUTS:  # the port's other cache layout (the engine spec's kv_layout)
        other = KV_LAYOUTS[1 - KV_LAYOUTS.index(p.layout)]
        problems.append(_alternative(c, tp, ep, batch, seq, f"--kv-layout {other}",
                                     {**kw, "layout": other, "chunk": None}))
    raise FitError(problems, ctx, bat)
