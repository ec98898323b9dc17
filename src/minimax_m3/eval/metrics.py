"""LongBench v1 metrics, written to the definitions of the official scorer (``LongBench/metrics.py``).

Every metric takes ``(prediction, ground_truth, all_classes=None)`` and returns a float in [0, 1]. They use the
same libraries as the official scorer: ``jieba`` (precise mode) for Chinese words, ``rouge`` 1.0.1 (the
pltrdy package) for ROUGE-L, and fuzzywuzzy's ``fuzz.ratio`` semantics for code similarity, computed here
with ``difflib`` exactly as fuzzywuzzy 0.18.0 does when python-Levenshtein is absent (rapidfuzz's ratio is a
different algorithm and disagrees on some inputs).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

from ..errors import M3Error


class ScoringError(M3Error, ValueError):
    """A prediction the official scorer cannot score as asked: a classification task without its label set, a
    retrieval answer not in the task's form, an unknown metric."""

_EN_PUNCT = frozenset(string.punctuation)
# ASCII punctuation plus the CJK/full-width set the official normaliser removes.
_ZH_PUNCT = _EN_PUNCT | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGITS = re.compile(r"\d+")


def normalize_answer(s: str) -> str:
    """English answer normalisation: lowercase, drop ASCII punctuation, articles -> space, collapse spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Chinese answer normalisation: lowercase, drop ASCII + CJK punctuation, delete all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCT).split())


def _jieba_words(text: str) -> list[str]:
    import jieba

    return list(jieba.cut(text, cut_all=False))


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Multiset token F1; 0 when nothing overlaps (an empty prediction included)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_words(text)) if w]

    return token_f1(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F of the ``rouge`` package; any failure inside it (empty or all-'.' text) scores 0."""
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official scorer maps every library error to 0.0
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_) -> float:
    """1/len(matches) if the true class is among the classes named in the prediction, else 0.

    Matches that are proper substrings of the ground truth are dropped with the official scorer's
    remove-while-iterating loop, which skips the element right after each removal; that quirk is kept.
    """
    if all_classes is None:
        raise ScoringError("classification_score needs all_classes (the task's label set)")
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)  # the element after it slides into slot i and is then skipped
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _digit_share(prediction: str, target: str) -> float:
    numbers = _DIGITS.findall(prediction)
    return numbers.count(target) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    return _digit_share(prediction, _paragraph_id(r"Paragraph (\d+)", ground_truth))


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return _digit_share(prediction, _paragraph_id(r"段落(\d+)", ground_truth))


def _paragraph_id(pattern: str, ground_truth: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ScoringError(f"retrieval answer {ground_truth!r} does not match {pattern!r}")
    return found[0]


def count_score(prediction: str, ground_truth: str, **_) -> float:
    return _digit_share(prediction, str(ground_truth))


def fuzz_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy 0.18.0 ``fuzz.ratio`` (pure-Python path): 100 if equal, 0 if either is empty, else
    ``round(100 * difflib.SequenceMatcher(None, s1, s2).ratio())`` (difflib's autojunk heuristic included)."""
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """Similarity of the first code line of the prediction (after leading newlines) that holds no backtick,
    ``#`` or ``//``; "" if there is none. The prediction is never stripped otherwise."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz_ratio(line, ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}

FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def first_line(prediction: str) -> str:
    """The few-shot rule: drop leading newlines, keep the first line."""
    return prediction.lstrip("\n").split("\n")[0]


def sample_score(metric: str, task: str, prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """Score one prediction: the first-line rule for the few-shot tasks, then the max over the answers."""
    if metric not in METRICS:
        raise ScoringError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    if task in FIRST_LINE_TASKS:
        prediction = first_line(prediction)
    fn = METRICS[metric]
    return max([0.0] + [fn(prediction, a, all_classes=all_classes) for a in answers])
