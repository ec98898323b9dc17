"""Lazy access to a safetensors checkpoint: a sharded directory (index JSON + shards) or a single file.

Headers are parsed here (8-byte little-endian length, JSON, data) so that a truncated or corrupt shard is found
before any work starts, and every problem of every shard is collected rather than the first. Tensors are read with
``readinto`` into freshly allocated memory (no mmap), so what a reader has read does not stay resident.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import M3Error

INDEX = "model.safetensors.index.json"
DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
_OWN_MAP = 1 << 20


def anonymous(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 in an anonymous mapping of their own: returned to the OS the moment the tensor dies (heap
    chunks freed by malloc often stay resident, which would keep a converted rule's sources in RSS)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class BufferPool:
    """Recycled byte buffers for large tensors, keyed by exact size. Reusing pages that are already mapped skips the
    kernel's page faults and zero-fill, which cost more than the copy itself. ``give`` only what nobody else still
    uses; the pool keeps at most ``idle_bytes`` of idle buffers (the rest are freed)."""

    def __init__(self, idle_bytes: int = 256 << 20):
        self.idle_bytes = idle_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._mine: dict[int, int] = {}  # data pointer -> size of the buffers this pool allocated
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._idle -= nbytes
                return free.pop()
        buf = anonymous(nbytes)
        with self._lock:
            self._mine[buf.data_ptr()] = nbytes
        return buf

    def give(self, t: torch.Tensor) -> None:
        """Return the whole buffer behind ``t`` (any view of a buffer from :meth:`take`); others are ignored. Idle
        buffers beyond ``idle_bytes`` are freed, those of other sizes first (sizes in use change with the tensors)."""
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        with self._lock:
            if self._mine.get(ptr) != nbytes or nbytes > self.idle_bytes:
                self._mine.pop(ptr, None)
                return
            for size in sorted(self._free, key=lambda k: (k == nbytes, -k)):
                free = self._free[size]
                while free and self._idle + nbytes > self.idle_bytes:
                    self._mine.pop(free.pop().data_ptr(), None)
                    self._idle -= size
            self._idle += nbytes
            self._free.setdefault(nbytes, []).append(torch.empty(0, dtype=torch.uint8).set_(st))


class CheckpointError(M3Error, ValueError):
    """Everything wrong with a checkpoint, found before any work starts (one error, every problem)."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(problems, f"{source}: {len(problems)} problem(s):")


@dataclass(frozen=True)
class TensorInfo:
    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the data
    nbytes: int


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> tuple[dict[str, TensorInfo], list[str]]:
    """Parse one shard's header; returns (tensors, problems). Never raises for a bad file."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return {}, [f"{name}: {size} bytes is too short for a safetensors file (truncated?); re-download it"]
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                return {}, [f"{name}: header length {n} does not fit a {size}-byte file (corrupt or truncated header); "
                            "re-download it"]
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {}, [f"{name}: unreadable header ({exc.__class__.__name__}: {exc}); re-download it"]
    if not isinstance(header, dict):
        return {}, [f"{name}: header is not a JSON object (corrupt); re-download it"]
    problems: list[str] = []
    infos: dict[str, TensorInfo] = {}
    base = 8 + n
    end_max = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(s) for s in meta["shape"])
            a, b = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: tensor {key!r} has a malformed header entry {meta!r} (corrupt header)")
            continue
        numel = 1
        for s in shape:
            numel *= s
        if b - a != numel * element_size(dtype) or a < 0:
            problems.append(f"{name}: tensor {key!r} spans {b - a} bytes but {meta['dtype']}{list(shape)} needs "
                            f"{numel * element_size(dtype)} (corrupt header)")
            continue
        end_max = max(end_max, b)
        infos[key] = TensorInfo(name, dtype, shape, base + a, b - a)
    if base + end_max > size:
        problems.append(f"{name}: truncated — the header describes {base + end_max} bytes but the file has {size}; "
                        "re-download or re-copy this shard")
    return infos, problems


class CheckpointReader:
    """All tensors of a checkpoint, by key; ``problems`` lists every file-level defect found while opening."""

    def __init__(self, path: str | Path, strict: bool = True):
        self.root = Path(path)
        self.problems: list[str] = []
        self.infos: dict[str, TensorInfo] = {}
        self.weight_map: dict[str, str] = {}
        index = self.root / INDEX
        if self.root.is_file():
            self.root, shards = self.root.parent, [self.root.name]
        elif index.is_file():
            shards = self._read_index(index)
        elif (self.root / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            raise CheckpointError([f"no {INDEX} or model.safetensors here; point at a checkpoint directory"],
                                  str(self.root))
        seen: dict[str, str] = {}
        for shard in shards:
            p = self.root / shard
            if not p.is_file():
                self.problems.append(f"{shard}: missing shard (named in the index, not on disk); download it")
                continue
            infos, problems = read_header(p)
            self.problems.extend(problems)
            for key, info in infos.items():
                if key in seen:
                    self.problems.append(f"{key}: duplicated — stored in both {seen[key]} and {shard}; remove the "
                                         "stale shard or fix the index")
                    continue
                seen[key] = shard
                self.infos[key] = info
        if index.is_file() and self.weight_map:
            for key, shard in self.weight_map.items():
                if shard in seen.values() and seen.get(key) != shard and key not in self.infos:
                    self.problems.append(f"{key}: the index places it in {shard} but that shard does not hold it")
            for key, shard in seen.items():
                if key not in self.weight_map:
                    self.problems.append(f"{key}: stored in {shard} but absent from the index; regenerate the index")
        self.weight_map = {k: i.shard for k, i in self.infos.items()}
        self._files: dict[str, object] = {}
        self._open_lock = threading.Lock()
        if strict and self.problems:
            raise CheckpointError(self.problems, str(self.root))

    def _read_index(self, index: Path) -> list[str]:
        try:
            wm = json.loads(index.read_text())["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError([f"{INDEX}: unreadable ({exc}); re-download it"], str(self.root)) from None
        self.weight_map = dict(wm)
        return sorted(set(wm.values()))

    def keys(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def info(self, key: str) -> TensorInfo:
        if key not in self.infos:
            raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.root}")
        return self.infos[key]

    def shape(self, key: str) -> list[int]:
        return list(self.info(key).shape)

    def get(self, key: str, out: torch.Tensor | None = None, pool: "BufferPool | None" = None,
            rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``key`` (only its rows ``[r0, r1)`` along dim 0 if ``rows``) read from disk. ``out`` (contiguous,
        the bytes' size, any dtype) receives the bytes and is returned viewed as ``key``; else the memory comes from
        ``pool`` (recycled pages) or is freshly mapped."""
        info = self.info(key)
        if rows is not None:
            r0, r1 = rows
            if not info.shape or not 0 <= r0 <= r1 <= info.shape[0]:
                raise ValueError(f"{key}: rows {rows} outside {list(info.shape)}")
            row = info.nbytes // info.shape[0] if info.shape[0] else 0
            info = TensorInfo(info.shard, info.dtype, (r1 - r0, *info.shape[1:]), info.start + r0 * row,
                              (r1 - r0) * row)
        f = self._files.get(info.shard)
        if f is None:
            with self._open_lock:  # readers on several threads (preadv itself takes explicit offsets)
                f = self._files.get(info.shard)
                if f is None:
                    f = self._files[info.shard] = open(self.root / info.shard, "rb", buffering=0)
        if out is not None:
            if not out.is_contiguous() or out.numel() * out.element_size() != info.nbytes:
                raise ValueError(f"{key}: read buffer of {out.numel() * out.element_size()} bytes (contiguous: "
                                 f"{out.is_contiguous()}) cannot hold {info.nbytes}")
            buf = out.reshape(-1).view(torch.uint8)
        elif pool is not None and info.nbytes >= _OWN_MAP:
            buf = pool.take(info.nbytes)
        elif info.nbytes >= _OWN_MAP:
            buf = anonymous(info.nbytes)
        else:
            buf = torch.empty(info.nbytes, dtype=torch.uint8)
        mv = memoryview(buf.numpy()) if info.nbytes else memoryview(b"")
        got = 0
        while got < info.nbytes:  # one call moves at most ~2 GiB on Linux
            n = os.preadv(f.fileno(), [mv[got:]], info.start + got)
            if n <= 0:
                break
            got += n
        if got != info.nbytes:
            raise CheckpointError([f"{info.shard}: short read of {key!r} ({got} of {info.nbytes} bytes); the file "
                                   "changed or is truncated"], str(self.root))
        if info.dtype == torch.bool:
            return buf.view(torch.bool).reshape(info.shape)
        return buf.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
