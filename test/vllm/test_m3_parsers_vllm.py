"""MiniMax-M3's ``minimax_m3`` tool-call and reasoning parsers in vLLM 0.13 (``neuron/vllm/parsers.py``): registered
by the package's general plugin as vLLM loads it, found by name in vLLM's managers, and driven by vLLM's own chat
serving code (``OpenAIServingChat``'s streaming and full generators, fed scripted engine outputs) with the tokenizer
of a synthetic checkpoint (the toy tokenizer with M3's special tokens and chat template).

Oracle: replies written here by hand in M3's format (issue 35): the reasoning, answer and calls they were written
from. Needs vLLM 0.13 only (``.venv-vllm``; no NxDI, no engine).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test_vllm_offdevice.sh builds .venv-vllm)")
pytest.importorskip("vllm.tool_parsers", reason="a vLLM without vllm.tool_parsers (0.13's parser registry)")

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestResponseMetadata  # noqa: E402
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.reasoning import ReasoningParserManager  # noqa: E402
from vllm.tool_parsers import ToolParserManager  # noqa: E402

from test.support.openai_server import assemble_stream  # noqa: E402

NS = "]<]minimax[>["
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "units": {"type": "array", "items": {"type": "string"}}}}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
CALLS = (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>'
         f'{NS}<units>{NS}<item>C{NS}</item>{NS}</units>{NS}</invoke>\n'
         f'{NS}<invoke name="get_time">{NS}<tz>CET{NS}</tz>{NS}</invoke>\n{NS}</tool_call>')
WANT_CALLS = [("get_weather", {"city": "Paris", "days": 3, "units": ["C"]}), ("get_time", {"tz": "CET"})]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from vllm.tokenizers import get_tokenizer

    from minimax_m3.checkpoint.synthetic import write_synthetic

    return get_tokenizer(str(write_synthetic(tmp_path_factory.mktemp("m3") / "tiny", "tiny")))


@pytest.fixture(scope="module")
def registered():
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as every vLLM process does: the package's entry point registers the parsers
    return ToolParserManager.get_tool_parser("minimax_m3"), ReasoningParserManager.get_reasoning_parser("minimax_m3")


def test_the_plugin_registers_both_parsers(registered):
    from minimax_m3.neuron.vllm.parsers import M3ReasoningParser, M3ToolParser

    assert registered == (M3ToolParser, M3ReasoningParser)
    assert "minimax_m3" in ToolParserManager.list_registered()
    assert "minimax_m3" in ReasoningParserManager.list_registered()


def _request(mode, tools=True, **kw):
    return ChatCompletionRequest(model="m3", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
                                 tools=TOOLS if tools else None, chat_template_kwargs={"thinking_mode": mode}, **kw)


def test_the_adapter_interfaces_directly(registered, tokenizer):
    tool_cls, reasoning_cls = registered
    request = _request("enabled")
    assert tool_cls(tokenizer).adjust_request(request).skip_special_tokens is False  # M3's markers stay in the text
    reasoner = reasoning_cls(tokenizer, chat_template_kwargs=request.chat_template_kwargs)
    reasoning, content = reasoner.extract_reasoning(f"Look it up.</mm:think>Checking.\n{CALLS}", request)
    assert (reasoning, content) == ("Look it up.", f"Checking.\n{CALLS}")
    info = tool_cls(tokenizer).extract_tool_calls(content, request)
    assert info.tools_called and info.content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == WANT_CALLS
    cut = content[:-40]
    assert tool_cls(tokenizer).extract_tool_calls(cut, request).model_dump() == {
        "tools_called": False, "tool_calls": [], "content": cut}
    # token ids: read from the prompt's last turn (its system text quotes <mm:think></mm:think>), as the
    # structured-output manager asks (one parser for all requests, built without chat_template_kwargs)
    shared = reasoning_cls(tokenizer=tokenizer)
    for mode, ended in (("enabled", False), ("disabled", True), ("adaptive", False)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                               add_generation_prompt=True, thinking_mode=mode)
        assert shared.is_reasoning_end(prompt) is ended, mode
        if mode == "adaptive":  # the reply decides: an answer at once ends it, an opened block does not
            answer = tokenizer.encode("Sure", add_special_tokens=False)
            think = tokenizer.encode("<mm:think>Hm", add_special_tokens=False)
            assert shared.is_reasoning_end_streaming(prompt + answer, answer)
            assert not shared.is_reasoning_end_streaming(prompt + think, think)


def _engine_outputs(tokenizer, prompt_ids, reply, finish="stop", eos=True, per=1):
    """What vLLM's engine streams for ``reply``: ``per`` tokens a step, text detokenized incrementally (an
    incomplete UTF-8 character held back), special tokens kept (the tool parser asks for that), EOS last."""
    ids = tokenizer.encode(reply, add_special_tokens=False)
    steps, shown = [], ""
    for i in range(0, len(ids), per):
        text = tokenizer.decode(ids[:i + per], skip_special_tokens=False)
        text = text if not text.endswith("\ufffd") else shown
        steps.append((ids[i:i + per], text[len(shown):]))
        shown = text
    if eos:
        steps.append(([tokenizer.eos_token_id], ""))
    outs = []
    for n, (step_ids, text) in enumerate(steps):
        last = n == len(steps) - 1
        outs.append(RequestOutput("req", None, prompt_ids, None, [CompletionOutput(
            0, text, step_ids, None, None, finish_reason=finish if last else None)], finished=last))
    return outs, ids


def _serving(tool, reasoning):
    chat = OpenAIServingChat.__new__(OpenAIServingChat)  # only what the generators read: no engine behind it
    chat.__dict__.update(response_role="assistant", reasoning_parser=reasoning, tool_parser=tool,
                         enable_auto_tools=True, use_harmony=False, tool_call_id_type="random",
                         enable_log_outputs=False, request_logger=None, enable_prompt_tokens_details=False,
                         enable_force_include_usage=False,
                         return_tokens_as_token_ids=False, log_error_stack=False)
    return chat


async def _agen(items):
    for x in items:
        yield x


def _run(registered, tokenizer, request, reply, stream, **kw):
    """The chat completion vLLM 0.13 returns for ``reply``: (reasoning, content, [(name, args)], finish_reason)."""
    chat = _serving(*registered)
    request = registered[0](tokenizer).adjust_request(request) if request.tools else request
    prompt = tokenizer.apply_chat_template([m.model_dump() if hasattr(m, "model_dump") else m
                                            for m in request.messages], tools=TOOLS if request.tools else None,
                                           tokenize=True, add_generation_prompt=True, **request.chat_template_kwargs)
    outs, _ = _engine_outputs(tokenizer, prompt, reply, **kw)
    meta = RequestResponseMetadata(request_id="req")
    if not stream:
        full = outs[-1]
        full.outputs[0].text = "".join(o.outputs[0].text for o in outs)
        full.outputs[0].token_ids = [t for o in outs for t in o.outputs[0].token_ids]
        resp = asyncio.run(chat.chat_completion_full_generator(request, _agen([full]), "req", "m3", [], tokenizer,
                                                               meta))
        msg = resp.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        return msg.reasoning or None, msg.content or None, calls, resp.choices[0].finish_reason

    async def collect():
        return [c async for c in chat.chat_completion_stream_generator(request, _agen(outs), "req", "m3", [],
                                                                       tokenizer, meta)]

    bodies = (line.removeprefix("data: ").strip() for line in asyncio.run(collect()))
    return assemble_stream(json.loads(b) for b in bodies if b != "[DONE]")


REPLIES = {  # thinking_mode -> (the reply the model writes, after the generation prompt), the chat completion
    "enabled": ("Paris: weather and time.</mm:think>Checking both.\n" + CALLS,
                ("Paris: weather and time.", "Checking both.\n", WANT_CALLS, "tool_calls")),
    "adaptive": ("<mm:think>Two tools.</mm:think>" + CALLS, ("Two tools.", None, WANT_CALLS, "tool_calls")),
    "disabled": ("Sure.\n" + CALLS, (None, "Sure.\n", WANT_CALLS, "tool_calls")),
}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("mode", list(REPLIES))
def test_chat_completions_with_tools(registered, tokenizer, mode, stream):
    reply, want = REPLIES[mode]
    assert _run(registered, tokenizer, _request(mode), reply, stream) == want
    if stream:  # several tokens a step (speculative decoding, a slow client): the same completion
        assert _run(registered, tokenizer, _request(mode), reply, stream, per=5) == want


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("mode,reply,want", [
    ("adaptive", "No tool needed: 42.", (None, "No tool needed: 42.", [], "stop")),
    ("adaptive", "</mm:think>42.", (None, "42.", [], "stop")),  # a stray closer (vLLM #50549)
    ("adaptive", 'A JSON answer: {"tag": "<mm:think>"}', (None, 'A JSON answer: {"tag": "<mm:think>"}', [], "stop")),
    ("enabled", "Think.</mm:think>The answer.", ("Think.", "The answer.", [], "stop")),
])
def test_answers_without_calls(registered, tokenizer, mode, reply, want, stream):
    assert _run(registered, tokenizer, _request(mode), reply, stream) == want
    assert _run(registered, tokenizer, _request(mode, tools=False), reply, stream) == want  # reasoning parser alone


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("mode,thought", [("disabled", ""), ("adaptive", "<mm:think>Two tools.</mm:think>")])
def test_a_call_cut_off_by_max_tokens_ends_as_content(registered, tokenizer, mode, thought, stream):
    answer = "Let me check.\n" + CALLS[:120]
    n = len(tokenizer.encode(thought + answer, add_special_tokens=False))
    got = _run(registered, tokenizer, _request(mode, max_tokens=n), thought + answer, stream, finish="length",
               eos=False)
    assert got == ("Two tools." if thought else None, answer, [], "length")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_malformed_call_ends_as_content(registered, tokenizer, stream):
    reply = f"Hmm.\n{NS}<tool_call>\n{NS}<invoke>{NS}<city>Paris{NS}</city>{NS}</invoke>\n{NS}</tool_call>"
    assert _run(registered, tokenizer, _request("disabled"), reply, stream) == (None, reply, [], "stop")

