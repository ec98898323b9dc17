"""Writing one output shard: pieces computed ahead by worker threads, written and checksummed by a writer thread.

A shard's entries become *tasks*: one per tensor, or one per row block — per expert for the fused expert tensors
(their bytes are the ``out[k]`` in order, so a ``[E, H, 2I]`` result is never held whole), per ~16 MiB of rows for
copies and dim-0 concatenations. Up to ``AHEAD`` tasks run at once on
``workers`` threads (file reads, torch kernels, ``zlib.crc32`` and file writes all release the GIL), each piece's
CRC32 computed there too; the main thread combines the CRCs and hands the pieces, in order, to the writer thread,
which writes them and gives their buffers back to the pool. A task whose tensor is at least ``OVERLAP_LIMIT``
bytes runs alone and is written before anything else starts, so peak memory stays about one rule's sources and
result.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from ..errors import M3Error

OVERLAP_LIMIT = 64 << 20
AHEAD = 3  # pieces computed ahead of the writer (each one expert slab or one tensor below OVERLAP_LIMIT)
WORKERS = max(1, min(4, os.cpu_count() or 1))

Opener = Callable[[Path], object]


class ShapeError(M3Error, RuntimeError):
    """A tensor whose shape does not match what its mapping rule or target expects."""


def file_crc(path: Path, chunk: int = 1 << 24) -> int:
    """CRC32 of a whole file, read in ``chunk``-byte pieces (the value ``write_shard`` returns for it)."""
    crc, buf = 0, bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(memoryview(buf)[:n], crc)
    return crc


def bytes_view(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard(path: Path, header: bytes, entries: list, tasks: Callable, opener: Opener, pool=None,
                workers: int = WORKERS, done: Callable = lambda e: None) -> tuple[int, int]:
    """Write ``header`` then, for each entry (``.name``, ``.shape``, ``.dtype``, ``.nbytes``), the pieces made by
    the callables ``tasks(entry)`` returns: the whole tensor, or consecutive row blocks of it (dim 0).
    ``done(entry)`` is called once an entry is handed to the writer. Returns (size, crc32); removes the file on any
    failure."""
    q: queue.Queue = queue.Queue(maxsize=AHEAD)
    err: list[BaseException] = []
    state = {"crc": 0, "size": 0}

    def writer(f):
        try:
            while (item := q.get()) is not None:
                try:
                    mv = bytes_view(item)
                    f.write(mv)
                    state["size"] += len(mv)
                    del mv
                    if pool is not None:
                        pool.give(item)
                    del item
                finally:
                    q.task_done()
        except BaseException as exc:  # noqa: BLE001 — re-raised in the caller
            err.append(exc)
            while q.get() is not None:
                q.task_done()

    work = [(e, fn, n) for e in entries for fns in [tasks(e)] for n in [len(fns)] for fn in fns]
    try:
        with opener(path) as f:
            f.write(header)
            state["crc"], state["size"] = zlib.crc32(header), len(header)
            th = threading.Thread(target=writer, args=(f,), daemon=True)
            th.start()
            ex = ThreadPoolExecutor(max(1, workers), thread_name_prefix="convert")
            try:
                state["crc"] = _run(work, ex, q, err, done, state["crc"])
            finally:
                ex.shutdown(wait=True, cancel_futures=True)
                q.put(None)
                th.join()
            if err:
                raise err[0]
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return state["size"], state["crc"]


def _piece(fn: Callable) -> tuple[torch.Tensor, int, int]:
    """Run one task on a worker; its piece's CRC32 and length come with it (CRC work spread over the workers)."""
    t = fn()
    mv = bytes_view(t)
    return t, zlib.crc32(mv), len(mv)


def _run(work: list, ex: ThreadPoolExecutor, q: queue.Queue, err: list, done: Callable, crc: int) -> int:
    """Hand the pieces to the writer in order; returns the CRC32 of ``crc``'s bytes followed by every piece."""
    def alone(i):
        e, _, n = work[i]
        return e.nbytes // n >= OVERLAP_LIMIT

    window: deque = deque()
    nxt, rows, seen = 0, 0, 0
    while window or nxt < len(work):
        while nxt < len(work) and len(window) < AHEAD and not (window and (alone(nxt) or alone(window[-1][0]))):
            window.append((nxt, ex.submit(_piece, work[nxt][1])))
            nxt += 1
        i, fut = window.popleft()
        e, _, n = work[i]
        t, piece_crc, nbytes = fut.result()
        ok = t.dtype == e.dtype and (tuple(t.shape) == e.shape == () or (
            t.dim() == len(e.shape) > 0 and tuple(t.shape[1:]) == e.shape[1:] and rows + t.shape[0] <= e.shape[0]))
        if not ok:
            raise ShapeError(f"{e.name}: produced {t.dtype}{list(t.shape)} (piece {seen + 1} of {n}) but the plan "
                             f"says {e.dtype}{list(e.shape)} (a rule's transform is not shape-stable)")
        rows += t.shape[0] if t.dim() else 0
        seen += 1
        if seen == n and rows != (e.shape[0] if e.shape else 0):
            raise ShapeError(f"{e.name}: produced {rows} of {e.shape[0]} rows")
        crc = crc32_combine(crc, piece_crc, nbytes)
        q.put(t)
        del t, fut
        if seen == n:
            done(e)
            rows = seen = 0
        if alone(i):  # a large piece is not held while the next one is produced
            q.join()
        if err:
            break
    return crc


# ---- CRC-32 of a concatenation from the parts' CRCs (zlib's crc32_combine, which Python does not expose) ----------
_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial (reflected bit order, x^0 in bit 31)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k): x^1, x^2, x^4, ...
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@lru_cache(maxsize=256)
def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: appending n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
