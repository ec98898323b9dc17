"""The LongBench inference protocol: task table, prompt filling, middle truncation, chat rule, v2 answers.

v1 follows ``LongBench/pred.py``: ``template.format(**record)``; middle truncation of the *raw* prompt in
token space (special tokens counted) to the input budget; the chat template for every task except the six
in :data:`CHAT_SKIP`; per-task ``max_gen``; greedy decoding. v2 follows the repository-root ``pred.py``:
``$DOC$``-style placeholders filled with stripped fields, ``ids[:m//2] + ids[-m//2:]`` truncation, one user
turn, and the "The correct answer is (X)" extraction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import M3Error

# task -> (metric, category, language). Categories and languages as LongBench's README averages them;
# "code" counts toward both the English and the Chinese average.
V1_TASKS: dict[str, tuple[str, str, str]] = {
    "narrativeqa": ("qa_f1", "single_doc_qa", "en"),
    "qasper": ("qa_f1", "single_doc_qa", "en"),
    "multifieldqa_en": ("qa_f1", "single_doc_qa", "en"),
    "multifieldqa_zh": ("qa_f1_zh", "single_doc_qa", "zh"),
    "hotpotqa": ("qa_f1", "multi_doc_qa", "en"),
    "2wikimqa": ("qa_f1", "multi_doc_qa", "en"),
    "musique": ("qa_f1", "multi_doc_qa", "en"),
    "dureader": ("rouge_zh", "multi_doc_qa", "zh"),
    "gov_report": ("rouge", "summarization", "en"),
    "qmsum": ("rouge", "summarization", "en"),
    "multi_news": ("rouge", "summarization", "en"),
    "vcsum": ("rouge_zh", "summarization", "zh"),
    "trec": ("classification", "few_shot", "en"),
    "triviaqa": ("qa_f1", "few_shot", "en"),
    "samsum": ("rouge", "few_shot", "en"),
    "lsht": ("classification", "few_shot", "zh"),
    "passage_count": ("count", "synthetic", "en"),
    "passage_retrieval_en": ("retrieval", "synthetic", "en"),
    "passage_retrieval_zh": ("retrieval_zh", "synthetic", "zh"),
    "lcc": ("code_sim", "code", "code"),
    "repobench-p": ("code_sim", "code", "code"),
}
CATEGORIES = ("single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code")
E_BASE_TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
E_TASKS = tuple(f"{t}_e" for t in E_BASE_TASKS)
V2_TASK = "v2"
CHAT_SKIP = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
V2_MAX_NEW_TOKENS = 128
V2_TEMPERATURE = 0.1


class LongBenchTaskError(M3Error, ValueError):
    """A task the protocol cannot run as asked: an unknown task name or list, a prompt template and record that do
    not match, a tokenizer without a chat template, an input budget or prompt that does not fit the engine."""


def known_tasks() -> list[str]:
    return list(V1_TASKS) + list(E_TASKS) + [V2_TASK]


def resolve_tasks(spec: str | Sequence[str]) -> list[str]:
    """``"all"`` (the 21 v1 tasks), ``"e"`` (the 13 LongBench-E tasks), ``"v2"``, or a comma list of names."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    out: list[str] = []
    for name in names:
        if not name:
            continue
        group = {"all": list(V1_TASKS), "e": list(E_TASKS)}.get(name, [name])
        for task in group:
            if task not in V1_TASKS and task not in E_TASKS and task != V2_TASK:
                raise LongBenchTaskError(
                    f"unknown LongBench task {task!r}; use all, e, v2 or a comma list of: {', '.join(known_tasks())}"
                )
            if task not in out:
                out.append(task)
    if not out:
        raise LongBenchTaskError(f"no tasks given; use all, e, v2 or a comma list of: {', '.join(known_tasks())}")
    return out


def base_task(task: str) -> str:
    """``qasper_e`` -> ``qasper``: LongBench-E tasks share the prompt, max_gen and metric of their base task."""
    return task[:-2] if task in E_TASKS else task


def uses_chat_template(task: str) -> bool:
    return base_task(task) not in CHAT_SKIP


def _check_budget(max_len: int) -> None:
    if max_len < 1:
        raise LongBenchTaskError(f"the input budget must be at least 1 token, got {max_len}; raise --max-input-tokens")


def middle_truncate_v1(ids: Sequence[int], max_len: int) -> tuple[list[int], list[int]] | None:
    """v1 rule: if ``len(ids) > max_len`` keep the first and last ``half = int(max_len / 2)`` ids (an odd budget
    keeps one id fewer). Returns (head, tail) to decode separately, or None when nothing needs cutting.

    The tail is pred.py's ``ids[-half:]``, so a budget of 1 (half = 0) keeps *every* id as the tail: the
    official code then only drops the special tokens through its decode, it does not cut the prompt."""
    _check_budget(max_len)
    if len(ids) <= max_len:
        return None
    half = int(max_len / 2)
    tail = list(ids[len(ids) - half :]) if half else list(ids)  # ids[-0:] is the whole list
    return list(ids[:half]), tail


def middle_truncate_v2(ids: Sequence[int], max_len: int) -> list[int]:
    """v2 rule: ``ids[:max_len//2] + ids[-max_len//2:]`` (floor division of the negated budget: the tail gets the
    odd id, so exactly max_len stay; a budget of 1 keeps the last id only)."""
    _check_budget(max_len)
    if len(ids) <= max_len:
        return list(ids)
    return list(ids[: max_len // 2]) + list(ids[-max_len // 2 :])


def fill_v1_prompt(template: str, record: dict, task: str) -> str:
    try:
        return template.format(**record)
    except KeyError as e:
        raise LongBenchTaskError(f"the {task} prompt template needs field {e.args[0]!r}, which the record lacks") \
            from None


def chat_wrap(tokenizer, text: str) -> str:
    """One user turn, no system prompt, generation prompt appended, through the tokenizer's own template."""
    if not getattr(tokenizer, "chat_template", None):
        raise LongBenchTaskError(
            "the tokenizer has no chat_template; LongBench applies the model's chat format to 15 of 21 tasks. "
            "Use the model's own tokenizer (tokenizer_config.json with a chat_template)."
        )
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


@dataclass
class PreparedPrompt:
    ids: list[int]  # what goes to the engine
    raw_tokens: int  # tokens of the filled prompt before truncation (special tokens included)
    truncated: bool


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special))


def _finish(tokenizer, text: str, chat: bool) -> list[int]:
    # A templated prompt carries its own special tokens; a plain one gets the tokenizer's (like pred.py).
    return _encode(tokenizer, chat_wrap(tokenizer, text), False) if chat else _encode(tokenizer, text, True)


def prepare_v1(tokenizer, prompt: str, task: str, max_input_tokens: int,
               max_total: int | None = None) -> PreparedPrompt:
    """Truncate ``prompt`` in the middle to ``max_input_tokens``, then apply the chat rule and tokenize.

    ``max_total`` (the engine's room for prompt ids, i.e. max_seq_len - max_gen): if the final ids exceed it
    (chat overhead, or the decode/re-encode drift of truncation), the budget shrinks by the overflow and the
    truncation is redone, at most 4 times.
    """
    ids = _encode(tokenizer, prompt, True)
    chat = uses_chat_template(task)
    budget = max_input_tokens
    for _ in range(5):
        cut = middle_truncate_v1(ids, budget)
        text = prompt if cut is None else (
            tokenizer.decode(cut[0], skip_special_tokens=True) + tokenizer.decode(cut[1], skip_special_tokens=True)
        )
        final = _finish(tokenizer, text, chat)
        if max_total is None or len(final) <= max_total:
            return PreparedPrompt(final, len(ids), cut is not None)
        budget -= len(final) - max_total
        if budget < 2:
            break
    raise LongBenchTaskError(
        f"{task}: the prompt does not fit the engine ({len(final)} ids > {max_total} left after max_gen); "
        "lower --max-input-tokens or load the engine with a larger max_seq_len"
    )


V2_PLACEHOLDERS = ("$DOC$", "$Q$", "$C_A$", "$C_B$", "$C_C$", "$C_D$")


def fill_v2_prompt(template: str, item: dict) -> str:
    fields = ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D")
    out = template
    for ph, key in zip(V2_PLACEHOLDERS, fields):
        out = out.replace(ph, str(item[key]).strip())
    return out


def prepare_v2(tokenizer, prompt: str, max_input_tokens: int, max_total: int | None = None) -> PreparedPrompt:
    ids = _encode(tokenizer, prompt, True)
    budget = max_input_tokens
    for _ in range(5):
        if len(ids) <= budget:
            text = prompt
        else:
            text = tokenizer.decode(middle_truncate_v2(ids, budget), skip_special_tokens=True)
        final = _finish(tokenizer, text, True)
        if max_total is None or len(final) <= max_total:
            return PreparedPrompt(final, len(ids), len(ids) > budget)
        budget -= len(final) - max_total
        if budget < 2:
            break
    raise LongBenchTaskError(
        f"v2: the prompt does not fit the engine ({len(final)} ids > {max_total}); lower --max-input-tokens"
    )


_THINK_MARKERS = (("<think>", "</think>"), ("<mm:think>", "</mm:think>"))  # M1/M2's, M3's
_ANSWER_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_ANSWER_BARE = re.compile(r"The correct answer is ([A-D])")


def strip_thinking(response: str) -> str:
    """Remove the thinking of reasoning models: M3's ``<mm:think>...</mm:think>`` and M1/M2's ``<think>...</think>``
    blocks; text before a first closing marker with no opener (the prompt opened the block: M3's generation prompt
    ends ``<mm:think>`` with thinking enabled); and a leading block never closed (cut by max_gen: all thinking, no
    answer). Not part of the official protocol (v2's pred.py extracts from the whole response): the runner applies it
    only with ``strip_thinking=True`` (``minimax-m3 longbench --strip-thinking``)."""
    for start, end in _THINK_MARKERS:
        head, sep, tail = response.partition(end)
        if sep and start not in head:
            response = tail
        response = re.sub(re.escape(start) + ".*?" + re.escape(end), "", response, flags=re.S)
        if response.lstrip().startswith(start):
            response = ""
    return response


def extract_v2_answer(response: str) -> str | None:
    """The official extraction: delete ``*``, then "The correct answer is (X)", then "... is X"; else None."""
    response = response.replace("*", "")
    m = _ANSWER_PAREN.search(response) or _ANSWER_BARE.search(response)
    return m.group(1) if m else None
