"""MiniMax-M3's tool-call and reasoning parsers on vLLM's parser interfaces, registered as ``minimax_m3``
(``vllm serve ... --enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser minimax_m3``).

vLLM 0.13 (what vllm-neuron 0.4.1 runs) has no M3 parser; vLLM >= 0.24 has both (PR #45381), its tool parser in
the Rust extension ``vllm._rust_tool_parser``, which some builds lack. :func:`register_parsers` (called by this
package's vLLM general plugin, in every vLLM process) registers ours where vLLM has none, and our tool parser
where vLLM's cannot load; vLLM's own are kept otherwise.

The parsing is ``checkpoint/chat_parse.py``'s (no vLLM there); these classes only translate vLLM's calls: the
request's tools and ``chat_template_kwargs["thinking_mode"]`` in, vLLM's protocol objects out. Written against vLLM
0.13's interfaces (``vllm.tool_parsers``, ``vllm.reasoning``), tolerant of 0.24's (the tool parser also takes
``tools``; the protocol objects moved). A parser error never fails the response: the text is returned as content.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from vllm.entrypoints.chat_utils import make_tool_call_id
from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.tool_parsers import ToolParser, ToolParserManager

try:  # vLLM 0.13
    from vllm.entrypoints.openai.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                  ExtractedToolCallInformation, FunctionCall, ToolCall)
except ImportError:  # vLLM >= 0.2x: the protocol objects moved
    from vllm.entrypoints.openai.engine.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                         ExtractedToolCallInformation, FunctionCall, ToolCall)

from ...checkpoint.chat_parse import (MarkerIds, ThinkingSplitter, ToolCallStream, output_reasoning_ended,
                                      parse_tool_calls, reasoning_ended_in_ids, split_thinking)

log = logging.getLogger(__name__)

NAME = "minimax_m3"
END_OF_TURN = "[e~["
# vLLM >= 0.2x parses required / named tool choices with the tool parser when it says so (as its Rust M3 parser
# does); vLLM 0.13 always parses them as JSON under its grammar, which ToolParser.adjust_request installs.
_NATIVE_REQUIRED = hasattr(ToolParser, "supports_required_and_named")


def _tool_pairs(tools) -> list[tuple[str, dict]]:
    """(name, parameters) of the request's tools: chat-completions ``{"function": {...}}`` objects, Responses
    function tools, or dicts of either shape."""
    out = []
    for t in tools or ():
        f = t.get("function", t) if isinstance(t, dict) else getattr(t, "function", t)
        name = f.get("name") if isinstance(f, dict) else getattr(f, "name", None)
        params = f.get("parameters") if isinstance(f, dict) else getattr(f, "parameters", None)
        if isinstance(name, str):
            out.append((name, params if isinstance(params, dict) else {}))
    return out


def _eos_ids(tokenizer, vocab: dict) -> set[int]:
    return {i for i in (getattr(tokenizer, "eos_token_id", None), vocab.get(END_OF_TURN)) if isinstance(i, int)}


class M3ToolParser(ToolParser):
    """``--tool-call-parser minimax_m3``: calls are emitted whole, each when its ``</invoke>`` arrives (as vLLM
    >= 0.24's); the streamed tail of a block that cannot parse becomes content, at once when malformed, at the end
    of the reply when cut off (seen from an end-of-turn token, or ``max_tokens`` output tokens)."""

    supports_required_and_named = False  # vLLM >= 0.2x: M3's own format for required / named tool choices

    def __init__(self, tokenizer, tools=None):
        if _NATIVE_REQUIRED:
            super().__init__(tokenizer, tools)
        else:
            super().__init__(tokenizer)
        self.eos_ids = _eos_ids(tokenizer, self.vocab)
        self.stream: ToolCallStream | None = None

    def tools_of(self, request) -> list[tuple[str, dict]]:
        return _tool_pairs(getattr(request, "tools", None) or getattr(self, "tools", None))

    def adjust_request(self, request):
        if not _NATIVE_REQUIRED:
            request = super().adjust_request(request)
        if getattr(request, "tools", None) and getattr(request, "tool_choice", None) != "none" \
                and hasattr(request, "skip_special_tokens"):
            request.skip_special_tokens = False  # some tokenizers mark M3's markers special: keep them in the text
        return request

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        try:
            content, calls = parse_tool_calls(model_output, self.tools_of(request))
        except Exception:  # a parser bug must not fail the response: the reply stays text
            log.exception("minimax_m3 tool parser: the reply is returned as content")
            content, calls = model_output, []
        self.prev_tool_call_arr = [{"name": c.name, "arguments": c.arguments} for c in calls]
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCallInformation(tools_called=True, content=content, tool_calls=[
            ToolCall(id=make_tool_call_id(), type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls])

    def reply_ends(self, current_token_ids, delta_token_ids, request) -> bool:
        if any(t in self.eos_ids for t in delta_token_ids or ()):
            return True
        fields = getattr(request, "__dict__", {})  # not through the deprecated max_tokens attribute
        limit = fields.get("max_completion_tokens") or fields.get("max_tokens")
        return isinstance(limit, int) and len(current_token_ids or ()) >= limit

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request) -> DeltaMessage | None:
        try:
            if not previous_text or self.stream is None:  # a new reply
                self.stream = ToolCallStream(self.tools_of(request))
                self.prev_tool_call_arr, self.streamed_args_for_tool = [], []
                self.current_tool_id, self.current_tool_name_sent = -1, False
            content, calls = self.stream.feed(delta_text)
            if self.reply_ends(current_token_ids, delta_token_ids, request):
                more, last = self.stream.finish()
                content, calls = content + more, calls + last
        except Exception:
            log.exception("minimax_m3 tool parser: this piece of the reply is returned as content")
            self.stream = ToolCallStream()
            self.stream.mode = "failed"
            content, calls = delta_text, []
        return self.delta(content, calls)

    def delta(self, content: str, calls) -> DeltaMessage | None:
        deltas = []
        for c in calls:
            index = len(self.prev_tool_call_arr)
            self.prev_tool_call_arr.append({"name": c.name, "arguments": c.arguments})
            self.streamed_args_for_tool.append(c.arguments)
            self.current_tool_id, self.current_tool_name_sent = index, True
            # the name first, the arguments in a second entry: vLLM 0.13 rewrites a final chunk whose first entry
            # carries arguments (its check for unstreamed arguments), which would drop the name
            deltas += [DeltaToolCall(index=index, id=make_tool_call_id(), type="function",
                                     function=DeltaFunctionCall(name=c.name)),
                       DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=c.arguments))]
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)


class M3ReasoningParser(ReasoningParser):
    """``--reasoning-parser minimax_m3``: ``<mm:think>`` ... ``</mm:think>`` as reasoning, by
    ``chat_template_kwargs["thinking_mode"]`` (``chat_parse.ThinkingSplitter``: enabled starts inside the block).
    Token-id questions (has the reasoning ended: vLLM's streaming switch to the tool parser, its structured-output
    grammar) are read from the prompt's own last turn, then from this reply's stream."""

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.thinking_mode = (kwargs.get("chat_template_kwargs") or {}).get("thinking_mode")
        self.splitter = ThinkingSplitter(self.thinking_mode)
        self.pending = None  # the answer text of the piece that closed the block, sent with the next piece
        self.reply_ids: Sequence[int] = ()  # the streamed reply's token ids so far
        self.marker_ids = MarkerIds.of(self.vocab)
        self.eos_ids = _eos_ids(tokenizer, self.vocab)

    def decode_ids(self, ids) -> str:
        return self.model_tokenizer.decode(list(ids), skip_special_tokens=False)

    def is_reasoning_end(self, input_ids) -> bool:
        ended = reasoning_ended_in_ids(input_ids, self.marker_ids, self.decode_ids)
        if ended is not None:  # a prompt (with output): its last turn decides
            return ended
        if self.splitter.fed:  # this reply's output, streamed through this parser
            return self.splitter.reasoning_ended and self.pending is None
        return output_reasoning_ended(input_ids, self.marker_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.splitter.fed:
            # streaming: vLLM 0.13 hands these ids to the tool parser as the reply's ids so far (and uses them for
            # nothing else); the whole reply's, so that it can count them against max_tokens and flush a call cut off
            return list(self.reply_ids)
        ids = list(input_ids)
        m = self.marker_ids
        if m.close is not None and m.close in ids:
            return ids[len(ids) - ids[::-1].index(m.close):]
        if m.ns is not None and m.ns in ids:
            return ids[ids.index(m.ns):]
        return [] if self.splitter.mode == "enabled" or m.open in ids else ids

    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        return split_thinking(model_output, self.thinking_mode)

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        if not previous_text and self.splitter.fed:  # a new reply on a reused parser
            self.splitter, self.pending = ThinkingSplitter(self.thinking_mode), None
        self.reply_ids = current_token_ids  # vLLM builds a new list each step: kept, not copied
        reasoning, content = self.splitter.feed(delta_text)
        content, self.pending = (self.pending or "") + content, None
        final = any(t in self.eos_ids for t in delta_token_ids or ())
        if final:
            more_r, more_c = self.splitter.finish()
            reasoning, content = reasoning + more_r, content + more_c
        elif reasoning and content:
            # the block ends inside this piece: vLLM 0.13 hands the piece's answer to the tool parser and drops the
            # piece's reasoning then, so the reasoning goes now and the answer with the next piece
            self.pending = content
            return DeltaMessage(reasoning=reasoning)
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)


def _vllm_tool_parser_works() -> bool:
    """vLLM has its own ``minimax_m3`` tool parser and the Rust extension it runs on imports."""
    mine = ToolParserManager.tool_parsers.get(NAME) is M3ToolParser
    if mine or NAME not in ToolParserManager.list_registered():
        return False
    try:
        importlib.import_module("vllm._rust_tool_parser")
    except ImportError:
        return False
    return True


def register_parsers() -> dict[str, str]:
    """Registers our parsers under ``minimax_m3`` where vLLM has none that works; returns, per kind (``tool``,
    ``reasoning``), whose parser serves the name: ``"minimax_m3"`` (ours) or ``"vllm"``."""
    out = {}
    if _vllm_tool_parser_works():
        out["tool"] = "vllm"
    else:
        ToolParserManager.register_module(NAME, force=True, module=M3ToolParser)
        out["tool"] = "minimax_m3"
    theirs = ReasoningParserManager.reasoning_parsers.get(NAME, M3ReasoningParser) is not M3ReasoningParser \
        or NAME in ReasoningParserManager.lazy_parsers
    if theirs:
        out["reasoning"] = "vllm"
    else:
        ReasoningParserManager.register_module(NAME, force=True, module=M3ReasoningParser)
        out["reasoning"] = "minimax_m3"
    log.debug("minimax_m3 parsers: %s", out)
    return out
