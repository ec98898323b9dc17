"""Conversion audit in the manner of Megatron-Bridge: every source tensor and byte accounted for.

Source side: each stored tensor is either consumed (by a rule, directly or as the scale of a quantized weight) or
skipped with a stated reason; ``unaccounted`` must be zero. Target side: the written shards are re-read (headers,
and with ``check`` every byte's CRC32 against the journal) and compared with the plan: ``missing``,
``unexpected``, ``shape_mismatch``, ``dtype_mismatch`` and ``corrupt_shards`` must all be zero.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .mapping import skip_reason
from .pipeline import file_crc
from .reader import CheckpointError, read_header


@dataclass
class Audit:
    target: str
    source_tensors: int = 0
    source_bytes: int = 0
    consumed_tensors: int = 0
    consumed_bytes: int = 0
    skipped_tensors: int = 0
    skipped_bytes: int = 0
    unaccounted: list[str] = field(default_factory=list)
    target_tensors: int = 0
    target_bytes: int = 0
    written_tensors: int = 0
    written_bytes: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatch: list[str] = field(default_factory=list)
    dtype_mismatch: list[str] = field(default_factory=list)
    corrupt_shards: list[str] = field(default_factory=list)
    shards: int = 0
    resumed_shards: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # stored key -> reason
    out: str = ""

    @property
    def ok(self) -> bool:
        return not (self.unaccounted or self.missing or self.unexpected or self.shape_mismatch
                    or self.dtype_mismatch or self.corrupt_shards)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        gb = 1e9
        reasons: dict[str, int] = {}
        for r in self.skipped.values():
            reasons[r] = reasons.get(r, 0) + 1
        lines = [
            f"audit ({self.target}): {'PASS' if self.ok else 'FAIL'}",
            f"  source : {self.source_tensors} tensors, {self.source_bytes:,} B = {self.source_bytes / gb:.3f} GB "
            "— consumed "
            f"{self.consumed_tensors} ({self.consumed_bytes / gb:.3f} GB), skipped {self.skipped_tensors} "
            f"({self.skipped_bytes / gb:.3f} GB), unaccounted {len(self.unaccounted)}",
            f"  target : planned {self.target_tensors} tensors, {self.target_bytes:,} B = "
            f"{self.target_bytes / gb:.3f} GB in {self.shards} "
            f"shard(s); written {self.written_tensors} tensors, {self.written_bytes:,} B "
            f"({self.resumed_shards} shard(s) resumed)",
            f"  missing {len(self.missing)}, unexpected {len(self.unexpected)}, shape mismatches "
            f"{len(self.shape_mismatch)}, dtype mismatches {len(self.dtype_mismatch)}, corrupt shards "
            f"{len(self.corrupt_shards)}",
        ]
        lines += [f"  skipped {n}: {r}" for r, n in sorted(reasons.items())]
        for name in ("unaccounted", "missing", "unexpected", "shape_mismatch", "dtype_mismatch", "corrupt_shards"):
            items = getattr(self, name)
            if items:
                lines.append(f"  {name}: " + ", ".join(items[:10]) + (" …" if len(items) > 10 else ""))
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise CheckpointError([self.summary()], f"audit of {self.out or self.target}")


def account_sources(source, consumed: set[str], table) -> tuple[dict, dict, list]:
    """Split every stored tensor into consumed (stored key -> logical key), skipped (-> reason), unaccounted."""
    used, skipped, unaccounted = {}, {}, []
    for key, lg in source.logical.items():
        reason = skip_reason(table, key)
        for f in lg.files:
            if key in consumed:
                used[f] = key
            elif reason:
                skipped[f] = reason
            else:
                unaccounted.append(f)
    for f, reason in source.skipped_files.items():
        skipped[f] = reason
    return used, skipped, sorted(unaccounted)


def audit_conversion(source, plan, out_dir: Path, journal: dict, resumed: int, check: bool = True) -> Audit:
    r = source.reader
    a = Audit(plan.table.name, shards=len(plan.shards), resumed_shards=resumed)
    a.source_tensors = len(r.infos)
    a.source_bytes = sum(i.nbytes for i in r.infos.values())
    used, a.skipped, a.unaccounted = account_sources(source, set(plan.consumed), plan.table)
    a.consumed_tensors, a.consumed_bytes = len(used), sum(r.infos[f].nbytes for f in used)
    a.skipped_tensors, a.skipped_bytes = len(a.skipped), sum(r.infos[f].nbytes for f in a.skipped)
    missed = set(r.infos) - set(used) - set(a.skipped) - set(a.unaccounted)
    a.unaccounted += sorted(missed)
    planned = {e.name: e for _, es in plan.units for e in es}
    a.target_tensors, a.target_bytes = len(planned), sum(e.nbytes for e in planned.values())
    written = {}
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in plan.shards:
        infos, problems = read_header(out_dir / shard)
        if problems:
            a.corrupt_shards += problems
        if check:
            rec = journal.get(shard, {})
            if file_crc(out_dir / shard) != rec.get("crc32"):
                a.corrupt_shards.append(f"{shard}: CRC32 differs from the one recorded while writing")
        for k, info in infos.items():
            if k in written:
                a.unexpected.append(f"{k} (written twice)")
            written[k] = info
            if index.get(k) != shard:
                a.unexpected.append(f"{k} (index says {index.get(k)}, stored in {shard})")
    a.written_tensors, a.written_bytes = len(written), sum(i.nbytes for i in written.values())
    a.missing = sorted(set(planned) - set(written))
    a.unexpected += sorted(set(written) - set(planned))
    for k in sorted(set(planned) & set(written)):
        if tuple(written[k].shape) != planned[k].shape:
            a.shape_mismatch.append(f"{k}: {list(written[k].shape)} vs planned {list(planned[k].shape)}")
        if written[k].dtype != planned[k].dtype:
            a.dtype_mismatch.append(f"{k}: {written[k].dtype} vs planned {planned[k].dtype}")
    return a


def coverage(source, c, table) -> tuple[dict, dict, list]:
    """Without converting: which stored tensors ``table`` would consume, skip (with reason), or leave over."""
    from .mapping import layer_units, source_keys

    keys = source.keys()
    consumed = set()
    for unit in layer_units(c):
        consumed.update(source_keys(c, unit, table, keys))
    return account_sources(source, consumed, table)
