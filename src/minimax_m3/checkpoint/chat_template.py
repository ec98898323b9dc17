"""MiniMax-M3's chat format as a jinja chat template, for synthetic checkpoints (``chat_template.jinja``).

Written here from what the release's ``chat_template.jinja`` (HF ``MiniMaxAI/MiniMax-M3``) renders, as read in
modelscope ms-swift ``swift/template/templates/minimax.py`` (the fixed system block, its thinking instructions and
the generation-prompt endings; "Reference: tokenizer_config.jinja shipped with MiniMax/MiniMax-M3") and
``swift/agent_template/minimax_m3.py`` at fd5711f (the tools section, the ``to_xml`` rendering of call arguments,
tool responses). Not the release file itself: where those sources are silent
(the newline between an answer and its calls, reasoning kept only after the last user turn) the choice is ours and
marked in the template. The rendering is graded in test/unit/test_chat_template.py.

Turns: ``]~!b[]~b]system`` (identity and thinking instructions; ``thinking_mode`` = enabled | disabled | adaptive,
default adaptive), ``]~b]developer`` (the caller's first system/developer message, else "You are a helpful
assistant.", then the tools), ``]~b]user``, ``]~b]ai``, ``]~b]tool`` (consecutive tool results in one turn, each as
``<response>...</response>``); each ends ``[e~[`` and a newline. The generation prompt ends ``]~b]ai\\n<mm:think>``
(enabled), ``]~b]ai\\n</mm:think>`` (disabled) or ``]~b]ai\\n`` (adaptive).

``read_chat`` / ``read_tools`` / ``chat_prompt_ids``: chat input for ``minimax-m3 generate`` (``--messages``,
``--tools``, ``--thinking-mode``), rendered through the tokenizer's own template; bad input is one ``ChatError``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import M3Error

# Single tokens in M3's vocabulary (the toy tokenizer gives each one id): beginning of document, role start, end of
# turn, the tool-call namespace, thinking, media.
SPECIAL_TOKENS = ("]~!b[", "]~b]", "[e~[", "]<]minimax[>[", "<mm:think>", "</mm:think>", "]<]image[>[", "]<]video[>[")
# Of those, the markers the reply's parsers read in the decoded text (vLLM's minimax_m3 reasoning parser works on text
# and its docstring says the M3 tokenizer has them as "complete vocabulary tokens"): single ids that are not special,
# so a server that skips special tokens (vLLM's default without tools) keeps them.
TEXT_MARKERS = ("]<]minimax[>[", "<mm:think>", "</mm:think>")
THINKING_MODES = ("enabled", "disabled", "adaptive")
END_OF_TURN = "[e~["
ROLES = ("system", "developer", "user", "assistant", "ai", "tool")
_SHAPE = ('a JSON list of {"role": ..., "content": ...} objects, or an object {"messages": [...], "tools": [...]} '
          "(a chat-completions request body)")


class ChatError(M3Error, ValueError):
    """Chat input that cannot be rendered: an unreadable or malformed messages/tools file, a checkpoint without a
    chat template, or messages its template refuses. Each problem names the fix."""


def _read_json(path, option: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ChatError(f"{option} {path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        shape = _SHAPE if option == "--messages" else "a JSON list of tools"
        raise ChatError(f"{option} {path}: not valid JSON ({e}); write {shape}") from None


def _tool_call_problems(i: int, calls) -> list[str]:
    if not isinstance(calls, list):
        return [f"message {i}: tool_calls must be a list"]
    out = []
    for j, call in enumerate(calls):
        f = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            out.append(f'message {i}, tool call {j}: give {{"function": {{"name": ..., "arguments": {{...}}}}}}')
            continue
        if isinstance(f.get("arguments"), str):  # the OpenAI wire form: a JSON string, parsed as vLLM does
            try:
                f["arguments"] = json.loads(f["arguments"])
            except json.JSONDecodeError as e:
                out.append(f"message {i}, tool call {j} ({f['name']}): arguments are not valid JSON ({e})")
                continue
        if not isinstance(f.get("arguments", {}), (dict, type(None))):
            out.append(f"message {i}, tool call {j} ({f['name']}): arguments must be a JSON object")
    return out


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as the template takes them (tool-call arguments given as JSON strings parsed), or one
    ``ChatError`` listing every problem."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: expected {_SHAPE}")
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            problems.append(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
            continue
        if not isinstance(m.get("content"), (str, list, type(None))):
            problems.append(f"message {i} ({m['role']}): content must be a string or a list of parts")
        if "tool_calls" in m:
            problems += _tool_call_problems(i, m["tool_calls"])
    if problems:
        raise ChatError(problems, heading=f"{where}: {len(problems)} problem(s) in the chat messages:")
    return messages


def read_chat(path) -> tuple[list[dict], list | None]:
    """``--messages FILE.json``: (messages, tools or None)."""
    data = _read_json(path, "--messages")
    if isinstance(data, dict) and "messages" in data:
        return check_messages(data["messages"], f"--messages {path}"), check_tools(data.get("tools"), path)
    return check_messages(data, f"--messages {path}"), None


def check_tools(tools, where) -> list | None:
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function", t), dict) and "name" in t.get("function", t)
        for t in tools)
    if not ok:
        raise ChatError(f'{where}: tools must be a JSON list of {{"type": "function", "function": {{"name": ..., '
                        '"description": ..., "parameters": {...}}} objects')
    return tools


def read_tools(path) -> list:
    """``--tools FILE.json``: a list of tools (OpenAI function format, or the bare function objects)."""
    return check_tools(_read_json(path, "--tools"), f"--tools {path}")


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list | None = None, thinking_mode: str | None = None,
                    where: str = "the tokenizer") -> list[int]:
    """The prompt ids of ``messages`` (and ``tools``) through the tokenizer's own chat template, with the generation
    prompt; ``thinking_mode`` is passed to the template when given (M3's default: adaptive)."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"{where} has no chat template (no chat_template.jinja, no chat_template in "
                        "tokenizer_config.json): put the model's chat_template.jinja beside its tokenizer files, or "
                        "give raw text with --prompt")
    kw = {} if thinking_mode is None else {"thinking_mode": thinking_mode}
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    except (TemplateError, TypeError, ValueError) as e:
        raise ChatError(f"{where}: the chat template cannot render these messages: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


M3_CHAT_TEMPLATE = r"""{#- MiniMax-M3 chat format; see minimax_m3/checkpoint/chat_template.py for the sources. -#}
{%- macro to_xml(v) -%}
{#- A call argument: objects as one tag per key, lists as <item> tags, booleans as JSON, None left out. -#}
{%- if v is mapping -%}
{%- for k, x in v.items() if x is not none -%}
{{- ']<]minimax[>[<' ~ k ~ '>' ~ to_xml(x) ~ ']<]minimax[>[</' ~ k ~ '>' -}}
{%- endfor -%}
{%- elif v is iterable and v is not string -%}
{%- for x in v -%}{{- ']<]minimax[>[<item>' ~ to_xml(x) ~ ']<]minimax[>[</item>' -}}{%- endfor -%}
{%- elif v is boolean -%}{{- v | tojson -}}
{%- elif v is not none -%}{{- v -}}
{%- endif -%}
{%- endmacro -%}
{%- macro text(c) -%}
{%- if c is string -%}{{- c -}}
{%- elif c is iterable and c is not mapping -%}
{%- for p in c -%}
{%- if p.type == 'text' -%}{{- p.text -}}
{%- elif p.type in ('image', 'image_url') -%}{{- ']<]image[>[' -}}
{%- elif p.type in ('video', 'video_url') -%}{{- ']<]video[>[' -}}
{%- endif -%}
{%- endfor -%}
{%- elif c is not none -%}{{- c -}}
{%- endif -%}
{%- endmacro -%}
{%- set mode = thinking_mode if thinking_mode is defined and thinking_mode is not none else 'adaptive' -%}
{%- set mode_text = {
    'enabled': 'Current thinking mode: enabled. You MUST think step by step before every response, including after '
               ~ 'receiving function/tool results.',
    'disabled': 'Current thinking mode: disabled. Do not output any thinking process.',
    'adaptive': 'Current thinking mode: adaptive. You are encouraged to think for complex decision-making, multi-step '
                ~ 'reasoning, or when analyzing function/tool results.'} -%}
{%- if mode not in mode_text -%}
{{- raise_exception('thinking_mode must be enabled, disabled or adaptive, got ' ~ mode) -}}
{%- endif -%}
{{- ']~!b[]~b]system\nYour model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. '
    ~ 'Founded in early 2022, MiniMax is a global AI foundation model company committed to advancing the frontiers '
    ~ 'of AI towards AGI.\n\n<thinking_instructions>\nYou have a thinking capability that allows you to reason step '
    ~ 'by step before responding. When thinking is enabled, wrap your reasoning in <mm:think></mm:think> tags before '
    ~ 'your response. When thinking is disabled, begin your response directly after the </mm:think> prefix. When '
    ~ 'thinking is adaptive, decide on your own whether to think for the current turn.\n' ~ mode_text[mode]
    ~ '\n</thinking_instructions>[e~[\n' -}}
{%- if messages and messages[0].role in ('system', 'developer') -%}
{%- set developer = text(messages[0].content) -%}{%- set turns = messages[1:] -%}
{%- else -%}
{%- set developer = 'You are a helpful assistant.' -%}{%- set turns = messages -%}
{%- endif -%}
{{- ']~b]developer\n' ~ developer -}}
{%- if tools -%}
{{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\n'
    ~ 'Here are the tools available in JSONSchema format:\n\n<tools>\n' -}}
{%- for t in tools -%}
{{- '<tool>' ~ ((t.function if t.function is defined else t) | tojson) ~ '</tool>\n' -}}
{%- endfor -%}
{%- set ns_tag = ']<]minimax[>[' -%}
{{- '</tools>\n\nTo call tools, wrap all invocations in a single ' ~ ns_tag ~ '<tool_call>' ~ ns_tag ~ '</tool_call> '
    ~ 'block. Parameter values containing nested objects or arrays are recursively expanded into XML elements. '
    ~ 'Example:\n\n' ~ ns_tag ~ '<tool_call>\n' ~ ns_tag ~ '<invoke name="tool-name-1">' ~ ns_tag ~ '<param-1>value-1'
    ~ ns_tag ~ '</param-1>' ~ ns_tag ~ '<param-2>' ~ ns_tag ~ '<item>' ~ ns_tag ~ '<key-a>val-a' ~ ns_tag ~ '</key-a>'
    ~ ns_tag ~ '<key-b>val-b' ~ ns_tag ~ '</key-b>' ~ ns_tag ~ '</item>' ~ ns_tag ~ '</param-2>' ~ ns_tag
    ~ '</invoke>\n' ~ ns_tag ~ '<invoke name="tool-name-2">' ~ ns_tag ~ '<param-1>value-1' ~ ns_tag ~ '</param-1>'
    ~ ns_tag ~ '</invoke>\n' ~ ns_tag ~ '</tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in turns -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in turns -%}
{%- if m.role == 'user' -%}
{{- ']~b]user\n' ~ text(m.content) ~ '[e~[\n' -}}
{%- elif m.role in ('system', 'developer') -%}
{{- ']~b]developer\n' ~ text(m.content) ~ '[e~[\n' -}}
{%- elif m.role == 'tool' -%}
{{- (']~b]tool\n' if loop.first or turns[loop.index0 - 1].role != 'tool' else '\n')
    ~ '<response>' ~ text(m.content) ~ '</response>' -}}
{%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '[e~[\n' -}}{%- endif -%}
{%- elif m.role in ('assistant', 'ai') -%}
{%- set content = text(m.content) -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</mm:think>' in content -%}
{%- set reasoning = reasoning or content.split('</mm:think>')[0].split('<mm:think>')[-1] -%}
{%- set content = content.split('</mm:think>')[-1] -%}
{%- endif -%}
{#- Ours: the reasoning of the turns after the last user message is kept; earlier turns show an empty block. -#}
{{- ']~b]ai\n' ~ ('<mm:think>' ~ reasoning ~ '</mm:think>' if reasoning and loop.index0 > ns.last_user
                  else '</mm:think>') ~ content -}}
{%- if m.tool_calls -%}
{#- Ours: a newline between an answer and its calls. -#}
{{- ('\n' if content else '') ~ ']<]minimax[>[<tool_call>\n' -}}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{%- if f.arguments is string -%}
{{- raise_exception('tool call ' ~ f.name ~ ': arguments must be a JSON object, not a string (parse it first)') -}}
{%- endif -%}
{{- ']<]minimax[>[<invoke name="' ~ f.name ~ '">' ~ to_xml(f.arguments) ~ ']<]minimax[>[</invoke>\n' -}}
{%- endfor -%}
{{- ']<]minimax[>[</tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- else -%}
{{- raise_exception('unknown role ' ~ m.role ~ ': use system, developer, user, assistant (or ai) or tool') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- ']~b]ai\n' ~ {'enabled': '<mm:think>', 'disabled': '</mm:think>', 'adaptive': ''}[mode] -}}
{%- endif -%}
"""
