"""M3's chat template (``checkpoint/chat_template.py``), its special tokens in the toy tokenizer, and chat input to
``minimax-m3 generate``.

Oracle: strings written here by hand from M3's format (issue 35; ms-swift's ``swift/template/templates/minimax.py``
for the fixed system text and ``swift/agent_template/minimax_m3.py`` for the tools section and call arguments), not
produced by the template; rendered through ``transformers.AutoTokenizer.apply_chat_template`` as a caller would.
"""

import json
import shutil

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from minimax_m3.checkpoint import chat_template as C
from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer
from minimax_m3.cli import main

NS = "]<]minimax[>["
IDENTITY = ("Your model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. Founded in early "
            "2022, MiniMax is a global AI foundation model company committed to advancing the frontiers of AI towards "
            "AGI.")
THINKING = ("You have a thinking capability that allows you to reason step by step before responding. When thinking "
            "is enabled, wrap your reasoning in <mm:think></mm:think> tags before your response. When thinking is "
            "disabled, begin your response directly after the </mm:think> prefix. When thinking is adaptive, decide "
            "on your own whether to think for the current turn.")
MODE = {
    "enabled": "Current thinking mode: enabled. You MUST think step by step before every response, including after "
               "receiving function/tool results.",
    "disabled": "Current thinking mode: disabled. Do not output any thinking process.",
    "adaptive": "Current thinking mode: adaptive. You are encouraged to think for complex decision-making, multi-step "
                "reasoning, or when analyzing function/tool results.",
}
DEFAULT_DEV = "]~b]developer\nYou are a helpful assistant.[e~[\n"


def system(mode="adaptive"):
    return (f"]~!b[]~b]system\n{IDENTITY}\n\n<thinking_instructions>\n{THINKING}\n{MODE[mode]}\n"
            "</thinking_instructions>[e~[\n")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("m3tok")
    write_toy_tokenizer(d, 512, chat_template=C.M3_CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(d)


def render(tok, messages, gen=True, **kw):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)


def test_system_and_user(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tok, msgs) == system() + "]~b]developer\nBe brief.[e~[\n]~b]user\nHi[e~[\n]~b]ai\n"
    # a developer message takes the same slot; without either, the default developer text
    assert render(tok, [{"role": "developer", "content": "Dev."}, msgs[1]]) == render(
        tok, [{"role": "system", "content": "Dev."}, msgs[1]])
    assert render(tok, msgs[1:], gen=False) == system() + DEFAULT_DEV + "]~b]user\nHi[e~[\n"


@pytest.mark.parametrize("mode,ending", [("enabled", "]~b]ai\n<mm:think>"), ("disabled", "]~b]ai\n</mm:think>"),
                                         ("adaptive", "]~b]ai\n")])
def test_thinking_modes(tok, mode, ending):
    text = render(tok, [{"role": "user", "content": "Hi"}], thinking_mode=mode)
    assert text == system(mode) + DEFAULT_DEV + "]~b]user\nHi[e~[\n" + ending


def test_tools_are_listed_in_the_developer_turn(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"name": "noop", "parameters": {}}]  # a bare function object too
    text = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
                  tools=tools)
    assert text == system() + (
        "]~b]developer\nBe brief.\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
        "Here are the tools available in JSONSchema format:\n\n<tools>\n"
        '<tool>{"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}, "required": ["city"]}}</tool>\n'
        '<tool>{"name": "noop", "parameters": {}}</tool>\n'
        "</tools>\n\nTo call tools, wrap all invocations in a single ]<]minimax[>[<tool_call>]<]minimax[>[</tool_call> "
        "block. Parameter values containing nested objects or arrays are recursively expanded into XML elements. "
        "Example:\n\n"
        "]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="tool-name-1">]<]minimax[>[<param-1>value-1]<]minimax[>[</param-1>'
        "]<]minimax[>[<param-2>]<]minimax[>[<item>]<]minimax[>[<key-a>val-a]<]minimax[>[</key-a>"
        "]<]minimax[>[<key-b>val-b]<]minimax[>[</key-b>]<]minimax[>[</item>]<]minimax[>[</param-2>"
        "]<]minimax[>[</invoke>\n"
        ']<]minimax[>[<invoke name="tool-name-2">]<]minimax[>[<param-1>value-1]<]minimax[>[</param-1>'
        "]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>[e~[\n"
        "]~b]user\nParis?[e~[\n]~b]ai\n")


ARGS = {"city": "Paris", "days": [1, 2], "filters": {"units": "metric", "hourly": True, "skip": None},
        "stops": [{"name": "Lyon"}], "budget": 1.5, "note": None}
TRIP = (f'{NS}<invoke name="plan_trip">{NS}<city>Paris{NS}</city>{NS}<days>{NS}<item>1{NS}</item>{NS}<item>2{NS}</item>'
        f"{NS}</days>{NS}<filters>{NS}<units>metric{NS}</units>{NS}<hourly>true{NS}</hourly>{NS}</filters>{NS}<stops>"
        f"{NS}<item>{NS}<name>Lyon{NS}</name>{NS}</item>{NS}</stops>{NS}<budget>1.5{NS}</budget>{NS}</invoke>")
CALLS = [{"id": "c0", "type": "function", "function": {"name": "plan_trip", "arguments": ARGS}},
         {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]


def test_an_assistant_tool_call_and_the_tool_responses(tok):
    msgs = [{"role": "user", "content": "Plan a trip."},
            {"role": "assistant", "content": "Sure.", "reasoning_content": "Route first.", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "c0", "content": "booked"},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    assert render(tok, msgs, thinking_mode="enabled") == system("enabled") + DEFAULT_DEV + (
        "]~b]user\nPlan a trip.[e~[\n"
        f"]~b]ai\n<mm:think>Route first.</mm:think>Sure.\n{NS}<tool_call>\n{TRIP}\n"
        f'{NS}<invoke name="get_time">{NS}<tz>CET{NS}</tz>{NS}</invoke>\n{NS}</tool_call>[e~[\n'
        "]~b]tool\n<response>booked</response>\n<response>12:00</response>[e~[\n"
        "]~b]ai\n<mm:think>")


def test_earlier_turns_keep_no_reasoning(tok):
    """Reasoning before the last user turn is dropped (an empty block); inline <mm:think> in content is split off."""
    msgs = [{"role": "user", "content": "A?"},
            {"role": "assistant", "content": "<mm:think>hmm</mm:think>B.", "tool_calls": [CALLS[1]]},
            {"role": "tool", "content": "12:00"},
            {"role": "ai", "content": "C.", "reasoning_content": "late"},
            {"role": "user", "content": "D?"}]
    assert render(tok, msgs, thinking_mode="disabled") == system("disabled") + DEFAULT_DEV + (
        "]~b]user\nA?[e~[\n"
        f']~b]ai\n</mm:think>B.\n{NS}<tool_call>\n{NS}<invoke name="get_time">{NS}<tz>CET{NS}</tz>{NS}</invoke>\n'
        f"{NS}</tool_call>[e~[\n"
        "]~b]tool\n<response>12:00</response>[e~[\n"
        "]~b]ai\n</mm:think>C.[e~[\n"
        "]~b]user\nD?[e~[\n]~b]ai\n</mm:think>")


def test_the_template_refuses(tok):
    with pytest.raises(TemplateError, match="thinking_mode must be enabled, disabled or adaptive, got sometimes"):
        render(tok, [{"role": "user", "content": "x"}], thinking_mode="sometimes")
    with pytest.raises(TemplateError, match="unknown role robot"):
        render(tok, [{"role": "robot", "content": "x"}])
    bad = [{"role": "user", "content": "x"},
           {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    with pytest.raises(TemplateError, match="tool call f: arguments must be a JSON object"):
        render(tok, bad)
    with pytest.raises(C.ChatError, match="the chat template cannot render these messages: thinking_mode must"):
        C.chat_prompt_ids(tok, [{"role": "user", "content": "x"}], thinking_mode="sometimes")


def test_special_tokens_are_single_ids(tok):
    ids = {s: tok.encode(s, add_special_tokens=False) for s in C.SPECIAL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    # appended after the 256 byte tokens (pad, bos, eos, 4 markers, bytes = ids 0..262): byte ids did not move
    assert sorted(v[0] for v in ids.values()) == list(range(263, 271))
    text = f"]~!b[]~b]user\nhi[e~[\n]~b]ai\n<mm:think>x</mm:think>{NS}<tool_call>]<]image[>[]<]video[>["
    enc = tok.encode(text, add_special_tokens=False)
    assert len(enc) == 9 + len("user\nhi\nai\nx<tool_call>".encode()) and tok.decode(enc) == text
    assert "]~b]" in tok.all_special_tokens  # skip_special_tokens drops them
    assert tok.decode(tok.encode("]~b]ai\nok", add_special_tokens=False), skip_special_tokens=True) == "ai\nok"


def test_check_messages_parses_string_arguments():
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": [1, {"b": null}]}'}}]}]
    assert C.check_messages(msgs, "x")[0]["tool_calls"][0]["function"]["arguments"] == {"a": [1, {"b": None}]}


# ---- the synthetic checkpoint and `minimax-m3 generate` -------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("chat") / "tiny", "tiny", seed=0)


def test_the_synthetic_checkpoint_carries_the_template(ckpt):
    """Beside the tokenizer as chat_template.jinja (the release's layout); AutoTokenizer picks it up."""
    assert (ckpt / "chat_template.jinja").read_text() == C.M3_CHAT_TEMPLATE
    assert "chat_template" not in json.loads((ckpt / "tokenizer_config.json").read_text())
    t = AutoTokenizer.from_pretrained(ckpt)
    assert t.chat_template == C.M3_CHAT_TEMPLATE
    assert render(t, [{"role": "user", "content": "Hi"}]).startswith("]~!b[]~b]system\n")
    assert all(len(t.encode(s, add_special_tokens=False)) == 1 for s in C.SPECIAL_TOKENS)


def _generate(capsys, argv):
    assert main(["generate", "--device", "cpu", "--max-new-tokens", "3", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_with_messages_end_to_end(ckpt, tmp_path, capsys):
    t = AutoTokenizer.from_pretrained(ckpt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan a trip."},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_time", "arguments": '{"tz": "CET"}'}}]},  # the chat-completions wire form
            {"role": "tool", "content": "12:00"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    (tmp_path / "m.json").write_text(json.dumps({"messages": msgs, "tools": tools}))
    out = _generate(capsys, ["--model", str(ckpt), "--messages", str(tmp_path / "m.json"), "--thinking-mode",
                             "enabled"])
    want = t.encode(render(t, C.check_messages(json.loads(json.dumps(msgs)), "x"), tools=tools,
                           thinking_mode="enabled"), add_special_tokens=False)
    assert want[-5:] == t.encode("]~b]ai\n<mm:think>", add_special_tokens=False)
    # the engine got exactly these ids: the same greedy tokens as --prompt-ids
    ids = _generate(capsys, ["--model", str(ckpt), "--prompt-ids", ",".join(map(str, want))])
    assert out["prompt_tokens"] == len(want) and out["tokens"] == ids["tokens"] and 1 <= len(out["tokens"]) <= 3
    chat = _generate(capsys, ["--model", str(ckpt), "--chat", "Hi", "--thinking-mode", "disabled"])
    assert chat["prompt_tokens"] == len(t.encode(system("disabled") + DEFAULT_DEV + "]~b]user\nHi[e~[\n]~b]ai\n"
                                                 "</mm:think>", add_special_tokens=False))


def _fails(capsys, argv, *messages):
    assert main(["generate", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "minimax-m3 generate: error:" in err
    for m in messages:
        assert m in err, err


def test_generate_chat_errors(ckpt, tmp_path, capsys):
    m = ["--model", str(ckpt)]
    (tmp_path / "bad.json").write_text('[{"role": "user", "content": }]')
    _fails(capsys, m + ["--messages", str(tmp_path / "bad.json")], f"--messages {tmp_path / 'bad.json'}: not valid "
           "JSON (Expecting value: line 1 column 30", 'write a JSON list of {"role": ..., "content": ...} objects')
    _fails(capsys, m + ["--messages", str(tmp_path / "none.json")], "none.json: cannot read it (No such file")
    (tmp_path / "roles.json").write_text(json.dumps([{"role": "robot", "content": "x"}, {"role": "user", "content": 3},
                                                     {"role": "assistant", "tool_calls": [
                                                         {"function": {"name": "f", "arguments": "{oops"}}]}]))
    _fails(capsys, m + ["--messages", str(tmp_path / "roles.json")], "3 problem(s) in the chat messages",
           "message 0: role 'robot' is not one of system, developer, user, assistant, ai, tool",
           "message 1 (user): content must be a string or a list of parts",
           "message 2, tool call 0 (f): arguments are not valid JSON")
    (tmp_path / "tools.json").write_text('{"name": "f"}')
    _fails(capsys, m + ["--chat", "x", "--tools", str(tmp_path / "tools.json")], "tools must be a JSON list")
    _fails(capsys, m + ["--prompt", "x", "--thinking-mode", "enabled"],
           "--tools and --thinking-mode apply to chat input: give --messages FILE.json or --chat TEXT")
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["--model", str(tmp_path / "empty"), "--chat", "x"], "cannot load a tokenizer from",
           "it needs tokenizer.json and tokenizer_config.json")
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "chat_template.jinja").unlink()
    _fails(capsys, ["--model", str(bare), "--chat", "x"], f"checkpoint {bare} has no chat template",
           "put the model's chat_template.jinja beside its tokenizer files, or give raw text with --prompt")
