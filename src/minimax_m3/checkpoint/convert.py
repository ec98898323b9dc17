"""Streaming conversion: one rule at a time, one shard per unit (globals, then each layer), resumable, atomic.

``convert(src, out, to="bf16" | "neuron")`` validates the source first (every problem, one error), plans every
output tensor's name/shape/dtype by running the rule table on meta tensors, then writes each unit's shard header
followed by its tensors as the rules produce them (:mod:`.pipeline`: a few pieces computed ahead on worker threads,
fused expert tensors one expert slab at a time, buffers recycled, written with O_DIRECT by :mod:`.direct`) — so host
memory holds a few pieces, or one large rule, never a whole layer. Shards go to ``OUT.partial/`` as hidden
``*.tmp`` files and are renamed once complete and fsynced; a journal records each finished shard's size and
CRC32, so a rerun of the same command skips (and re-verifies) them. ``OUT`` itself appears only when everything
is written, by one rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .._atomic import atomic_path, move_into_place, write_atomic
from ..config.m3 import M3Config
from .direct import DirectFile
from .pipeline import Opener, ShapeError, file_crc, write_shard
from .mapping import BF16, REFERENCE, RuleTable, _sources, apply_rule, layer_units, target_name, unit_rules
from .reader import DTYPE_NAMES, INDEX, BufferPool
from .source import Source
from .validate import open_checkpoint
from ..errors import M3Error

JOURNAL = "convert-journal.json"
AUDIT = "conversion_audit.json"
SKIP_FILES = {INDEX, "config.json", "hf_quant_config.json", JOURNAL, AUDIT}


class ConversionError(M3Error, RuntimeError):
    """A conversion that could not finish; the message says what was kept and how to resume."""


def target_table(to: str, c: M3Config, tp: int = 1, fused_qkv: bool = False) -> RuleTable:
    if to == "bf16":
        return BF16
    if to == "reference":
        return REFERENCE
    if to == "neuron":
        try:
            from . import nxdi_rules
        except ImportError as exc:
            raise ConversionError(f"--to neuron needs minimax_m3.checkpoint.nxdi_rules (the NxDI rule table): "
                                  f"{exc}") from None
        glob, layer = nxdi_rules.nxdi_rules(c, tp, fused_qkv)
        return RuleTable("neuron", tuple(glob), tuple(layer))
    raise ConversionError(f"unknown target {to!r}; choose bf16, neuron or reference")


@dataclass
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rule: object
    unit: int | None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class ConversionPlan:
    """Every output tensor, grouped by unit, with the source keys each unit consumes."""

    def __init__(self, source: Source, c: M3Config, table: RuleTable, dtype: torch.dtype):
        self.source, self.c, self.table, self.dtype = source, c, table, dtype
        keys = source.keys()
        fp32 = lambda k: source.out_dtype(k) == torch.float32 and source.logical[k].encoding == "plain"  # noqa
        meta = lambda k: torch.empty(source.logical[k].shape, dtype=source.out_dtype(k), device="meta")  # noqa
        self.units: list[tuple[int | None, list[Planned]]] = []
        self.consumed: dict[str, str] = {}  # logical source key -> first target using it
        units = [None] + [u for u in layer_units(self.c) if u is not None]
        for unit in units:
            entries = []
            for rule in unit_rules(c, unit, table, keys, fp32):
                for k in _rule_sources(rule, unit, c):
                    self.consumed.setdefault(k, target_name(rule, unit))
                t = apply_rule(rule, unit, c, meta, dtype)
                entries.append(Planned(target_name(rule, unit), tuple(t.shape), t.dtype, rule, unit))
            if entries:
                self.units.append((unit, entries))
        n = len(self.units)
        self.shards = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.table.name.encode())
        for shard, (_, entries) in zip(self.shards, self.units):
            h.update(shard.encode())
            for e in entries:
                h.update(f"{e.name}|{e.shape}|{e.dtype}".encode())
        r = self.source.reader
        for key in sorted(r.infos):
            i = r.infos[key]
            h.update(f"{key}|{i.shard}|{i.start}|{i.nbytes}|{i.dtype}".encode())
        for shard in sorted({i.shard for i in r.infos.values()}):
            st = (r.root / shard).stat()
            h.update(f"{shard}|{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()[:32]


def _rule_sources(rule, unit, c) -> list[str]:
    from .mapping import _flat, _sources

    return _flat(_sources(t, unit, c) for t in rule.sources)


def _header(entries: list[Planned]) -> bytes:
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        hdr[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


# the pipeline's threads (workers computing pieces, a writer) already use the cores; torch's intra-op threads on top
# of them only contend (measured slower for the chunked dequantization and the transposes)
TORCH_THREADS = int(os.environ.get("MINIMAX_M3_CONVERT_THREADS", "1"))
SLICE = 16 << 20  # bytes per piece when a large copy or concatenation is streamed in row blocks


def _slab_tasks(source: Source, rule, unit: int, c: M3Config, dtype: torch.dtype, pool: BufferPool) -> list:
    """One task per expert for an ``expert_slabs`` rule (see mapping): ``cat([source[k] ...], 0).t()``, the bytes
    of ``out[k]`` of the rule's ``[E, ...]`` result. The sources are read (dequantized) straight into one stacked
    buffer and transposed into a slab; all experts are never held at once."""
    keys = [_sources(t, unit, c) for t in rule.sources]
    rows = [source.logical[k[0]].shape[0] for k in keys]
    cols = source.logical[keys[0][0]].shape[1]
    n = sum(rows) * cols * dtype.itemsize
    scale = getattr(rule.transform, "slab_scale", 1.0)  # a factor folded into the weights (nxdi_rules)

    def slab(x: int) -> torch.Tensor:
        stacked = pool.take(n).view(dtype).view(sum(rows), cols)
        r0 = 0
        for k, m in zip(keys, rows):
            source.get(k[x], dtype, out=stacked[r0:r0 + m], pool=pool)
            r0 += m
        out = pool.take(n).view(dtype).view(cols, sum(rows))
        out.copy_(stacked.t())  # contiguous destination: torch's blocked transpose
        pool.give(stacked)
        if scale != 1.0:
            out.mul_(scale)
        return out.unsqueeze(0)

    return [partial(slab, x) for x in range(len(keys[0]))]


def _row_tasks(source: Source, rule, unit, c: M3Config, dtype: torch.dtype, pool: BufferPool) -> list | None:
    """Row blocks (~SLICE bytes) of each source in order, for a ``concat_rows`` rule (``cat(sources, 0)``)."""
    keys = [_sources(t, unit, c) for t in rule.sources]
    if not keys or any(isinstance(k, list) for k in keys):
        return None
    out = []
    for k in keys:
        shape = source.logical[k].shape
        if not shape:
            return None
        row = dtype.itemsize
        for d in shape[1:]:
            row *= d
        step = max(1, SLICE // max(1, row))
        out += [partial(source.get, k, dtype, None, pool, (r, min(r + step, shape[0])))
                for r in range(0, shape[0], step)]
    return out


def _save_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n", fsync=False)


def convert(src: str | Path, out: str | Path, to: str = "bf16", dtype: torch.dtype = torch.bfloat16, tp: int = 1,
            verify: bool = False, force: bool = False, progress: bool = True, opener: Opener | None = None,
            config: M3Config | None = None, fused_qkv: bool = False):
    """Convert ``src`` into ``out``; returns the :class:`~minimax_m3.checkpoint.audit.Audit` (checked when
    ``verify``). ``opener(path)`` opens a shard for writing (tests inject failing writers)."""
    from .audit import audit_conversion

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConversionError(f"{out} exists and is not empty; choose another --out or pass --force")
    report = open_checkpoint(src, config, deep=True)  # every problem, before any work
    source, c = report.source, report.config
    table = target_table(to, c, tp, fused_qkv)
    plan = ConversionPlan(source, c, table, dtype)
    fp = plan.fingerprint()
    stage = out.parent / (out.name + ".partial")
    journal_path = stage / JOURNAL
    done: dict = {}
    if stage.exists():
        try:
            journal = json.loads(journal_path.read_text())
        except (OSError, ValueError):
            journal = {}
        if journal.get("fingerprint") != fp:
            if not force:
                raise ConversionError(f"{stage} holds an unfinished conversion with different inputs or arguments; "
                                      "rerun the same command to resume it, or pass --force to discard it")
            shutil.rmtree(stage)
        else:
            done = journal.get("done", {})
    stage.mkdir(parents=True, exist_ok=True)
    for leftover in stage.glob("*.tmp"):
        leftover.unlink()
    opener = opener or DirectFile
    pool = BufferPool()
    cast_get = lambda k, dt: source.get(k, dt, pool=pool)  # noqa: E731
    full_get = source.get
    bar = _progress(sum(e.nbytes for _, es in plan.units for e in es), progress)
    resumed = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        for shard, (_unit, entries) in zip(plan.shards, plan.units):
            size = sum(e.nbytes for e in entries)
            path = stage / shard
            rec = done.get(shard)
            if rec and path.is_file() and path.stat().st_size == rec["size"] and file_crc(path) == rec["crc32"]:
                resumed += 1
                bar(size)
                continue
            done.pop(shard, None)

            def tasks(e: Planned) -> list:
                r = e.rule
                narrow = dtype and not (r.keep_fp32 or r.fp32_math)
                if narrow and getattr(r.transform, "expert_slabs", False):
                    return _slab_tasks(source, r, e.unit, c, dtype, pool)
                if narrow and getattr(r.transform, "concat_rows", False) and e.nbytes > SLICE:
                    return _row_tasks(source, r, e.unit, c, dtype, pool) or [
                        partial(apply_rule, r, e.unit, c, full_get, dtype, cast_get)]
                return [partial(apply_rule, r, e.unit, c, full_get, dtype, cast_get)]

            try:
                with atomic_path(path) as tmp:
                    nbytes, crc = write_shard(tmp, _header(entries), entries, tasks, opener, pool,
                                              done=lambda e: bar(e.nbytes))
            except ShapeError as exc:
                raise ConversionError(str(exc)) from None
            done[shard] = {"size": nbytes, "crc32": crc}
            _save_json(journal_path, {"fingerprint": fp, "done": done})
    except BaseException as exc:
        source.reader.close()
        kept = sorted(done)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConversionError(f"conversion stopped: {exc.__class__.__name__}: {exc}. {len(kept)} finished "
                              f"shard(s) are kept, verified, in {stage} (no partial file, {out} untouched); rerun "
                              f"the same command to resume, or delete {stage}") from exc
    finally:
        torch.set_num_threads(threads)
        bar(None)
    _finish(stage, report, plan, to)
    aud = audit_conversion(source, plan, stage, done, resumed, check=verify)
    if verify:
        _save_json(stage / AUDIT, aud.to_dict())
    journal_path.unlink(missing_ok=True)
    source.reader.close()
    if out.exists():
        shutil.rmtree(out)
    move_into_place(stage, out)
    aud.out = str(out)
    if verify:
        aud.raise_if_failed()
    return aud


def _finish(stage: Path, report, plan: ConversionPlan, to: str) -> None:
    weight_map = {e.name: shard for shard, (_, es) in zip(plan.shards, plan.units) for e in es}
    total = sum(e.nbytes for _, es in plan.units for e in es)
    _save_json(stage / INDEX, {"metadata": {"total_size": total, "converted_to": to},
                               "weight_map": dict(sorted(weight_map.items()))})
    cfg = {k: v for k, v in report.raw_config.items() if k != "quantization_config"}
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if k != "quantization_config"}
    _save_json(stage / "config.json", cfg)
    root = report.source.reader.root
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name not in SKIP_FILES and not p.name.endswith(".safetensors"):
            shutil.copyfile(p, stage / p.name)


def _progress(total: int, enabled: bool):
    if not enabled:
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", leave=False)

    def step(n):
        if n is None:
            bar.close()
        else:
            bar.update(n)
    return step


def stream_state_dict(src: str | Path, to: str = "neuron", dtype: torch.dtype = torch.bfloat16, tp: int = 1,
                      config: M3Config | None = None, fused_qkv: bool = False):
    """Validated, streamed ``(name, tensor)`` pairs of target ``to`` — one rule's tensors in memory at a time; the
    backing for a streaming NxDI ``get_state_dict`` / ``convert_hf_to_neuron_state_dict``."""
    report = open_checkpoint(src, config)
    source, c = report.source, report.config
    table = target_table(to, c, tp, fused_qkv)
    fp32 = lambda k: source.out_dtype(k) == torch.float32 and source.logical[k].encoding == "plain"  # noqa: E731
    try:
        for unit in layer_units(c):
            for rule in unit_rules(c, unit, table, source.keys(), fp32):
                yield target_name(rule, unit), apply_rule(rule, unit, c, source.get, dtype, source.get)
    finally:
        source.reader.close()
