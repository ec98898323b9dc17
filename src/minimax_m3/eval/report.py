"""Aggregation as LongBench reports it: task scores, category and language averages, LongBench-E length
buckets, v2 accuracy splits; written as JSON and a Markdown table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .._atomic import write_atomic
from .metrics import sample_score
from .protocol import CATEGORIES, E_TASKS, V1_TASKS, V2_TASK, base_task

BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E buckets on the record's ``length`` field (words or characters, not tokens)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _pct(values: Sequence[float], ndigits: int = 2) -> float | None:
    """``round(100 * total / n, ndigits)`` with a plain running float total and Python's ``round``: how
    LongBench's ``eval.py`` scores a v1 task and v2's ``result.py`` an accuracy (None for no samples).

    The total is a left-to-right loop, not ``sum()``: from Python 3.12 ``sum()`` of floats is compensated and
    can land on a neighbouring double, which flips a last digit that sits on a rounding boundary."""
    if not values:
        return None
    total = 0.0
    for v in values:
        total += v
    return round(100 * total / len(values), ndigits)


def bucket_pct(values: Sequence[float]) -> float | None:
    """A LongBench-E length bucket as ``eval.py``'s ``scorer_e`` computes it: numpy's mean (pairwise
    summation) of the sample scores, times 100, rounded to 2 decimals by numpy (scale by 100, round half to
    even, unscale), which is what ``round()`` does to the numpy float there. This differs from :func:`_pct` in
    the last digit for some buckets (e.g. one 0.03 among 40 scores: 0.08 here, 0.07 with Python's round).
    An empty bucket is None (eval.py writes NaN, which is not valid JSON)."""
    if not values:
        return None
    return float(np.round(100 * np.mean(np.asarray(values, dtype=np.float64)), 2))


def score_v1_task(task: str, records: Iterable[dict]) -> dict:
    """Score prediction records (``pred``, ``answers``, ``all_classes``, ``length``) of one v1 / E task.

    Returns ``{"score", "n", "metric"}`` plus ``"buckets"`` for LongBench-E tasks (None for an empty bucket).
    """
    base = base_task(task)
    metric = V1_TASKS[base][0]
    per_sample, by_bucket = [], {b: [] for b in BUCKETS}
    for r in records:
        s = sample_score(metric, base, r["pred"], r["answers"], all_classes=r.get("all_classes"))
        per_sample.append(s)
        by_bucket[length_bucket(int(r["length"]))].append(s)
    out = {"metric": metric, "n": len(per_sample), "score": _pct(per_sample)}
    if task in E_TASKS:
        out["buckets"] = {b: bucket_pct(v) for b, v in by_bucket.items()}
    return out


def language_averages(task_scores: dict[str, float], tasks: Sequence[str] | None = None) -> dict:
    """README-style averages: for each language, the mean over categories of the mean task score in that
    category; code tasks count toward both English and Chinese. LongBench-E tasks average on their base
    names. ``complete`` says whether every category had a score (otherwise the average is not comparable)."""
    out = {}
    for lang in ("en", "zh"):
        cats = {}
        for cat in CATEGORIES:
            vals = [
                v for t, v in task_scores.items()
                if v is not None and V1_TASKS[base_task(t)][1] == cat and V1_TASKS[base_task(t)][2] in (lang, "code")
            ]  # fmt: skip
            if vals:
                cats[cat] = round(sum(vals) / len(vals), 2)
        if cats:
            out[lang] = {
                "categories": cats,
                "avg": round(sum(cats.values()) / len(cats), 2),
                "complete": len(cats) == len(CATEGORIES),
            }
    return out


def score_v2(records: Iterable[dict], compensated: bool = False) -> dict:
    """Accuracy x100 (1 decimal) overall and by difficulty and length label, as v2's result.py.

    A record whose model output was the empty string (``empty_output``) is left out of every count: the
    official pred.py writes no result line for it, so result.py never sees it (``n_empty_output`` counts them).
    A whitespace-only output is not empty there and scores as an unextracted answer.
    ``compensated``: an unextractable answer counts 0.25 (off by default, as upstream)."""
    groups: dict[str, list[float]] = {k: [] for k in ("overall", "easy", "hard", "short", "medium", "long")}
    n_none = n_empty = 0
    for r in records:
        if r.get("empty_output"):
            n_empty += 1
            continue
        n_none += r["pred"] is None
        acc = 0.25 if compensated and r["pred"] is None else float(r["pred"] == r["answer"])
        groups["overall"].append(acc)
        groups["easy" if r["difficulty"] == "easy" else "hard"].append(acc)
        length = r["length"] if r["length"] in ("short", "medium") else "long"
        groups[length].append(acc)
    out = {k: _pct(v, 1) for k, v in groups.items()}
    out["n"] = len(groups["overall"])
    out["n_unextracted"] = n_none
    out["n_empty_output"] = n_empty
    return out


def build_report(results: dict[str, list[dict]], meta: dict | None = None) -> dict:
    """``results`` maps task -> prediction records. Returns the full report dict."""
    tasks, v1_scores, e_scores = {}, {}, {}
    for task, records in results.items():
        if task == V2_TASK:
            tasks[task] = score_v2(records)
            continue
        tasks[task] = score_v1_task(task, records)
        (e_scores if task in E_TASKS else v1_scores)[task] = tasks[task]["score"]
    report = {"meta": meta or {}, "tasks": tasks}
    if v1_scores:
        report["longbench"] = language_averages(v1_scores)
    if e_scores:
        report["longbench_e"] = language_averages(e_scores)
        report["longbench_e"]["buckets"] = {
            b: _mean_or_none([tasks[t]["buckets"][b] for t in e_scores]) for b in BUCKETS
        }
    return report


def _mean_or_none(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def render_markdown(report: dict) -> str:
    lines = []
    meta = report.get("meta", {})
    if meta:
        lines += ["# LongBench results", "", ", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    v1 = [(t, r) for t, r in report["tasks"].items() if t != V2_TASK]
    if v1:
        has_e = any("buckets" in r for _, r in v1)
        head = "| task | metric | n | score |" + (" 0-4k | 4-8k | 8k+ |" if has_e else "")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for t, r in v1:
            row = f"| {t} | {r['metric']} | {r['n']} | {_fmt(r['score'])} |"
            if has_e:
                b = r.get("buckets", {})
                row += "".join(f" {_fmt(b.get(k))} |" for k in BUCKETS)
            lines.append(row)
        lines.append("")
    for group in ("longbench", "longbench_e"):
        if group not in report:
            continue
        lines += [f"**{group}** (README-style: mean of category means; code counts for both languages)", ""]
        lines += ["| language | " + " | ".join(CATEGORIES) + " | avg | complete |",
                  "|" + "---|" * (len(CATEGORIES) + 3)]
        for lang in ("en", "zh"):
            if lang in report[group]:
                g = report[group][lang]
                cells = " | ".join(_fmt(g["categories"].get(c)) for c in CATEGORIES)
                lines.append(f"| {lang} | {cells} | {_fmt(g['avg'])} | {g['complete']} |")
        if "buckets" in report[group]:
            lines += ["", "| length | " + " | ".join(BUCKETS) + " |", "|---|---|---|---|"]
            lines.append("| mean over tasks | " + " | ".join(_fmt(report[group]["buckets"][b]) for b in BUCKETS) + " |")
        lines.append("")
    if V2_TASK in report["tasks"]:
        r = report["tasks"][V2_TASK]
        keys = ("overall", "easy", "hard", "short", "medium", "long")
        head = "| n | " + " | ".join(keys) + " | unextracted | empty output (not scored) |"
        lines += ["**LongBench v2** accuracy (%)", "", head, "|" + "---|" * 9]
        lines.append(f"| {r['n']} | " + " | ".join(_fmt(r[k]) for k in keys)
                     + f" | {r['n_unextracted']} | {r['n_empty_output']} |")
        lines.append("")
    return "\n".join(lines)


def write_report(out_dir, report: dict) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` atomically; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    texts = (("report.json", json.dumps(report, ensure_ascii=False, indent=2)), ("report.md", render_markdown(report)))
    for name, text in texts:
        write_atomic(out / name, text)
        paths.append(out / name)
    return paths[0], paths[1]
