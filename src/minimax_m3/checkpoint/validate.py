"""Validation before work: every problem of a checkpoint, found up front and reported in one error.

Checks, in one pass: the config parses; the index and shard headers are sound (missing, duplicated, truncated,
corrupt); the stored dtypes agree with the declared format; every tensor the config implies is present with the
shape it implies; no key is unknown (neither a text-backbone key nor a known skipped family); and, with
``deep=True``, no scale is NaN (E8M0 code 255, NaN E4M3, non-positive ``weight_scale_2``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.m3 import ConfigError, M3Config
from .mapping import SKIPS, release_shapes
from .reader import DTYPE_NAMES, CheckpointError, CheckpointReader
from .source import FLOATS, Source


@dataclass
class Report:
    path: Path
    config: M3Config | None
    raw_config: dict
    source: Source | None
    problems: list[str] = field(default_factory=list)

    def raise_if_problems(self) -> None:
        if self.problems:
            raise CheckpointError(self.problems, str(self.path))


def _raw_config(root: Path, problems: list[str]) -> dict:
    p = root / "config.json" if root.is_dir() else root.parent / "config.json"
    if not p.is_file():
        problems.append(f"no config.json next to the weights ({p}); copy the release's config.json")
        return {}
    try:
        raw = json.loads(p.read_text())
        return raw if isinstance(raw, dict) else {}
    except (OSError, ValueError) as exc:
        problems.append(f"config.json: not valid JSON ({exc}); re-download it")
        return {}


def check(path: str | Path, config: M3Config | None = None, deep: bool = False) -> Report:
    """Validate the checkpoint at ``path`` (against ``config`` if given, else its config.json)."""
    root = Path(path)
    problems: list[str] = []
    raw = _raw_config(root, problems)
    c = config
    if c is None and raw:
        try:
            c = M3Config.from_dict(raw, source="config.json")
        except ConfigError as exc:
            problems.extend(f"config.json: {p}" for p in exc.problems)
    try:
        reader = CheckpointReader(root, strict=False)
    except CheckpointError as exc:
        return Report(root, c, raw, None, problems + exc.problems)
    problems.extend(reader.problems)
    expected = release_shapes(c) if c is not None else {}
    source = Source(reader, raw, expected)
    problems.extend(source.problems)
    if c is not None:
        problems.extend(_against_config(source, expected))
    if deep:
        problems.extend(source.check_scales())
    return Report(root, c, raw, source, problems)


def _against_config(source: Source, expected: dict) -> list[str]:
    out: list[str] = []
    fmt = source.format
    missing = [k for k in expected if k not in source]
    if missing:
        shown = ", ".join(missing[:8]) + (f" … (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        out.append(f"{len(missing)} tensor(s) the config implies are missing: {shown}; the checkpoint is "
                   "incomplete or was written for another config")
    for key, lg in source.logical.items():
        if key in expected:
            shape, kind = expected[key]
            if lg.shape != shape:
                out.append(f"{key}: shape {list(lg.shape)} contradicts the config, which implies {list(shape)}")
            if lg.encoding == "plain" and lg.stored_dtype not in FLOATS:
                continue  # already reported by Source
            if kind != "linear" and lg.encoding != "plain":
                out.append(f"{key}: stored {lg.encoding} but this tensor is never quantized in any release")
            if kind == "linear" and lg.encoding == "plain" and fmt.kind != "bf16":
                module = key[: -len(".weight")]
                if not fmt.listed_ignored(module) and (fmt.algo_of(module) is not None or not fmt.algos):
                    out.append(f"{key}: stored {DTYPE_NAMES.get(lg.stored_dtype)} without scales, but "
                               f"quantization_config ({fmt.kind}) does not exempt it")
            if kind == "fp32" and lg.stored_dtype != torch.float32 and lg.encoding == "plain":
                out.append(f"{key}: stored {DTYPE_NAMES.get(lg.stored_dtype)}; the release keeps the router in F32 "
                           "(a lower precision changes expert selection)")
        elif not any(re.search(s.pattern, key) for s in SKIPS):
            out.append(f"{key}: unknown key — not a MiniMax-M3 text tensor for this config, nor vision/projector/MTP; "
                       "check the config (layer counts, expert count) or remove the stray tensor")
    return out


def open_checkpoint(path: str | Path, config: M3Config | None = None, deep: bool = False) -> Report:
    """Validate and return the report; raises one :class:`CheckpointError` listing every problem found."""
    report = check(path, config, deep)
    if report.config is None and not report.problems:
        report.problems.append("no usable config; pass one or add config.json")
    report.raise_if_problems()
    return report
