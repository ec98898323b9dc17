"""LongBench metrics against hand-computed values (derivations in the comments)."""

import random
import warnings

import pytest

from minimax_m3.eval import metrics as M

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fuzzywuzzy warns that it runs on difflib: that is the path we pin
    from fuzzywuzzy import fuzz as fuzzywuzzy_fuzz

CASES = [
    # qa_f1: normalise = lower, drop punctuation, articles -> space, collapse spaces; multiset token F1
    ("qa_f1", "The Eiffel Tower.", "Eiffel Tower", 1.0),  # both -> [eiffel, tower]
    ("qa_f1", "Paris, France", "Paris", 2 / 3),  # P = 1/2, R = 1, F = 2*.5*1/1.5
    ("qa_f1", "the cat sat", "a dog sat", 0.5),  # [cat, sat] vs [dog, sat]: P = R = 1/2
    ("qa_f1", "go go go stop", "go go", 2 / 3),  # common go = min(3, 2) = 2: P = 2/4, R = 2/2
    ("qa_f1", "", "Paris", 0.0),  # empty prediction: no overlap
    ("qa_f1", "An apple", "apple!", 1.0),  # "an" is an article, "!" punctuation
    # qa_f1_zh: jieba words of the raw text, each normalised (punctuation, spaces removed), empties dropped
    ("qa_f1_zh", "北京是中国的首都", "北京", 1 / 3),  # 北京/是/中国/的/首都: P = 1/5, R = 1, F = 2*.2/1.2
    ("qa_f1_zh", "北京。", "北京", 1.0),  # the 。 word normalises to "" and is dropped
    ("qa_f1_zh", "", "北京", 0.0),
    # rouge (pltrdy rouge 1.0.1, ROUGE-L F): case-sensitive, union LCS over unique words
    ("rouge", "the cat sat on the mat", "the cat is on the mat", 0.8),  # 5 unique vs 5 unique, hits {the,cat,on,mat}
    ("rouge", "The cat", "the cat", 0.5),  # "The" != "the": hit {cat}, P = R = 1/2
    ("rouge", "", "anything", 0.0),  # the library raises on an empty hypothesis -> 0
    ("rouge", "...", "anything", 0.0),  # only sentence separators -> empty -> 0
    # rouge_zh: jieba words joined by spaces, then rouge
    ("rouge_zh", "今天天气很好", "今天天气不错", 0.4),  # 今天天气/很/好 vs 今天天气/不错: P=1/3, R=1/2, F=.4
    # classification: classes named in the prediction (substring, case-sensitive)
    ("classification", "Type: Location", "Location", 1.0),
    ("classification", "Location or Person", "Location", 0.5),  # two matches, gt among them
    ("classification", "Person", "Location", 0.0),
    ("classification", "location", "Location", 0.0),  # case-sensitive
    # retrieval: share of digit runs equal to the paragraph id of the answer
    ("retrieval", "Paragraph 12 or Paragraph 3", "Paragraph 12", 0.5),
    ("retrieval", "Paragraph 1", "Paragraph 12", 0.0),  # "1" != "12": whole-number equality
    ("retrieval", "The answer is none", "Paragraph 12", 0.0),  # no digits
    ("retrieval_zh", "段落5", "段落5", 1.0),
    ("retrieval_zh", "段落5和段落15", "段落5", 0.5),
    # count
    ("count", "7 or 8", "7", 0.5),
    ("count", "There are 7 passages, 7 unique", "7", 1.0),
    ("count", "none", "7", 0.0),
    # code_sim: first line (after leading newlines) without ` # //, fuzzywuzzy ratio / 100
    ("code_sim", "\n    return x + 1\n", "    return x + 1", 1.0),
    ("code_sim", "# comment\n    return x + 1", "    return x + 1", 1.0),  # comment line skipped
    ("code_sim", "```python\nreturn x+1\n```", "return x + 1", 0.91),  # 2*10/22 = .909 -> ratio 91
    ("code_sim", "  \n    return x + 1", "    return x + 1", 0.22),  # line "  ": 2*2/18 = .222 -> 22; no strip
    ("code_sim", "# a\n// b", "x = 1", 0.0),  # no usable line -> "" -> 0
    ("code_sim", "", "", 1.0),  # fuzzywuzzy: equal strings -> 100 before the empty-string check
    # difflib takes the longest block "xyz" first, leaving nothing on either side: 2*3/16 = .375 -> 38.
    # (A true LCS, as rapidfuzz computes, would find "abcd": 2*4/16 = .5.)
    ("code_sim", "ab1cdxyz", "xyzab2cd", 0.38),
]


@pytest.mark.parametrize("metric,pred,gt,expected", CASES)
def test_metric_hand_computed(metric, pred, gt, expected):
    classes = ["Location", "Person", "Number"]
    assert M.METRICS[metric](pred, gt, all_classes=classes) == pytest.approx(expected, abs=1e-6)


def test_classification_keeps_official_removal_quirk():
    # matches = [Loc, Lo, Location]. i=0: "Loc" is a proper substring of gt -> removed, "Lo" slides into slot
    # 0 and is skipped; i=1: "Location" == gt, kept. Left: [Lo, Location] -> 1/2. (A clean filter gives 1.0.)
    assert M.classification_score("Location", "Location", all_classes=["Loc", "Lo", "Location"]) == 0.5
    with pytest.raises(M.ScoringError, match="all_classes"):
        M.classification_score("x", "y")


def test_fuzz_ratio_identical_to_fuzzywuzzy_and_not_rapidfuzz():
    from rapidfuzz import fuzz as rapid

    rng = random.Random(0)
    pairs = [("ab1cdxyz", "xyzab2cd"), ("a" * 150 + "b", "a" * 300), ("", "x"), ("same", "same")]
    for _ in range(300):
        n1, n2 = rng.randint(0, 40), rng.randint(0, 300)  # lengths past 200 exercise difflib's autojunk
        pairs.append(("".join(rng.choice("ab (x)=+\n") for _ in range(n1)),
                      "".join(rng.choice("ab (x)=+") for _ in range(n2))))
    for a, b in pairs:
        assert M.fuzz_ratio(a, b) == fuzzywuzzy_fuzz.ratio(a, b), (a, b)
    assert round(rapid.ratio("ab1cdxyz", "xyzab2cd")) == 50  # why rapidfuzz is not used


def test_sample_score_first_line_rule_and_max_over_answers():
    # trec: lstrip('\n') + first line -> "City"; only "City" named -> 1.0
    assert M.sample_score("classification", "trec", "\nCity\nType: Country", ["City"],
                          ["City", "Country", "Date"]) == 1.0
    # hotpotqa has no first-line rule: "Paris\nFrance" keeps both words -> P = 1/2, R = 1 -> 2/3
    assert M.sample_score("qa_f1", "hotpotqa", "Paris\nFrance", ["Paris"]) == pytest.approx(2 / 3)
    # max over answers: "London, UK" gives 2/3 (P = 1, R = 1/2), "London" gives 1.0
    assert M.sample_score("qa_f1", "triviaqa", "london", ["London, UK", "London"]) == 1.0
    assert M.sample_score("qa_f1", "triviaqa", "london", []) == 0.0
    with pytest.raises(M.ScoringError, match="unknown metric 'bleu'"):
        M.sample_score("bleu", "x", "a", ["a"])
