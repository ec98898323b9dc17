"""MiniMax-M3 served to agents, end to end: ``vllm serve`` (vLLM 0.13 + vllm-neuron 0.4.1, the port in NxDI's CPU
mode) with M3's chat template and the package's ``minimax_m3`` tool-call and reasoning parsers, on HTTP, streaming and
not, for each ``thinking_mode``; structured outputs refused by an on-device-sampling build and honoured by a
host-sampling one (issue 35).

Oracle: the scripted checkpoint (``test/support/scripted.py``): random weights, except that every token predicts a
fixed successor, so the greedy reply is the script written there by hand — its thinking, its answer and its tool
call (name and arguments) — whatever the server does with it. M3's own template (its fixed system block and the
tools make prompts of ~1,600 byte tokens: 2,048-token caches).
"""

from __future__ import annotations

import json

import pytest

from test.support.openai_server import chat_turn, post_error
from test.support.scripted import ANSWER, CALL, CALL_ARGS, REPLY, THOUGHT, WEATHER_TOOL

from .conftest import vllm_missing
from .test_vllm_smoke import vllm_serve

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
MAX_LEN = 2048
BUCKETS = {"context_encoding_buckets": [MAX_LEN], "token_generation_buckets": [MAX_LEN]}
PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3"]
# a scripted model has no preference among a grammar's tokens: without this, whitespace could follow the JSON forever
NO_WHITESPACE = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
UNIT = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["Celsius", "Fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from test.support.scripted import write_scripted

    return str(write_scripted(tmp_path_factory.mktemp("scripted") / "m3")[0])


@pytest.fixture(scope="module")
def server(scripted, tmp_path_factory):
    """vllm-neuron's default build: on-device sampling."""
    with vllm_serve(scripted, tmp_path_factory.mktemp("log") / "serve.log", MAX_LEN, BUCKETS, seqs=2,
                    extra=PARSERS) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def host_server(scripted, tmp_path_factory):
    """A build that samples on the host (``compile --for-vllm --structured-outputs``' override)."""
    from minimax_m3.neuron.vllm.structured import HOST_SAMPLING

    with vllm_serve(scripted, tmp_path_factory.mktemp("log") / "serve.log", MAX_LEN, {**BUCKETS, **HOST_SAMPLING},
                    seqs=2, extra=PARSERS + NO_WHITESPACE) as port:
        yield f"http://127.0.0.1:{port}/v1"


def _chat(url, stream=False, mode="enabled", tools=True, **kw):
    """(reasoning, content, [(name, args)], finish_reason) of a chat completion, streamed or not."""
    body = {"model": "m3-tiny", "messages": USER, "max_tokens": 64, "temperature": 0.0,
            "chat_template_kwargs": {"thinking_mode": mode}, **({"tools": [WEATHER_TOOL]} if tools else {}), **kw}
    return chat_turn(url, body, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("mode", ["enabled", "disabled", "adaptive"])
def test_a_chat_with_tools_returns_reasoning_content_and_tool_calls(server, mode, stream):
    reasoning, answer = REPLY[mode]
    assert _chat(server, stream, mode) == (reasoning, answer, [CALL_ARGS], "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_tool_call_cut_by_max_tokens_returns_cleanly_as_content(server, stream):
    # thinking (the thought, </mm:think>), the answer, then 5 of the call's 12 pieces
    got = _chat(server, stream, "enabled", max_tokens=2 + 1 + 5)
    assert got[0] == THOUGHT and got[2:] == ([], "length")
    assert got[1].startswith(ANSWER) and CALL.startswith(got[1][len(ANSWER):]) and len(got[1]) > len(ANSWER)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_without_tools_the_reasoning_is_still_apart(server, stream):
    reasoning, content, calls, finish = _chat(server, stream, "enabled", tools=False)
    assert (reasoning, calls, finish) == (THOUGHT, [], "stop")
    assert content.startswith(ANSWER)  # the call's text is content when no tools were offered


@pytest.mark.parametrize("ask", [
    {"response_format": JSON_SCHEMA},
    {"response_format": {"type": "json_object"}},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
], ids=["json_schema", "json_object", "required", "named"])
def test_structured_outputs_an_on_device_build_cannot_honour_are_refused_and_serving_goes_on(server, ask):
    status, body = post_error(f"{server}/chat/completions", {
        "model": "m3-tiny", "messages": USER, "max_tokens": 8, "tools": [WEATHER_TOOL], **ask})
    assert status == 400 and "samples on device" in body and "compile --for-vllm --structured-outputs" in body, body
    assert _chat(server, False, "disabled") == (None, ANSWER, [CALL_ARGS], "tool_calls")


@pytest.mark.parametrize("ask,want", [
    ({"chat_template_kwargs": {"thinking_mode": "often"}},
     "thinking_mode must be enabled, disabled or adaptive, got often"),  # M3's template, through vLLM's 400
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),  # vLLM's request schema
], ids=["thinking_mode", "nameless_tool"])
def test_bad_chat_input_is_one_clear_error_and_serving_goes_on(server, ask, want):
    status, body = post_error(f"{server}/chat/completions", {"model": "m3-tiny", "messages": USER, "max_tokens": 8,
                                                             **ask})
    assert status == 400 and want in body and "Traceback" not in body, body
    assert _chat(server, False, "disabled") == (None, ANSWER, [CALL_ARGS], "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("mode", ["disabled", "enabled"])
def test_a_host_sampling_build_returns_json_that_holds_to_the_schema(host_server, mode, stream):
    """Unconstrained, the model writes its answer and a tool call (checked first); with a JSON schema the answer
    is JSON of the schema; with thinking on, the thinking stays unconstrained and apart."""
    assert _chat(host_server, stream, mode, tools=False)[1].startswith(ANSWER)
    reasoning, content, calls, finish = _chat(host_server, stream, mode, tools=False, response_format=JSON_SCHEMA)
    assert (reasoning, calls, finish) == (REPLY[mode][0], [], "stop")
    value = json.loads(content)
    assert set(value) == {"unit"} and value["unit"] in ("Celsius", "Fahrenheit"), content
