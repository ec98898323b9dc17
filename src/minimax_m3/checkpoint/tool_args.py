"""A MiniMax-M3 tool call's arguments: the tag tree the model writes (``chat_parse``) as JSON, typed by the tool's
JSON schema where the request gives one.

M3 writes each argument as a tag named after the parameter; objects nest as tags, list elements as ``<item>`` tags
(``chat_template.py``'s ``to_xml``). The text of a tag says nothing about its type (``3`` may be a number or a
string), so the tool's schema decides, with the rules of vLLM >= 0.24's ``minimax_m3`` parser (its Rust crate's
``parameters.rs``, read at vLLM PR #45381; behaviour checked against ``vllm._rust_tool_parser`` in
``test/vllm_neuron/test_m3_parsers_vllm024.py``):

* the text ``null`` (any case) is JSON null, whatever the schema;
* string: the text as written (no trimming); integer: a 64-bit integer (``+7``, ``007``), else the text; number: a
  JSON number, else a 64-bit integer, else a finite float, else the text; boolean: ``true``/``1``, ``false``/``0``
  (trimmed, any case), else the text; object or array: a tag tree becomes an object (by ``properties``, else
  ``additionalProperties``) or a list (every child tag is an element, whatever its name), empty text becomes ``{}``
  or ``[]``, other text is read as JSON (else kept as text); ``anyOf``/``oneOf`` and type lists: the first type that
  converts;
* no schema for a parameter (an unknown tool or parameter): tag trees become objects, text stays text;
* a repeated child tag collects its values in a list; text between child tags is kept under ``$text`` (``$$text``
  when a child has that name). A repeated top-level parameter keeps its last value.

Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

MIXED_TEXT = "$text"
_I64 = (-(1 << 63), (1 << 63) - 1)
_JSON_WS = " \t\n\r"
_JSON_NUMBER = re.compile(r"(-?)(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Element:
    """One tag: its name and its value, the text it holds (``str``) or its child tags (a tuple of ``Element``)."""

    name: str
    value: str | tuple


@dataclass(frozen=True)
class Kind:
    """A parameter's normalized JSON-schema type: ``string``, ``integer``, ``number``, ``boolean``, ``null``,
    ``object`` (``properties``, ``extra``: additionalProperties), ``array`` (``items``) or ``oneof`` (``options``)."""

    kind: str
    properties: dict | None = None
    extra: Kind | None = None
    items: Kind | None = None
    options: tuple = ()


_NAMES = {"string": "string", "str": "string", "text": "string", "varchar": "string", "char": "string",
          "enum": "string", "integer": "integer", "int": "integer", "number": "number", "float": "number",
          "double": "number", "boolean": "boolean", "bool": "boolean", "binary": "boolean", "object": "object",
          "dict": "object", "map": "object", "array": "array", "arr": "array", "list": "array", "sequence": "array",
          "null": "null"}
_PREFIXES = (("int", "integer"), ("uint", "integer"), ("long", "integer"), ("short", "integer"),
             ("unsigned", "integer"), ("num", "number"), ("float", "number"), ("dict", "object"), ("list", "array"))


def _named(name: str, schema: dict) -> Kind | None:
    name = name.strip().lower()
    kind = _NAMES.get(name) or next((k for p, k in _PREFIXES if name.startswith(p)), None)
    if kind == "object":
        return _object(schema)
    if kind == "array":
        return Kind("array", items=kind_of(schema.get("items")))
    return Kind(kind) if kind else None


def _object(schema: dict) -> Kind:
    props = schema.get("properties")
    props = {k: t for k, v in props.items() if (t := kind_of(v)) is not None} if isinstance(props, dict) else {}
    extra = schema.get("additionalProperties")
    return Kind("object", properties=props, extra=kind_of(extra) if isinstance(extra, dict) else None)


def _one_of(kinds: list) -> Kind:
    return kinds[0] if len(kinds) == 1 else Kind("oneof", options=tuple(kinds))


def kind_of(schema) -> Kind | None:
    """The normalized type of one property's JSON schema, or None when it says nothing usable."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        t = schema["type"]
        if isinstance(t, str):
            return _named(t, schema)
        if isinstance(t, list):
            kinds = [k for n in t if isinstance(n, str) and (k := _named(n, schema)) is not None]
            return _one_of(kinds) if kinds else None
        return None
    for key in ("anyOf", "oneOf"):
        if key in schema:
            subs = schema[key]
            kinds = [k for s in subs if (k := kind_of(s)) is not None] if isinstance(subs, list) else []
            return _one_of(kinds) if kinds else _object(schema)
    if "enum" in schema:
        return Kind("string")
    if "items" in schema:
        return Kind("array", items=kind_of(schema["items"]))
    if "properties" in schema or "additionalProperties" in schema:
        return _object(schema)
    return None


def tool_schemas(tools) -> dict[str, dict[str, Kind]]:
    """``{tool name: {parameter: Kind}}`` from the request's tools: OpenAI ``{"type": "function", "function":
    {...}}`` dicts, bare ``{"name", "parameters"}`` dicts, or ``(name, parameters)`` pairs."""
    out = {}
    for t in tools or ():
        if isinstance(t, tuple):
            name, params = t
        else:
            f = t.get("function", t) if isinstance(t, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                continue
            name, params = f["name"], f.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[name] = {k: kd for k, v in props.items() if (kd := kind_of(v)) is not None} \
            if isinstance(props, dict) else {}
    return out


def _serde_number(text: str):
    """A JSON number as serde_json reads one (integers beyond 64 bits and ``-0`` as floats), or None."""
    m = _JSON_NUMBER.fullmatch(text.strip(_JSON_WS))
    if not m:
        return None
    if m.group(3) is None and m.group(4) is None:
        n = int(m.group(0))
        if m.group(1) and n == 0:
            return -0.0
        if (n < 0 and n >= _I64[0]) or 0 <= n < (1 << 64):
            return n
        return float(n)
    f = float(m.group(0))
    return f if math.isfinite(f) else None


def _int(text: str):
    if _INT.fullmatch(text):
        n = int(text)
        if _I64[0] <= n <= _I64[1]:
            return n
    return None


def _number(text: str):
    for read in (_serde_number, _int):
        if (v := read(text)) is not None:
            return v
    if _FLOAT.fullmatch(text) and math.isfinite(f := float(text)):
        return f
    return None


def _bool(text: str):
    return {"true": True, "1": True, "false": False, "0": False}.get(text.strip().lower())


def _json(text: str):
    def big_int(s):
        n = int(s)
        return n if _I64[0] <= n < (1 << 64) else float(n)

    def finite(s):
        f = float(s)
        if not math.isfinite(f):
            raise ValueError(s)
        return f

    def refuse(s):
        raise ValueError(s)

    try:
        return True, json.loads(text, parse_int=big_int, parse_float=finite, parse_constant=refuse)
    except (ValueError, RecursionError):
        return False, None


_MISSING = object()


def _from_text(kind: Kind, text: str):
    k = kind.kind
    if k == "string":
        return text
    if k == "integer":
        v = _int(text)
    elif k == "number":
        v = _number(text)
    elif k == "boolean":
        v = _bool(text)
    elif k in ("object", "array"):
        if text == "":
            return {} if k == "object" else []
        ok, v = _json(text)
        return v if ok else _MISSING
    elif k == "oneof":
        return next((v for o in kind.options if (v := _from_text(o, text)) is not _MISSING), _MISSING)
    else:  # null: only the text null, read before any schema
        return _MISSING
    return _MISSING if v is None else v


def _from_elements(kind: Kind, elements: tuple):
    if kind.kind == "object":
        return _object_value(elements, kind.properties, kind.extra)
    if kind.kind == "array":
        return [convert(kind.items, e.value) for e in elements]
    if kind.kind == "oneof":
        return next((v for o in kind.options if (v := _from_elements(o, elements)) is not _MISSING), _MISSING)
    return _MISSING


def _object_value(elements: tuple, properties: dict | None, extra: Kind | None) -> dict:
    out: dict = {}
    for e in elements:
        v = convert((properties or {}).get(e.name, extra), e.value)
        if e.name not in out:
            out[e.name] = v
        elif isinstance(out[e.name], list):
            out[e.name].append(v)
        else:
            out[e.name] = [out[e.name], v]
    return out


def convert(kind: Kind | None, value: str | tuple):
    """One tag's value (text, or child tags) as JSON, by its type when known (see the module's rules)."""
    if isinstance(value, str) and len(value) == 4 and value.lower() == "null":
        return None
    if kind is not None:
        v = _from_text(kind, value) if isinstance(value, str) else _from_elements(kind, value)
        if v is not _MISSING:
            return v
    return value if isinstance(value, str) else _object_value(value, None, None)


def arguments_json(schema: dict[str, Kind], params: list[Element]) -> str:
    """One call's arguments as compact JSON text (non-ASCII kept), each parameter typed by ``schema``."""
    args = {p.name: convert(schema.get(p.name), p.value) for p in params}
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def with_mixed_text(children: list[Element], text: str) -> tuple:
    """A tag's children, plus its non-blank text between them under ``$text`` (``$`` added until unused)."""
    if text.strip():
        name = MIXED_TEXT
        while any(c.name == name for c in children):
            name = "$" + name
        children = [*children, Element(name, text)]
    return tuple(children)
