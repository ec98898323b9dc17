"""Run LongBench through any :class:`minimax_m3.engine.Engine`: batched, resumable, with progress.

Predictions go to ``<out>/pred/<task>.jsonl``, one line per sample, appended, flushed and fsynced as soon as
the sample is generated, so a crash loses nothing finished; on restart the ids already there are skipped.
The report (``report.json`` + ``report.md``) is rebuilt from the prediction files at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Sequence

from .._atomic import write_atomic
from ..engine.loop import GenerationConfig
from ..errors import M3Error
from . import data as lbdata
from .data import LongBenchDataError
from .protocol import (
    V2_MAX_NEW_TOKENS, V2_TASK, V2_TEMPERATURE, base_task, chat_wrap, extract_v2_answer, fill_v1_prompt,
    fill_v2_prompt, prepare_v1, prepare_v2, resolve_tasks, strip_thinking,
)  # fmt: skip
from .report import build_report, write_report

DEFAULT_HEADROOM = 16  # ids kept free for decode/re-encode drift when the input budget is derived


class LongBenchRunError(M3Error, ValueError):
    """A LongBench run that cannot start or go on (settings, an output folder of another run, unreadable files);
    the CLI prints it, exit 2."""


class PredictionStore:
    """Append-only JSONL of finished predictions for one task."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = self._load()
        self.done = {r["_id"] for r in self.records}
        self._f = None

    def _load(self) -> list[dict]:
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):  # a crash in the middle of a write: drop the partial last line
            keep = raw[: raw.rfind(b"\n") + 1]
            with open(self.path, "r+b") as f:
                f.truncate(len(keep))
        return lbdata.read_jsonl(self.path, ("_id", "pred"))

    def append(self, record: dict) -> None:
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.records.append(record)
        self.done.add(record["_id"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _eos_ids(engine, tokenizer, extra: Sequence[int] | None) -> tuple[int, ...]:
    ids = [tokenizer.eos_token_id, getattr(engine.config, "eos_token_id", None), *(extra or ())]
    out: list[int] = []
    for i in ids:
        for j in i if isinstance(i, (list, tuple)) else [i]:
            if j is not None and int(j) not in out:
                out.append(int(j))
    return tuple(out)


def _check_run_config(out_dir: Path, settings: dict) -> None:
    path = out_dir / "run_config.json"
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise LongBenchRunError(f"{path}: not valid JSON ({exc}); remove it or use a new --out") from None
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            detail = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise LongBenchRunError(f"{out_dir} holds a run with other settings ({detail}); resume with the same "
                                    "settings or use a new --out")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(settings, indent=2))


def _generate_forcing_first(engine, prompts, gen: GenerationConfig, banned: Sequence[int]):
    """Greedy generation where the first token may not be in ``banned`` (pred.py's samsum ``min_length``):
    sequences whose free first token is banned restart from the best allowed first token."""
    results = engine.generate(prompts, gen)
    for i, res in enumerate(results):
        if res.tokens and res.tokens[0] in banned:
            logits = engine.prefill_logits([prompts[i]])[0][-1].clone()
            logits[list(banned)] = float("-inf")
            first = int(logits.argmax())
            if gen.max_new_tokens == 1:
                res.tokens, res.finish_reason = [first], "length"
                continue
            more = dataclasses.replace(gen, max_new_tokens=gen.max_new_tokens - 1)
            rest = engine.generate([list(prompts[i]) + [first]], more)[0]
            res.tokens, res.finish_reason = [first] + rest.tokens, rest.finish_reason
    return results


def run_longbench(
    engine,
    tokenizer,
    data_dir,
    longbench_dir,
    tasks,
    out_dir,
    limit: int | None = None,
    batch_size: int = 1,
    max_input_tokens: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    progress: bool = True,
    meta: dict | None = None,
    strip_thinking: bool = False,
) -> dict:
    """Generate and score ``tasks`` ("all", "e", "v2" or a comma list); returns the report dict.

    ``max_input_tokens`` is the middle-truncation budget (pred.py's ``max_length``); by default
    ``engine.max_seq_len`` minus the largest max_gen of the chosen tasks, the chat wrapper and 16 ids.
    ``strip_thinking``: drop the thinking (``protocol.strip_thinking``: M3's ``<mm:think>``, M2's ``<think>``) from v2
    responses before the answer is extracted (not in the official protocol, hence off by default; for reasoning
    models).
    """
    task_list = resolve_tasks(tasks)
    problems = [f"{name} must be >= 1, got {value} (--{name.replace('_', '-')})" for name, value in (
        ("batch_size", batch_size), ("limit", limit), ("max_input_tokens", max_input_tokens))
        if value is not None and value < 1]
    if problems:
        raise LongBenchRunError(problems)
    out = Path(out_dir)
    v1 = [t for t in task_list if t != V2_TASK]
    prompts, maxlens = lbdata.load_v1_config(longbench_dir) if v1 else ({}, {})
    v2_template = lbdata.load_v2_template(longbench_dir) if V2_TASK in task_list else None
    gens = {t: lbdata.task_protocol(t, prompts, maxlens)[1] for t in v1}
    if V2_TASK in task_list:
        gens[V2_TASK] = V2_MAX_NEW_TOKENS
    data = {t: lbdata.load_task(data_dir, t) for t in task_list}  # every file checked before generating
    if limit is not None:
        data = {t: rows[:limit] for t, rows in data.items()}

    if max_input_tokens is None:
        overhead = len(tokenizer.encode(chat_wrap(tokenizer, ""), add_special_tokens=False))
        max_input_tokens = engine.max_seq_len - max(gens.values()) - overhead - DEFAULT_HEADROOM
        if max_input_tokens < 2:
            raise LongBenchRunError(
                f"engine.max_seq_len {engine.max_seq_len} leaves no input budget after max_gen {max(gens.values())}; "
                "load the engine with a larger max_seq_len"
            )
    eos = _eos_ids(engine, tokenizer, eos_token_ids)
    settings = {"max_input_tokens": max_input_tokens, "eos_token_ids": list(eos), **(meta or {})}
    if V2_TASK in task_list:  # the stored v2 answers depend on it: a resumed run must not mix the two
        settings["strip_thinking"] = bool(strip_thinking)
    _check_run_config(out, settings)

    stores = {t: PredictionStore(out / "pred" / f"{t}.jsonl") for t in task_list}
    todo = {t: [r for r in data[t] if r["_id"] not in stores[t].done] for t in task_list}
    total = sum(len(v) for v in todo.values())
    bar = _progress(total, progress)
    t0, n_gen, n_prompt = time.monotonic(), 0, 0
    try:
        for task in task_list:
            store, rows, max_gen = stores[task], todo[task], gens[task]
            extra_eos: tuple[int, ...] = ()
            if base_task(task) == "samsum":  # pred.py: newline is an extra EOS, and at least one new token
                extra_eos = (tokenizer.encode("\n", add_special_tokens=False)[-1],)
            if task == V2_TASK:
                gen = GenerationConfig(max_new_tokens=max_gen, temperature=V2_TEMPERATURE, seed=0, eos_token_ids=eos)
            else:
                gen = GenerationConfig(max_new_tokens=max_gen, temperature=0.0, eos_token_ids=eos + extra_eos)
            template = None if task == V2_TASK else lbdata.task_protocol(task, prompts, maxlens)[0]
            for start in range(0, len(rows), batch_size):
                batch = rows[start : start + batch_size]
                room = engine.max_seq_len - max_gen
                if task == V2_TASK:
                    prep = [prepare_v2(tokenizer, fill_v2_prompt(v2_template, r), max_input_tokens, room)
                            for r in batch]
                else:
                    prep = [prepare_v1(tokenizer, fill_v1_prompt(template, r, task), task, max_input_tokens, room)
                            for r in batch]
                ids = [p.ids for p in prep]
                if extra_eos:
                    results = _generate_forcing_first(engine, ids, gen, gen.eos_token_ids)
                else:
                    results = engine.generate(ids, gen)
                for r, p, res in zip(batch, prep, results):
                    text = tokenizer.decode(res.tokens, skip_special_tokens=True)
                    store.append(_record(task, r, p, res, text, strip_thinking))
                    n_gen += len(res.tokens)
                    n_prompt += len(p.ids)
                bar.update(len(batch))
                dt = max(time.monotonic() - t0, 1e-9)
                bar.set_postfix_str(f"{task} gen {n_gen / dt:.1f} tok/s, prompt {n_prompt / dt:.0f} tok/s")
    finally:
        bar.close()
        for s in stores.values():
            s.close()

    results_by_task = {t: _select(stores[t].records, data[t]) for t in task_list}
    elapsed = time.monotonic() - t0
    report_meta = {**settings, "tasks": task_list, "limit": limit, "generated_tokens_this_session": n_gen,
                   "seconds_this_session": round(elapsed, 1)}  # fmt: skip
    report = build_report(results_by_task, report_meta)
    write_report(out, report)
    return report


def _select(records: list[dict], rows: list[dict]) -> list[dict]:
    """The stored predictions of exactly the requested samples (a --limit run reports only those)."""
    by_id = {r["_id"]: r for r in records}
    return [by_id[r["_id"]] for r in rows if r["_id"] in by_id]


def _record(task: str, row: dict, prep, res, text: str, think: bool = False) -> dict:
    common = {"_id": row["_id"], "prompt_tokens": len(prep.ids), "raw_prompt_tokens": prep.raw_tokens,
              "truncated": prep.truncated, "gen_tokens": len(res.tokens),
              "finish_reason": res.finish_reason}
    if task == V2_TASK:
        # pred.py writes no line for an empty output; it is kept here (so a resume does not redo it) but
        # flagged, and the report leaves it out (report.score_v2).
        response = text.strip()
        pred = extract_v2_answer(strip_thinking(response) if think else response)
        return {**common, "response": response, "pred": pred, "answer": row["answer"], "judge": pred == row["answer"],
                "difficulty": row["difficulty"], "length": row["length"], "domain": row.get("domain"),
                "empty_output": text == ""}  # fmt: skip
    return {**common, "pred": text, "answers": row["answers"], "all_classes": row["all_classes"],
            "length": row["length"]}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="sample", desc="longbench", dynamic_ncols=True)


__all__ = ["run_longbench", "PredictionStore", "LongBenchDataError", "LongBenchRunError"]
