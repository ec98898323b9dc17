"""Writing one output shard: pieces computed ahead by worker threads, written and checksummed by a writer thread.

A shard's entries become *tasks*: one per tensor, or one per expert for the fused expert tensors (their bytes are
``out[k]`` slices in order, so a ``[E, H, 2I]`` result is never held whole). Up to ``AHEAD`` tasks run at once on
``workers`` threads (file reads, torch kernels, ``zlib.crc32`` and file writes all release the GIL); the main thread
hands finished pieces, in order, to the writer thread, which writes them, extends the CRC32 and gives their buffers
back to the pool. A task whose tensor is at least ``OVERLAP_LIMIT`` bytes runs alone and is written before anything
else starts, so peak memory stays about one rule's sources and result.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

OVERLAP_LIMIT = 64 << 20
AHEAD = 3  # pieces computed ahead of the writer (each one expert slab or one tensor below OVERLAP_LIMIT)
WORKERS = max(1, min(4, os.cpu_count() or 1))
CHUNK = 1 << 20  # bytes per write call

Opener = Callable[[Path], object]


class ShapeError(RuntimeError):
    pass


def bytes_view(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard(path: Path, header: bytes, entries: list, tasks: Callable, opener: Opener, pool=None,
                workers: int = WORKERS, done: Callable = lambda e: None) -> tuple[int, int]:
    """Write ``header`` then, for each entry (``.name``, ``.shape``, ``.dtype``, ``.nbytes``), the pieces made by
    the callables ``tasks(entry)`` returns: one making the whole tensor, or ``shape[0]`` making its slices along
    dim 0. ``done(entry)`` is called once an entry is handed to the writer. Returns (size, crc32); removes the file
    on any failure."""
    q: queue.Queue = queue.Queue(maxsize=AHEAD)
    err: list[BaseException] = []
    state = {"crc": 0, "size": 0}

    def writer(f):
        try:
            while (item := q.get()) is not None:
                try:
                    mv = bytes_view(item)
                    for o in range(0, len(mv), CHUNK):  # the CRC reads what the write just touched, from cache
                        f.write(mv[o:o + CHUNK])
                        state["crc"] = zlib.crc32(mv[o:o + CHUNK], state["crc"])
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
                _run(work, ex, q, err, done)
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


def _run(work: list, ex: ThreadPoolExecutor, q: queue.Queue, err: list, done: Callable) -> None:
    def alone(i):
        e, _, n = work[i]
        return n == 1 and e.nbytes >= OVERLAP_LIMIT

    window: deque = deque()
    nxt, seen = 0, 0
    while window or nxt < len(work):
        while nxt < len(work) and len(window) < AHEAD and not (window and (alone(nxt) or alone(window[-1][0]))):
            window.append((nxt, ex.submit(work[nxt][1])))
            nxt += 1
        i, fut = window.popleft()
        e, _, n = work[i]
        t = fut.result()
        whole = n == 1 and tuple(t.shape) == e.shape
        if t.dtype != e.dtype or not (whole or (e.shape and n == e.shape[0] and tuple(t.shape) == e.shape[1:])):
            raise ShapeError(f"{e.name}: produced {t.dtype}{list(t.shape)} (piece of {n}) but the plan says "
                             f"{e.dtype}{list(e.shape)} (a rule's transform is not shape-stable)")
        q.put(t)
        del t, fut
        seen += 1
        if seen == n:
            done(e)
            seen = 0
        if alone(i):  # a large piece is not held while the next one is produced
            q.join()
        if err:
            return
