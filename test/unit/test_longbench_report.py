"""Aggregation as LongBench reports it, on hand-computed cases."""

import json

import pytest

from minimax_m3.eval.report import build_report, language_averages, length_bucket, score_v1_task, score_v2, write_report


def rec(pred, answers, length=100, classes=None):
    return {"pred": pred, "answers": answers, "all_classes": classes, "length": length}


def test_task_scores_official_semantics():
    cls = ["City", "Country", "Date"]
    # trec: lstrip + first line -> "City" (1.0); "Date" names the wrong class (0) -> 100 * 1/2
    trec = score_v1_task("trec",
                         [rec("\nCity\nType: Country", ["City"], classes=cls), rec("Date", ["City"], classes=cls)])
    assert trec == {"metric": "classification", "n": 2, "score": 50.0}
    # triviaqa: "Paris" (first line) = 1.0; "london" vs "London, UK": P = 1, R = 1/2 -> 2/3; mean 5/6 -> 83.33
    tq = score_v1_task("triviaqa",
                       [rec("Paris\nQuestion: foo", ["Paris", "Paris, France"]), rec("london", ["London, UK"])])
    assert tq["score"] == 83.33
    # hotpotqa: no first-line rule; 2/3 and 2/3 -> 66.67
    hp = score_v1_task("hotpotqa", [rec("Paris, France", ["Paris"]), rec("Shakespeare", ["William Shakespeare"])])
    assert hp["score"] == 66.67


def test_longbench_e_buckets():
    got = [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 50000)]
    assert got == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]
    # 3999 -> 0-4k scores 1; 4000 -> 4-8k scores 0; 8000 -> 8k+ scores 2/3. Task mean (1 + 0 + 2/3)/3 = 55.56
    r = score_v1_task("qasper_e",
                      [rec("Paris", ["Paris"], 3999), rec("", ["Paris"], 4000), rec("Paris, France", ["Paris"], 8000)])
    assert r["score"] == 55.56 and r["buckets"] == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 66.67}
    assert score_v1_task("trec_e", [rec("x", ["y"], 10, ["y"])])["buckets"] == {"0-4k": 0.0, "4-8k": None, "8k+": None}


def test_language_averages_mean_of_category_means():
    scores = {"hotpotqa": 60.0, "musique": 40.0, "trec": 50.0, "lcc": 30.0, "repobench-p": 50.0, "lsht": 20.0,
              "dureader": 10.0}
    got = language_averages(scores)
    # en: multi_doc (60+40)/2 = 50, few_shot 50, code (30+50)/2 = 40 -> (50+50+40)/3 = 46.67
    assert got["en"] == {"categories": {"multi_doc_qa": 50.0, "few_shot": 50.0, "code": 40.0}, "avg": 46.67,
                         "complete": False}
    # zh: multi_doc 10 (dureader), few_shot 20 (lsht), code 40 (shared with en) -> 70/3 = 23.33
    assert got["zh"]["avg"] == 23.33 and got["zh"]["categories"]["code"] == 40.0
    # README check (GPT-3.5-Turbo-16k, EN): categories 39.8 38.7 26.5 67.1 54.1 37.8 -> 264.0/6 = 44.0
    full = {"narrativeqa": 39.8, "hotpotqa": 38.7, "gov_report": 26.5, "trec": 67.1, "passage_count": 54.1, "lcc": 37.8}
    assert language_averages(full)["en"]["avg"] == 44.0 and language_averages(full)["en"]["complete"]


def test_v2_accuracy_splits():
    items = [
        {"pred": "A", "answer": "A", "difficulty": "easy", "length": "short"},
        {"pred": "B", "answer": "C", "difficulty": "easy", "length": "long"},
        {"pred": "D", "answer": "D", "difficulty": "hard", "length": "medium"},
        {"pred": None, "answer": "B", "difficulty": "hard", "length": "long"},
    ]
    r = score_v2(items)
    assert r == {"overall": 50.0, "easy": 50.0, "hard": 50.0, "short": 100.0, "medium": 100.0, "long": 0.0, "n": 4,
                 "n_unextracted": 1, "n_empty_output": 0}  # fmt: skip
    # compensated: the None answer counts 0.25 -> hard (1 + .25)/2 = 62.5, long (0 + .25)/2 = 12.5
    c = score_v2(items, compensated=True)
    assert (c["hard"], c["long"]) == (62.5, 12.5)


def test_build_and_write_report(tmp_path):
    results = {
        "hotpotqa": [rec("Paris", ["Paris"])],
        "trec_e": [rec("City", ["City"], 5000, ["City", "Date"])],
        "v2": [{"pred": "A", "answer": "A", "difficulty": "easy", "length": "short"}],
    }
    report = build_report(results, {"model": "m"})
    assert report["tasks"]["hotpotqa"]["score"] == 100.0
    assert report["longbench"]["en"]["avg"] == 100.0
    assert report["longbench_e"]["buckets"] == {"0-4k": None, "4-8k": 100.0, "8k+": None}
    assert report["tasks"]["v2"]["overall"] == 100.0
    jpath, mpath = write_report(tmp_path, report)
    assert json.loads(jpath.read_text()) == report
    md = mpath.read_text()
    assert "| hotpotqa | qa_f1 | 1 | 100.00 |" in md
    assert "| trec_e | classification | 1 | 100.00 | n/a | 100.00 | n/a |" in md
    assert "| 1 | 100.00 | 100.00 | n/a |" in md  # v2 row: n, overall, easy, hard (no hard items)


def counted(hits, total=100):
    """A passage_count prediction naming the answer "2" in ``hits`` of its ``total`` numbers: count_score is
    hits / total (computed as a Python division, so 3/100 is the double 0.03)."""
    return " ".join(["2"] * hits + ["0"] * (total - hits))


@pytest.mark.parametrize(
    "scores_hits,bucket,task_score",
    [
        # 40 samples, one scores 3/100 and 39 score 0. Exact: 100 * mean = 3/40 = 0.075. eval.py's scorer_e does
        # round(100 * np.mean(s), 2) on a numpy float, i.e. numpy's round: 0.075's double (0.0749999999999999972)
        # times 100 is within half an ulp of 7.5, so it becomes exactly 7.5; half to even -> 8 -> 0.08. Python's
        # round on the same double sees 0.07499... -> 0.07, which eval.py's plain scorer (the "score") gives.
        ([3] + [0] * 39, 0.08, 0.07),
        # one 1/100 among 40: exact 0.025; the double is 0.02500000000000000139, x100 -> exactly 2.5 -> half to
        # even -> 2 -> 0.02 (numpy); Python's round of 0.0250000...0139 -> 0.03.
        ([1] + [0] * 39, 0.02, 0.03),
        # 8 samples 0.03, 0.03, 0.03, 0.02 x 5. Exact: 100 * 0.19 / 8 = 2.375 = 19/8, binary-exact; numpy's
        # pairwise sum of these 8 doubles lands on 0.19's double, so 100 * mean is exactly 2.375 -> half to even
        # -> 2.38. A left-to-right sum gives 0.18999999999999997 -> 2.3749999999999996 -> 2.37 (the "score").
        ([3, 3, 3, 2, 2, 2, 2, 2], 2.38, 2.37),
    ],
)
def test_longbench_e_bucket_rounds_as_eval_py(scores_hits, bucket, task_score):
    records = [rec(counted(h), ["2"], length=100) for h in scores_hits]
    r = score_v1_task("passage_count_e", records)
    assert r["buckets"] == {"0-4k": bucket, "4-8k": None, "8k+": None}
    assert r["score"] == task_score


def test_v2_empty_output_is_not_scored():
    # pred.py `continue`s on an empty output, so result.py never counts that item. Items: easy/short right,
    # hard/medium wrong, hard/long empty output, easy/long whitespace-only output (not empty there: its
    # stripped response "" extracts no answer -> wrong). Official: n = 3, overall 1/3 = 33.3, easy 1/2 = 50.0,
    # hard 0/1 = 0.0, short 100.0, medium 0.0, long 0/1 = 0.0.
    items = [
        {"pred": "A", "answer": "A", "difficulty": "easy", "length": "short", "empty_output": False},
        {"pred": "B", "answer": "C", "difficulty": "hard", "length": "medium", "empty_output": False},
        {"pred": None, "answer": "D", "difficulty": "hard", "length": "long", "empty_output": True},
        {"pred": None, "answer": "D", "difficulty": "easy", "length": "long", "empty_output": False},
    ]
    assert score_v2(items) == {"overall": 33.3, "easy": 50.0, "hard": 0.0, "short": 100.0, "medium": 0.0, "long": 0.0,
                               "n": 3, "n_unextracted": 1, "n_empty_output": 1}  # fmt: skip
