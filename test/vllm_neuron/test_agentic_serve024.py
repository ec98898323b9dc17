"""MiniMax-M3's vLLM Neuron model served to agents on vLLM 0.24 (the stack of Neuron >= 2.34), end to end: ``vllm
serve`` on the harness platform with vLLM's own ``minimax_m3`` tool-call and reasoning parsers, M3's chat template,
HTTP; structured outputs applied as the plugin's runner applies them: with host sampling vLLM's grammar on the logits
the model returns; with on-device sampling (the plugin's default) the grammar rows passed into the forward as its
``logit_mask`` (the runner's ``_get_grammar_bitmask``), the model drawing within them.

Oracle: the scripted checkpoint (``test/support/scripted.py``): every token predicts a fixed successor, so the
greedy reply is the script written there by hand — thinking, answer, tool call. The same file's tests on vLLM 0.13
and vllm-neuron 0.4.1 are ``test/vllm/test_agentic_serve.py``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test_vllm_neuron_offdevice.sh builds it)")
pytest.importorskip("m3_vneuron_harness", reason="the harness plugin is not installed (test/support/vllm_neuron)")

from test.support.openai_server import chat_turn, free_port, serving  # noqa: E402
from test.support.scripted import ANSWER, CALL_ARGS, REPLY, WEATHER_TOOL  # noqa: E402

MODELS = "minimax_m3.vllm_neuron.plugin:models"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
UNIT = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["Celsius", "Fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["host", "on-device"])
def server(tmp_path_factory, request):
    from test.support.scripted import write_scripted
    from test.vllm_neuron.test_harness import REPO

    path, _ = write_scripted(tmp_path_factory.mktemp("scripted") / "m3")
    port = free_port()
    env = dict(os.environ, M3_VNEURON_HARNESS="1", VLLM_PLUGINS="m3_vneuron_harness", M3_VNEURON_MODELS=MODELS,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(path), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--block-size", "16", "--max-model-len", "2048", "--max-num-seqs", "2",
           "--max-num-batched-tokens", "512", "--served-model-name", "m3-tiny", "--num-gpu-blocks-override", "300",
           "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3",
           # a scripted model has no preference among a grammar's tokens: whitespace could otherwise run forever
           "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    if request.param == "on-device":
        cmd += ["--additional-config", json.dumps({"neuron_config": {"on_device_sampling_config": {},
                                                                     "enable_structured_outputs": True}})]
    with serving(cmd, port, env, tmp_path_factory.mktemp("log") / "serve.log", cwd=REPO):
        yield f"http://127.0.0.1:{port}/v1"


def _chat(url, stream, mode, tools=True, **kw):
    body = {"model": "m3-tiny", "messages": USER, "max_tokens": 64, "temperature": 0.0,
            "chat_template_kwargs": {"thinking_mode": mode}, **({"tools": [WEATHER_TOOL]} if tools else {}), **kw}
    return chat_turn(url, body, stream)


@pytest.mark.parametrize("mode,stream", [("enabled", False), ("enabled", True), ("disabled", False),
                                         ("adaptive", False)])
def test_a_chat_with_tools_returns_reasoning_and_tool_calls(server, mode, stream):
    reasoning, answer = REPLY[mode]
    assert _chat(server, stream, mode) == (reasoning, answer, [CALL_ARGS], "tool_calls")


def test_a_json_schema_request_returns_json_of_the_schema(server):
    """Thinking disabled (vLLM 0.24's own reasoning parser reads any ``</mm:think>`` in the prompt, M3's system text
    included, as the end of thinking; ours reads the last turn: test/vllm/test_agentic_serve.py covers enabled)."""
    assert _chat(server, False, "disabled", tools=False)[1].startswith(ANSWER)  # unconstrained: answer and call
    schema = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}
    reasoning, content, calls, finish = _chat(server, False, "disabled", tools=False, response_format=schema)
    value = json.loads(content)
    assert (reasoning, calls, finish) == (None, [], "stop") and set(value) == {"unit"}, content
    assert value["unit"] in ("Celsius", "Fahrenheit")
