"""Offline LongBench data: v1 ``{task}.jsonl`` / ``{task}_e.jsonl``, v2 ``data.json``, and the benchmark's own
prompt and max-length tables read from the user's LongBench checkout (nothing is shipped or fetched).
"""

from __future__ import annotations

import json
from pathlib import Path

from .protocol import V2_TASK, base_task
from ..errors import M3Error

V1_FIELDS = ("input", "context", "answers", "length", "all_classes", "_id")
V2_FIELDS = ("_id", "difficulty", "length", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer",
             "context")


class LongBenchDataError(M3Error, ValueError):
    """Data or configuration files that are missing, malformed or laid out wrongly."""


def read_jsonl(path: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Read one JSON object per line; a bad line raises an error naming the file and the line number."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise LongBenchDataError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or delete that line") from e
            if not isinstance(row, dict):
                raise LongBenchDataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in required if k not in row]
            if missing:
                raise LongBenchDataError(f"{path}:{lineno}: record lacks field(s) {', '.join(missing)}")
            rows.append(row)
    return rows


def _layout_hint(data_dir: Path) -> str:
    return (
        f"expected LongBench's data.zip unzipped so that {data_dir}/<task>.jsonl exists (v1, e.g. hotpotqa.jsonl, "
        f"qasper_e.jsonl) or {data_dir}/data.json (v2); a folder holding data/ also works"
    )


def resolve_data_dir(data_dir) -> Path:
    """Accept the folder holding the jsonl files, or one level above it (``<dir>/data/*.jsonl``)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise LongBenchDataError(f"data directory {d} does not exist; {_layout_hint(d)}")
    if not any(d.glob("*.jsonl")) and not (d / "data.json").is_file() and (d / "data").is_dir():
        return d / "data"
    return d


def load_v1_task(data_dir, task: str) -> list[dict]:
    d = resolve_data_dir(data_dir)
    path = d / f"{task}.jsonl"
    if not path.is_file():
        present = sorted(p.stem for p in d.glob("*.jsonl"))
        more = "..." if len(present) > 8 else ""
        seen = f"it holds {', '.join(present[:8])}{more}" if present else "it holds no .jsonl"
        raise LongBenchDataError(f"no {path.name} in {d} ({seen}); {_layout_hint(d)}")
    rows = read_jsonl(path, V1_FIELDS)
    _check_unique_ids(rows, path)
    for i, row in enumerate(rows, 1):
        if not isinstance(row["answers"], list):
            raise LongBenchDataError(f"{path}: record {i} ({row['_id']}): answers must be a list of strings")
    return rows


def load_v2(data_dir) -> list[dict]:
    d = resolve_data_dir(data_dir)
    path = d / "data.json"
    if not path.is_file():
        raise LongBenchDataError(f"no data.json in {d}; {_layout_hint(d)}")
    items = _read_json(path, "; re-download LongBench-v2 data.json")
    if not isinstance(items, list):
        raise LongBenchDataError(f"{path}: expected a JSON array of questions, got {type(items).__name__}")
    for i, item in enumerate(items):
        missing = [k for k in V2_FIELDS if not isinstance(item, dict) or k not in item]
        if missing:
            raise LongBenchDataError(f"{path}: item {i} lacks field(s) {', '.join(missing)}")
    _check_unique_ids(items, path)
    return items


def _read_json(path: Path, fix: str = ""):
    """One JSON document; a parse error names the file, the line and (``fix``) what to do."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LongBenchDataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}){fix}") from e


def _check_unique_ids(rows: list[dict], path: Path) -> None:
    seen: set = set()
    for row in rows:
        if row["_id"] in seen:
            raise LongBenchDataError(f"{path}: duplicate _id {row['_id']!r}; resuming needs unique ids")
        seen.add(row["_id"])


def _find_config_dir(longbench_dir: Path) -> Path:
    for cand in (longbench_dir / "config", longbench_dir / "LongBench" / "config"):
        if (cand / "dataset2prompt.json").is_file():
            return cand
    raise LongBenchDataError(
        f"no config/dataset2prompt.json under {longbench_dir} (looked in config/ and LongBench/config/); pass "
        "--longbench-dir pointing at a checkout of github.com/THUDM/LongBench (the repo root or its LongBench/)"
    )


def _load_json_map(path: Path) -> dict:
    if not path.is_file():
        raise LongBenchDataError(f"missing {path}; the LongBench checkout is incomplete")
    out = _read_json(path)
    if not isinstance(out, dict):
        raise LongBenchDataError(f"{path}: expected a JSON object mapping task -> value")
    return out


def load_v1_config(longbench_dir) -> tuple[dict[str, str], dict[str, int]]:
    """(dataset2prompt, dataset2maxlen) from the user's LongBench checkout."""
    cfg = _find_config_dir(Path(longbench_dir))
    return _load_json_map(cfg / "dataset2prompt.json"), _load_json_map(cfg / "dataset2maxlen.json")


def load_v2_template(longbench_dir, name: str = "0shot") -> str:
    d = Path(longbench_dir)
    for cand in (d / "prompts" / f"{name}.txt", d.parent / "prompts" / f"{name}.txt"):
        if cand.is_file():
            return cand.read_text(encoding="utf-8")
    raise LongBenchDataError(
        f"no prompts/{name}.txt under {d} or {d.parent}; pass --longbench-dir pointing at the root of a "
        "THUDM/LongBench checkout (v2 prompts live in its prompts/ folder)"
    )


def task_protocol(task: str, prompts: dict, maxlens: dict) -> tuple[str, int]:
    """The (template, max_gen) pair of a v1 or LongBench-E task."""
    base = base_task(task)
    if base not in prompts or base not in maxlens:
        raise LongBenchDataError(
            f"{task}: the LongBench config has no entry for {base!r} in dataset2prompt.json/dataset2maxlen.json"
        )
    return prompts[base], int(maxlens[base])


def load_task(data_dir, task: str) -> list[dict]:
    return load_v2(data_dir) if task == V2_TASK else load_v1_task(data_dir, task)
