"""MiniMax-M3's reply, parsed: thinking apart from the answer, tool calls as JSON. The inverse of what
``chat_template.py`` renders for an assistant turn; whole replies and streamed text alike, with no vLLM (the vLLM
parsers in ``neuron/vllm/parsers.py`` are thin adapters over this module).

Thinking (:class:`ThinkingSplitter`): the reply's reasoning sits between ``<mm:think>`` and ``</mm:think>``. With
``thinking_mode`` ``enabled`` the generation prompt already opened the block, so the reply starts inside it; with
``disabled`` (the prompt closed it) and ``adaptive`` (the default) the reply starts outside, and only a ``<mm:think>``
at its very start (after blanks) opens one: a later ``<mm:think>``, or a ``</mm:think>`` after the answer began, is
answer text (a JSON answer that quotes the marker stays whole). Stray closers at the start of the reply or right
after a block are dropped, as is a redundant opener at the start of an enabled reply. A tool call starting inside
the block (``]<]minimax[>[<tool_call>``) ends it: the call belongs to the answer.

Tool calls (:class:`ToolCallStream`, :func:`parse_tool_calls`): one block ``]<]minimax[>[<tool_call>`` ...
``]<]minimax[>[</tool_call>`` holding ``]<]minimax[>[<invoke name="f">`` ... ``]<]minimax[>[</invoke>`` calls whose
parameters are tags (``tool_args.py`` types their values). As vLLM >= 0.24's ``minimax_m3`` parser: each call is
emitted whole once its ``</invoke>`` arrives; text before the block is content; text after it is dropped; ordinary
text inside an invoke, after its parameters, ends them. Beyond it: a block that cannot parse (malformed, or cut off
at the end of the reply) becomes content from where the committed calls end, the marker included when no call was
committed, and everything after it stays content; a whole reply whose block fails is all content, with no calls.
Streaming holds back only what could still be the start of a marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import M3Error
from .chat_template import THINKING_MODES
from .tool_args import Element, arguments_json, tool_schemas, with_mixed_text

NS = "]<]minimax[>["
THINK_OPEN, THINK_CLOSE = "<mm:think>", "</mm:think>"
TOOL_CALL_START, TOOL_CALL_END = NS + "<tool_call>", NS + "</tool_call>"
INVOKE_START, INVOKE_END = NS + "<invoke", NS + "</invoke>"
ELEMENT_START = NS + "<"
_WS = " \t\r\n"


def held_back(text: str, markers) -> int:
    """The length of the longest end of ``text`` that is the start (not the whole) of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(text), len(m) - 1), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


# ---- thinking ----------------------------------------------------------------------------------------------------

START, REASONING, CONTENT = "start", "reasoning", "content"


class ThinkingSplitter:
    """Splits a reply fed in pieces into (reasoning, content) pieces; :meth:`finish` flushes what was held back."""

    def __init__(self, thinking_mode: str | None = None):
        self.mode = thinking_mode if thinking_mode in THINKING_MODES else "adaptive"
        self.state = REASONING if self.mode == "enabled" else START
        self.fed = False
        self._buf = ""
        self._lead = self.state == REASONING  # at a block's start: a (redundant) opener is dropped
        self._closing = False  # right after a block (or a leading closer): repeated closers are dropped

    @property
    def reasoning_ended(self) -> bool:
        """The answer has begun (right after a closer, only once something other than another closer came)."""
        return self.state == CONTENT and not self._closing

    def feed(self, text: str) -> tuple[str, str]:
        self.fed = True
        self._buf += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        return (rest, "") if self.state == REASONING else ("", rest)

    def _step(self, reasoning: list, content: list) -> bool:
        buf = self._buf
        if self.state == START:
            s = buf.lstrip()
            for marker, state in ((THINK_OPEN, REASONING), (THINK_CLOSE, CONTENT)):
                if s.startswith(marker):
                    self._buf, self.state = s[len(marker):], state
                    self._lead = state == REASONING
                    self._closing = state == CONTENT
                    return True
            if not s or THINK_OPEN.startswith(s) or THINK_CLOSE.startswith(s):
                return False
            self.state = CONTENT
            return True
        if self.state == REASONING:
            if self._lead:
                s = buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._buf = s[len(THINK_OPEN):]
                    return True
                if not s or THINK_OPEN.startswith(s):
                    return False
                self._lead = False
            ends = [(i, m) for m in (THINK_CLOSE, TOOL_CALL_START) if (i := buf.find(m)) >= 0]
            if ends:
                i, m = min(ends)
                reasoning.append(buf[:i])
                self._buf = buf[i + len(THINK_CLOSE):] if m == THINK_CLOSE else buf[i:]
                self.state, self._closing = CONTENT, m == THINK_CLOSE
                return True
            k = held_back(buf, (THINK_CLOSE, TOOL_CALL_START))
            reasoning.append(buf[:len(buf) - k])
            self._buf = buf[len(buf) - k:]
            return False
        while self._closing:
            if self._buf.startswith(THINK_CLOSE):
                self._buf = self._buf[len(THINK_CLOSE):]
            elif not self._buf or THINK_CLOSE.startswith(self._buf):
                return False
            else:
                self._closing = False
        content.append(self._buf)
        self._buf = ""
        return False


def split_thinking(text: str, thinking_mode: str | None = None) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content); each None when empty."""
    s = ThinkingSplitter(thinking_mode)
    r, c = s.feed(text)
    r2, c2 = s.finish()
    return (r + r2) or None, (c + c2) or None


@dataclass(frozen=True)
class MarkerIds:
    """The token ids of a tokenizer's markers (None where its vocabulary lacks one): role start ``]~b]``,
    ``<mm:think>``, ``</mm:think>``, the namespace ``]<]minimax[>[``."""

    role: int | None
    open: int | None
    close: int | None
    ns: int | None

    @classmethod
    def of(cls, vocab: dict) -> MarkerIds:
        return cls(vocab.get("]~b]"), vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE), vocab.get(NS))


def reasoning_ended_in_ids(ids, m: MarkerIds, decode, window: int = 512) -> bool | None:
    """Whether the reasoning of the assistant turn that ``ids`` (a prompt, maybe with output) ends in has ended:
    read from the turn's own start (its last role marker), never from marker pairs earlier in the prompt (M3's
    system text quotes ``<mm:think></mm:think>``). The prompt's ending decides (``<mm:think>``: open,
    ``</mm:think>``: ended, neither: adaptive, open until the reply shows its first non-blank text or marker).
    None when no role marker is among the last ``window`` ids (output ids alone: the caller decides)."""
    tail = list(ids[-window:])
    if m.role is None or m.role not in tail:
        return None
    turn = tail[len(tail) - 1 - tail[::-1].index(m.role) + 1:]
    for i, t in enumerate(turn):
        if t == m.open:
            return any(u in (m.close, m.ns) for u in turn[i + 1:])
        if t in (m.close, m.ns):
            return True
    _role, newline, reply = decode(turn).partition("\n")
    return bool(newline and reply.strip())


def output_reasoning_ended(ids, m: MarkerIds, window: int = 512) -> bool:
    """Output ids alone (no turn start to read), from their last ``window`` ids: the nearest marker decides
    (``</mm:think>`` or a tool call: ended; ``<mm:think>``: not); none: not ended."""
    for t in reversed(list(ids[-window:])):
        if t in (m.close, m.ns):
            return True
        if t == m.open:
            return False
    return False


# ---- tool calls --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # compact JSON text


class Malformed(M3Error, ValueError):
    """A tool-call block that cannot parse (caught here: the block becomes content)."""


def _invoke_header(s: str):
    """``s`` starts with ``]<]minimax[>[<invoke``: (name, where its body starts), None while the header is
    incomplete, or :class:`Malformed` (the rules of vLLM's parser: blanks, ``name=``, a quoted or bare value)."""
    head = len(INVOKE_START)
    j = head
    while j < len(s) and s[j] in _WS:
        j += 1
    if j == len(s):
        return None
    if j == head:
        raise Malformed("no blank after <invoke")
    if not s.startswith("name=", j):
        if "name=".startswith(s[j:]):
            return None
        raise Malformed("<invoke without name=")
    k = j + len("name=")
    if k == len(s):
        return None
    if s[k] in "\"'":
        close = s.find(s[k], k + 2)
        if close >= 0:
            if close + 1 == len(s):
                return None
            if s[close + 1] != ">":
                raise Malformed("text after the quoted invoke name")
            return s[k + 1:close], close + 2
    gt = s.find(">", k + 1)
    return None if gt < 0 else (s[k:gt], gt + 1)


def _element(s: str, pos: int) -> tuple[Element, int]:
    start = pos + len(ELEMENT_START)
    end = s.find(">", start)
    if end <= start:
        raise Malformed("a tag without a name")
    name = s[start:end]
    if name.startswith("/") or not name.strip():
        raise Malformed(f"unexpected tag <{name}>")
    close, pos = f"{NS}</{name}>", end + 1
    text, children = [], []
    while True:
        i = s.find(NS, pos)
        if i < 0:
            raise Malformed(f"<{name}> is not closed")
        text.append(s[pos:i])
        if s.startswith(close, i):
            pos = i + len(close)
            break
        if not s.startswith(ELEMENT_START, i):
            raise Malformed(f"a stray namespace marker inside <{name}>")
        child, pos = _element(s, i)
        children.append(child)
    joined = "".join(text)
    return Element(name, with_mixed_text(children, joined) if children else joined), pos


def parse_parameters(body: str) -> list[Element]:
    """An invoke's body as its parameter tags; ordinary text after a parameter ends them (vLLM's tolerance)."""
    out, pos = [], 0
    while True:
        while pos < len(body) and body[pos] in _WS:
            pos += 1
        if pos == len(body) or not body.startswith(NS, pos):
            return out
        if not body.startswith(ELEMENT_START, pos):
            raise Malformed("a stray namespace marker between parameters")
        el, pos = _element(body, pos)
        out.append(el)


class ToolCallStream:
    """Content and tool calls of a reply fed in pieces: :meth:`feed` and :meth:`finish` return (content, the calls
    completed by this piece). ``tools``: the request's tools (see ``tool_args.tool_schemas``), for typed values."""

    def __init__(self, tools=None):
        self._schemas = tool_schemas(tools)
        self.mode = "text"  # text | block | done | failed
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._block_calls = 0
        self._scan = 0  # where the search for </invoke> resumes in _buf

    @property
    def failed(self) -> bool:
        return self.mode == "failed"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "failed":
            return text, []
        if self.mode == "done":
            return "", []
        self._buf += text
        content, new = [], []
        try:
            while self._step(content, new):
                pass
        except (Malformed, RecursionError):
            content.append(self._fail())
        return "".join(content), new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: a held-back partial marker is content; so is a block left open with more than blanks
        in it, or with no call committed."""
        rest, self._buf = self._buf, ""
        if self.mode == "text":
            return rest, []
        if self.mode == "block" and (rest.strip(_WS) or not self._block_calls):
            self._buf = rest
            return self._fail(), []
        return "", []

    def _fail(self) -> str:
        raw = (TOOL_CALL_START if not self._block_calls else "") + self._buf
        self._buf, self.mode = "", "failed"
        return raw

    def _step(self, content: list, new: list) -> bool:
        buf = self._buf
        if self.mode == "text":
            i = buf.find(TOOL_CALL_START)
            if i >= 0:
                content.append(buf[:i])
                self._buf, self.mode, self._block_calls, self._scan = buf[i + len(TOOL_CALL_START):], "block", 0, 0
                return True
            k = held_back(buf, (TOOL_CALL_START,))
            content.append(buf[:len(buf) - k])
            self._buf = buf[len(buf) - k:]
            return False
        if self.mode != "block":
            return False
        lead = len(buf) - len(s := buf.lstrip(_WS))
        if s.startswith(TOOL_CALL_END):
            if not self._block_calls:  # an empty block is not a call: it stays text, and so does what follows
                content.append(TOOL_CALL_START + buf[:lead + len(TOOL_CALL_END)])
                self._buf, self.mode = s[len(TOOL_CALL_END):], "text"
                return True
            self._buf, self.mode = "", "done"
            return False
        if s.startswith(INVOKE_START):
            header = _invoke_header(s)
            if header is None:
                return False
            name, body = header
            end = buf.find(INVOKE_END, max(lead + body, self._scan))
            if end < 0:
                self._scan = max(lead + body, len(buf) - len(INVOKE_END) + 1)
                return False
            params = parse_parameters(buf[lead + body:end])
            call = ToolCall(name.strip(), arguments_json(self._schemas.get(name.strip(), {}), params))
            self.calls.append(call)
            new.append(call)
            self._buf, self._block_calls, self._scan = buf[end + len(INVOKE_END):], self._block_calls + 1, 0
            return True
        if not s or TOOL_CALL_END.startswith(s) or INVOKE_START.startswith(s):
            return False
        raise Malformed("text between the calls of a tool-call block")


def parse_tool_calls(text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
    """A whole reply (its content, after any thinking) as (content, calls). No calls (none written, or a block that
    does not parse): the whole text is content."""
    s = ToolCallStream(tools)
    c1, _ = s.feed(text)
    c2, _ = s.finish()
    if s.failed or not s.calls:
        return text or None, []
    return (c1 + c2) or None, s.calls
