"""MiniMax-M3's reply parsers without vLLM (``checkpoint/chat_parse.py``, ``checkpoint/tool_args.py``): thinking by
``thinking_mode``, tool calls with schema-typed arguments, streaming fed in random pieces (split inside the markers
too), cut-off and malformed calls, and the round trip through the chat template's rendering of an assistant turn.

Oracles: replies written here by hand in M3's format (issue 35) and the values vLLM >= 0.24's ``minimax_m3`` parser
gives for them (its tests at PR #45381; the same cases against ``vllm._rust_tool_parser`` itself run in
``test/vllm_neuron/test_m3_parsers_vllm024.py``); for the round trip, the arguments the template was given.
"""

import json
import random

import pytest

from minimax_m3.checkpoint.chat_parse import (NS, MarkerIds, ThinkingSplitter, ToolCallStream, output_reasoning_ended,
                                              parse_tool_calls, reasoning_ended_in_ids, split_thinking)
from minimax_m3.checkpoint.tool_args import convert, kind_of

ORDER = {"type": "object", "properties": {
    "user_id": {"type": "integer"}, "urgent": {"type": "boolean"}, "note": {"type": "string"},
    "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
    "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                          "qty": {"type": "integer"}}}},
    "metadata": {"type": "object", "additionalProperties": {"type": "integer"}},
    "tags": {"type": "array", "items": {"type": "string"}}, "ratio": {"type": "number"}}}
TOOLS = [{"type": "function", "function": {"name": "create_order", "parameters": ORDER}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def el(name, body):
    return f"{NS}<{name}>{body}{NS}</{name}>"


def invoke(name, body):
    return f'{NS}<invoke name="{name}">{body}{NS}</invoke>'


def block(*invokes):
    return f"{NS}<tool_call>\n" + "\n".join(invokes) + f"\n{NS}</tool_call>"


ORDER_CALL = invoke("create_order", el("user_id", "42") + el("urgent", "true") + el("note", "Leave at the desk.")
                    + el("shipping", el("city", "Singapore") + el("zip", "018956"))
                    + el("items", el("item", el("sku", "book-001") + el("qty", "2"))
                         + el("item", el("sku", "pen-007") + el("qty", "5")))
                    + el("metadata", el("score", "42") + el("rank", "7"))
                    + el("tags", el("item", "a")) + el("ratio", "0.5"))
ORDER_ARGS = {"user_id": 42, "urgent": True, "note": "Leave at the desk.",
              "shipping": {"city": "Singapore", "zip": 18956},
              "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
              "metadata": {"score": 42, "rank": 7}, "tags": ["a"], "ratio": 0.5}
WEATHER = invoke("get_weather", el("city", "Paris") + el("days", "3"))


def args(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def pieces(text, rng, most=7):
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, most)
        out.append(text[i:i + k])
        i += k
    return out


def stream_tools(chunks, tools=TOOLS):
    s, content, calls = ToolCallStream(tools), [], []
    for c in chunks:
        a, b = s.feed(c)
        content.append(a)
        calls += b
    a, b = s.finish()
    return "".join(content + [a]), calls + b


# ---- tool calls, whole replies -----------------------------------------------------------------------------------

def test_nested_parameters_lists_and_types():
    content, calls = parse_tool_calls("I will create it.\n" + block(ORDER_CALL), TOOLS)
    assert content == "I will create it.\n" and args(calls) == [("create_order", ORDER_ARGS)]
    assert calls[0].arguments.startswith('{"user_id":42,"urgent":true,')  # compact JSON, in the model's order


def test_several_invokes_and_the_text_around_them():
    reply = "Checking both. " + block(WEATHER, invoke("get_weather", el("city", "Oslo"))) + " ignored after"
    content, calls = parse_tool_calls(reply, TOOLS)
    assert content == "Checking both. "  # text after the block is dropped, as vLLM's parser does
    assert args(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls("no call here", TOOLS) == ("no call here", [])


def test_values_without_a_schema_stay_text_and_trees_become_objects():
    body = el("days", "3") + el("l", el("item", "1") + el("item", "2")) + el("one", el("item", "x")) + el("n", "null")
    _, calls = parse_tool_calls(block(invoke("unknown_tool", body)), TOOLS)
    assert args(calls) == [("unknown_tool", {"days": "3", "l": {"item": ["1", "2"]}, "one": {"item": "x"},
                                             "n": None})]


@pytest.mark.parametrize("schema,text,want", [
    ({"type": "integer"}, "007", 7), ({"type": "integer"}, "3.0", "3.0"), ({"type": "integer"}, " 7 ", " 7 "),
    ({"type": "number"}, "2", 2), ({"type": "number"}, "-1e3", -1000.0), ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "True", True), ({"type": "boolean"}, "0", False), ({"type": "boolean"}, "yes", "yes"),
    ({"type": "string"}, "null", None), ({"type": "string"}, "  padded \n", "  padded \n"),
    ({"type": "array"}, "", []), ({"type": "array"}, "[1, 2]", [1, 2]), ({"type": "object"}, '{"k": 1}', {"k": 1}),
    ({"type": "object"}, "1e400", "1e400"), ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", "x"),
    ({"type": ["integer", "null"]}, "4", 4), ({"enum": ["a", "b"]}, "1", "1"), ({"type": "int64"}, "5", 5),
])
def test_leaf_values_typed_by_the_schema(schema, text, want):
    got = convert(kind_of(schema), text)
    assert got == want and type(got) is type(want)


def test_repeated_tags_mixed_text_and_junk():
    body = (el("metadata", "note " + el("a", "1") + el("a", "2") + " end") + el("note", "x") + " junk "
            + el("ratio", "1"))
    _, calls = parse_tool_calls(block(invoke("create_order", body)), TOOLS)
    # repeated child tags collect in a list; text between children under $text; text after a parameter ends them
    assert args(calls) == [("create_order", {"metadata": {"a": [1, 2], "$text": "note  end"}, "note": "x"})]


# ---- streaming, cut-off and malformed calls ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_random_pieces_equals_the_whole(seed):
    rng = random.Random(seed)
    reply = "Sure ]<]x [" + block(ORDER_CALL, WEATHER)  # a stray ]<] in the text, markers split anywhere
    assert stream_tools(pieces(reply, rng)) == parse_tool_calls(reply, TOOLS)


def test_streaming_emits_each_call_when_its_invoke_closes():
    s = ToolCallStream(TOOLS)
    assert s.feed("Hi ]<]mini") == ("Hi ", [])  # a possible marker start is held back
    assert s.feed(f"max[>[<tool_call>\n{WEATHER[:30]}") == ("", [])
    content, calls = s.feed(WEATHER[30:] + "\n" + NS)
    assert content == "" and args(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert s.feed("</tool_call> after") == ("", []) and s.finish() == ("", [])


def test_a_cut_off_reply_never_raises_and_ends_as_content():
    reply = "Let me look. " + block(WEATHER, ORDER_CALL)
    first_end = reply.index(f"{NS}</invoke>") + len(f"{NS}</invoke>")
    for cut in range(len(reply) + 1):
        text = reply[:cut]
        content, calls = parse_tool_calls(text, TOOLS)
        streamed_content, streamed_calls = stream_tools(pieces(text, random.Random(cut)))
        if cut < first_end:  # nothing committed: the whole text is content, both ways
            assert (content, calls) == (text or None, []) and (streamed_content, streamed_calls) == (text, [])
        elif calls:  # the block's rest is blank, or closed: the calls stand
            assert streamed_calls == calls
        else:  # calls committed, then cut: a whole reply is all content; a stream keeps its calls, the tail as text
            end = text.rindex(f"{NS}</invoke>") + len(f"{NS}</invoke>")
            assert content == text and len(streamed_calls) == text.count(f"{NS}</invoke>")
            assert args(streamed_calls)[0] == ("get_weather", {"city": "Paris", "days": 3})
            assert streamed_content == "Let me look. " + text[end:]


@pytest.mark.parametrize("bad", [f"\n{NS}</city>", "\nhello", f'\n{NS}<invoke name="f">{NS}<a>1{NS}</b>{NS}</invoke>',
                                 f"\n{NS}<invoke>{NS}</invoke>", f'\n{NS}<invoke name="f">{NS}junk{NS}</invoke>'])
def test_a_malformed_block_is_content_and_so_is_what_follows(bad):
    reply = f"Hi {NS}<tool_call>{bad}"
    assert parse_tool_calls(reply + " later", TOOLS) == (reply + " later", [])
    s = ToolCallStream(TOOLS)
    assert s.feed(reply) == ("Hi " + f"{NS}<tool_call>{bad}", []) and s.failed
    assert s.feed(" later") == (" later", [])
    after_a_call = ToolCallStream(TOOLS)
    assert after_a_call.feed(f"{NS}<tool_call>\n{WEATHER}{bad}")[0] == bad  # the committed call stays a call


def test_an_empty_block_stays_text():
    reply = f"a {NS}<tool_call>\n{NS}</tool_call> b"
    assert parse_tool_calls(reply, TOOLS) == (reply, [])
    assert stream_tools(pieces(reply, random.Random(0))) == (reply, [])


# ---- thinking ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,reply,want", [
    ("adaptive", "<mm:think>plan</mm:think>answer", ("plan", "answer")),
    ("adaptive", "plain answer", (None, "plain answer")),
    ("adaptive", "</mm:think>answer", (None, "answer")),  # a stray leading closer (vLLM #50549)
    ("adaptive", "XXX</mm:think>YYY", (None, "XXX</mm:think>YYY")),
    ("adaptive", '{"a": "<mm:think>"}', (None, '{"a": "<mm:think>"}')),  # a literal marker in an answer (#48663)
    ("adaptive", "\n<mm:think>plan</mm:think></mm:think>answer", ("plan", "answer")),
    ("adaptive", "<mm:think>still thinking", ("still thinking", None)),
    ("enabled", "plan</mm:think>answer", ("plan", "answer")),
    ("enabled", "<mm:think>plan</mm:think>answer", ("plan", "answer")),  # a redundant opener
    ("enabled", "plan, cut off", ("plan, cut off", None)),
    ("disabled", "answer", (None, "answer")), ("disabled", "</mm:think>answer", (None, "answer")),
    ("disabled", "<mm:think>thought anyway</mm:think>answer", ("thought anyway", "answer")),
    ("enabled", f"plan{NS}<tool_call>\n", ("plan", f"{NS}<tool_call>\n")),  # a call ends the block
    (None, "<mm:think>p</mm:think>a", ("p", "a")), ("bogus", "a", (None, "a")),
])
def test_thinking_modes(mode, reply, want):
    assert split_thinking(reply, mode) == want
    for seed in range(8):  # streamed in pieces (split inside <mm:think> too): the same split
        s, r, c = ThinkingSplitter(mode), "", ""
        for p in pieces(reply, random.Random(seed), most=4):
            a, b = s.feed(p)
            r, c = r + a, c + b
        a, b = s.finish()
        assert ((r + a) or None, (c + b) or None) == want


def test_the_stream_switches_to_content_as_soon_as_it_can():
    s = ThinkingSplitter("adaptive")
    assert s.feed("\n") == ("", "") and not s.reasoning_ended  # undecided: a blank, then maybe <mm:think>
    assert s.feed("<mm:th") == ("", "") and s.feed("ink>pl") == ("pl", "") and not s.reasoning_ended
    assert s.feed("an</mm:") == ("an", "") and s.feed("think>") == ("", "") and not s.reasoning_ended
    assert s.feed("</mm:think>A") == ("", "A") and s.reasoning_ended  # a repeated closer is dropped first
    plain = ThinkingSplitter("adaptive")
    assert plain.feed("Hel") == ("", "Hel") and plain.reasoning_ended


# ---- reasoning state from token ids (vLLM's switch to the tool parser, its structured-output grammar) -----------

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from minimax_m3.checkpoint.chat_template import M3_CHAT_TEMPLATE
    from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer

    d = tmp_path_factory.mktemp("m3tok")
    write_toy_tokenizer(d, 512, chat_template=M3_CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("mode,output,ended", [
    ("enabled", "", False), ("disabled", "", True), ("adaptive", "", False), ("adaptive", "\n", False),
    ("adaptive", "Hello", True), ("adaptive", "<mm:think>x", False), ("adaptive", "<mm:think>x</mm:think>", True),
    ("enabled", "x</mm:think>a", True), ("enabled", f"x{NS}<tool_call>", True),
])
def test_reasoning_end_is_read_from_the_last_turn_not_the_system_text(tok, mode, output, ended):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<mm:think>a</mm:think>b"},
            {"role": "user", "content": "again"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking_mode=mode)
    assert prompt.count("</mm:think>") >= 2  # the system text quotes the markers, the earlier turn closes a block
    ids = tok.encode(prompt + output, add_special_tokens=False)
    m = MarkerIds.of(tok.get_vocab())
    assert reasoning_ended_in_ids(ids, m, lambda x: tok.decode(x)) is ended
    out = tok.encode(output, add_special_tokens=False)
    assert reasoning_ended_in_ids(out, m, tok.decode) is None  # output alone: no turn to read
    assert output_reasoning_ended(out, m) is (ended and bool(output) and "Hello" not in output)


# ---- the round trip: what the chat template renders for an assistant turn parses back ----------------------------

def test_what_the_template_renders_parses_back(tok):
    calls = [{"type": "function", "function": {"name": "create_order", "arguments": ORDER_ARGS}},
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]
    msgs = [{"role": "user", "content": "Order and weather."},
            {"role": "assistant", "content": "On it.", "reasoning_content": "Two calls.", "tool_calls": calls}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    reply = text[text.rindex("]~b]ai\n") + len("]~b]ai\n"):text.rindex("[e~[")]
    for mode, generated in (("adaptive", reply), ("enabled", reply[len("<mm:think>"):])):
        reasoning, content = split_thinking(generated, mode)
        assert reasoning == "Two calls."
        answer, got = parse_tool_calls(content, TOOLS)
        assert answer == "On it.\n"  # the template's newline between the answer and its calls stays with the answer
        assert args(got) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert stream_tools(pieces(content, random.Random(1))) == (answer, got)
