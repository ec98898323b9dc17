"""Prompt filling, middle truncation, the chat-template rule, task names and v2 answer extraction."""

import pytest
from transformers import AutoTokenizer

from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer
from minimax_m3.eval import protocol as P


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_toy_tokenizer(d, 512)  # one id per byte; the chat template is "<s><|user|>{text}<|end|><|assistant|>"
    return AutoTokenizer.from_pretrained(d)


def test_middle_truncation_rules():
    ids = list(range(10))
    assert P.middle_truncate_v1(ids, 4) == ([0, 1], [8, 9])
    assert P.middle_truncate_v1(ids, 5) == ([0, 1], [8, 9])  # half = int(5/2) = 2: an odd budget keeps 4
    assert P.middle_truncate_v1(ids, 10) is None  # exactly at the limit: untouched
    assert P.middle_truncate_v2(ids, 5) == [0, 1, 7, 8, 9]  # ids[:5//2] + ids[-5//2:] = ids[:2] + ids[-3:]
    assert P.middle_truncate_v2(ids, 4) == [0, 1, 8, 9]
    assert P.middle_truncate_v2(ids, 10) == ids


def test_one_token_budget_as_pred_py():
    ids = list(range(10))
    # LongBench/pred.py: half = int(1/2) = 0, prompt = decode(ids[:0]) + decode(ids[-0:]); ids[-0:] is ids[0:],
    # the whole list, so a budget of 1 keeps all 10 ids (nothing is cut; only special tokens are dropped).
    assert P.middle_truncate_v1(ids, 1) == ([], ids)
    # v2's pred.py: ids[:1//2] + ids[-1//2:] = ids[:0] + ids[-1:] (since -1//2 = -1): the last id only.
    assert P.middle_truncate_v2(ids, 1) == [9]
    assert P.middle_truncate_v1(ids, 3) == ([0], [9])  # half = int(3/2) = 1
    for bad in (0, -4):
        with pytest.raises(P.LongBenchTaskError, match="at least 1 token.*--max-input-tokens"):
            P.middle_truncate_v1(ids, bad)
        with pytest.raises(P.LongBenchTaskError, match="at least 1 token"):
            P.middle_truncate_v2(ids, bad)


def test_prepare_v1_one_token_budget_keeps_the_prompt(tok):
    # the same rule through prepare_v1: decode([]) + decode(all 10 ids) = the whole prompt, then the chat rule
    p = P.prepare_v1(tok, "0123456789", "trec", max_input_tokens=1)
    assert tok.decode(p.ids) == "0123456789" and len(p.ids) == 10
    p = P.prepare_v1(tok, "0123456789", "hotpotqa", max_input_tokens=1)
    assert tok.decode(p.ids) == "<s><|user|>0123456789<|end|><|assistant|>"
    assert tok.decode(P.prepare_v2(tok, "0123456789", max_input_tokens=1).ids) == "<s><|user|>9<|end|><|assistant|>"


def test_prepare_v1_truncates_raw_prompt_before_chat_template(tok):
    # hotpotqa uses the chat template: truncate "0123456789" to 4 ids -> "01" + "89", then wrap it
    p = P.prepare_v1(tok, "0123456789", "hotpotqa", max_input_tokens=4)
    assert p.truncated and p.raw_tokens == 10
    assert tok.decode(p.ids) == "<s><|user|>0189<|end|><|assistant|>"  # markers intact
    assert len(p.ids) == 1 + 1 + 4 + 1 + 1
    # trec skips the chat template: just the truncated text
    p = P.prepare_v1(tok, "0123456789", "trec", max_input_tokens=4)
    assert tok.decode(p.ids) == "0189" and len(p.ids) == 4
    # at the limit: nothing cut
    p = P.prepare_v1(tok, "0123456789", "lcc", max_input_tokens=10)
    assert not p.truncated and tok.decode(p.ids) == "0123456789"
    # LongBench-E variants follow their base task
    assert tok.decode(P.prepare_v1(tok, "abc", "trec_e", 10).ids) == "abc"
    assert tok.decode(P.prepare_v1(tok, "abc", "qasper_e", 10).ids) == "<s><|user|>abc<|end|><|assistant|>"


def test_prepare_v1_shrinks_budget_to_fit_engine(tok):
    # budget 8 -> 8 text ids + 4 template ids = 12 > room 6: budget shrinks by 6 to 2 -> "0" + "9" -> 6 ids
    p = P.prepare_v1(tok, "0123456789", "hotpotqa", max_input_tokens=8, max_total=6)
    assert tok.decode(p.ids) == "<s><|user|>09<|end|><|assistant|>"
    with pytest.raises(P.LongBenchTaskError, match="lower --max-input-tokens"):
        P.prepare_v1(tok, "0123456789", "hotpotqa", max_input_tokens=8, max_total=3)


def test_chat_rule_exactly_six_tasks_skip():
    skipped = {t for t in P.V1_TASKS if not P.uses_chat_template(t)}
    assert skipped == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert len(P.V1_TASKS) - len(skipped) == 15
    assert not P.uses_chat_template("lcc_e") and P.uses_chat_template("hotpotqa_e")


def test_chat_wrap_requires_template(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(P.LongBenchTaskError, match="no chat_template"):
        P.chat_wrap(NoTemplate(), "x")
    assert P.chat_wrap(tok, "问") == "<s><|user|>问<|end|><|assistant|>"


def test_fill_v1_prompt():
    rec = {"context": "C", "input": "Q", "answers": ["a"], "_id": "x"}
    assert P.fill_v1_prompt("Read: {context}\n\nQuestion: {input}\nAnswer:", rec,
                            "hotpotqa") == "Read: C\n\nQuestion: Q\nAnswer:"
    with pytest.raises(P.LongBenchTaskError, match="needs field 'question'"):
        P.fill_v1_prompt("{question}", rec, "hotpotqa")


def test_resolve_tasks():
    assert len(P.resolve_tasks("all")) == 21 and len(P.resolve_tasks("e")) == 13
    assert P.resolve_tasks("hotpotqa, qasper_e,v2,hotpotqa") == ["hotpotqa", "qasper_e", "v2"]
    assert P.resolve_tasks(["trec"]) == ["trec"]
    with pytest.raises(P.LongBenchTaskError, match="unknown LongBench task 'hotpot'.*narrativeqa.*repobench-p"):
        P.resolve_tasks("hotpot")
    with pytest.raises(P.LongBenchTaskError, match="no tasks given"):
        P.resolve_tasks(" , ")
    with pytest.raises(P.LongBenchTaskError, match="unknown"):
        P.resolve_tasks("narrativeqa_e")  # not a LongBench-E task


@pytest.mark.parametrize(
    "response,expected",
    [
        ("The correct answer is (B)", "B"),
        ("**The correct answer is C**", "C"),  # '*' deleted first
        ("The correct answer is (b)", None),  # case-sensitive
        ("The correct answer is: (C)", None),
        ("I think B", None),
        ("the correct answer is (A). The correct answer is (D)", "D"),  # lowercase "the" does not match
        ("The correct answer is A, or The correct answer is (C)", "C"),  # the parenthesised form wins
    ],
)
def test_extract_v2_answer(response, expected):
    assert P.extract_v2_answer(response) == expected


def test_v2_prompt_and_thinking():
    item = {"context": " doc \n", "question": " q? ", "choice_A": "a", "choice_B": "b", "choice_C": "c",
            "choice_D": " d"}
    tmpl = "<text>\n$DOC$\n</text>\nQ: $Q$\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$"
    assert P.fill_v2_prompt(tmpl, item) == "<text>\ndoc\n</text>\nQ: q?\n(A) a\n(B) b\n(C) c\n(D) d"
    thought = "<think>The correct answer is (A)</think>The correct answer is (B)"
    assert P.extract_v2_answer(thought) == "A"  # the official regex searches the whole response: first match
    assert P.extract_v2_answer(P.strip_thinking(thought)) == "B"


@pytest.mark.parametrize("response,kept", [
    ("<mm:think>The correct answer is (A)</mm:think>The correct answer is (B)", "The correct answer is (B)"),  # M3
    # M3 thinking_mode=enabled: the prompt ends <mm:think>, so the response opens inside the block
    ("The correct answer is (A)?\nNo.</mm:think>\nThe correct answer is (C)", "\nThe correct answer is (C)"),
    ("</mm:think>The correct answer is (D)", "The correct answer is (D)"),  # disabled-style: an empty block
    ("\n<mm:think>The correct answer is (A), still thinking when max_gen ran out", ""),  # never closed: no answer
    ("<mm:think>a</mm:think>x<mm:think>b</mm:think>y", "xy"),  # every complete block
    ("Thinking first: (A)</think>The correct answer is (B)", "The correct answer is (B)"),  # M2, opened by its prompt
    ("The correct answer is (B): no thinking", "The correct answer is (B): no thinking"),
])
def test_strip_thinking_m3_markers(response, kept):
    assert P.strip_thinking(response) == kept


def test_prepare_v2_truncation(tok):
    # v2 keeps ids[:4//2] + ids[-4//2:] = "01" + "89", and always applies the chat template
    p = P.prepare_v2(tok, "0123456789", max_input_tokens=4)
    assert p.truncated and tok.decode(p.ids) == "<s><|user|>0189<|end|><|assistant|>"
