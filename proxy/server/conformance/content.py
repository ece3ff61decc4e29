"""Calls left in an answer's text: the syntaxes servers' tool parsers are meant to turn into `tool_calls`.

Each finder returns the calls it found (name, arguments as a dict) and the span of text they came from;
the checker reports them, a `repair` step turns them into proper calls.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from toolquake.bfcl.jsonscan import json_values, nested_spans
from toolquake.bfcl.pycall import dotted_name, expression_calls

#: text longer than this is not searched (a call left in the text is short)
MAX_TEXT = 20_000
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PY_START = re.compile(r"\[\s*+[A-Za-z_][\w.]*+\s*+\(")
#: characters of candidate lists `pythonic` may hand to `ast.parse`, per character of text (and a floor):
#: a bound on its work, which real answers (a few short lists) stay far below
_PY_BUDGET, _PY_BUDGET_FLOOR = 8, 64 * 1024


@dataclass
class Found:
    """Calls found in a text by one syntax (`rule` names it), and where: text[start:end]."""

    rule: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    start: int = 0
    end: int = 0


def _as_call(obj: Any, tools: dict[str, Any], need_args: bool = False) -> tuple[str, dict[str, Any]] | None:
    """{"name": ..., "arguments" | "parameters": {...} or a JSON string}, or {"function": {...}} of that shape
    (without `need_args`, the arguments may be left out)."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if need_args and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict) or (tools and obj["name"] not in tools):
        return None
    return obj["name"], args


def _hermes_blocks(text: str) -> list[tuple[str, int, int]]:
    """(body, start, end) of each `<tool_call>` block, left to right: the body runs to the next
    `</tool_call>` or, without one, to the end of the text; whitespace around it is left out."""
    out = []
    start = text.find(_HERMES_OPEN)
    while start >= 0:
        body_at = start + len(_HERMES_OPEN)
        close = text.find(_HERMES_CLOSE, body_at)
        end = len(text) if close < 0 else close + len(_HERMES_CLOSE)
        out.append((text[body_at:len(text) if close < 0 else close].strip(), start, end))
        start = text.find(_HERMES_OPEN, end) if close >= 0 else -1
    return out


def hermes(text: str, tools: dict[str, Any]) -> Found | None:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen): the tag alone is a call left
    in the text; the calls are those whose JSON parses and names an offered tool."""
    blocks = _hermes_blocks(text)
    if not blocks:
        return None
    found = Found("call_in_content_hermes", start=blocks[0][1], end=blocks[-1][2])
    for body, _, _ in blocks:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, tools)
            if call is not None:
                found.calls.append(call)
    return found


def _py_calls(source: str, tools: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
    """A non-empty Python list of calls by dotted names with literal keyword values (`pycall`), one of them to an
    offered tool; None otherwise."""
    try:
        nodes = list(expression_calls(source, containers=(ast.List,), bare=False))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls = []
    for node in nodes:
        name = dotted_name(node.func)
        if node.args or name is None:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            return None
        calls.append((name, args))
    return calls if any(name in tools for name, _ in calls) else None


def pythonic(text: str, tools: dict[str, Any]) -> Found | None:
    """`[get_weather(city="Paris"), f(x=1)]` (Llama 3.2/4, BFCL's prompt format) naming an offered tool.

    Each `[name(` is tried up to each of the next 64 `]`s; what these tries hand to the parser is bounded by
    a multiple of the text's length, past which the search stops (no call found)."""
    budget = _PY_BUDGET * len(text) + _PY_BUDGET_FLOOR
    for m in _PY_START.finditer(text):
        end, tries = text.find("]", m.end()), 0
        while end >= 0 and tries < 64:  # the list ends at one of the next "]"s
            tries += 1
            budget -= end + 1 - m.start()
            if budget < 0:
                return None
            calls = _py_calls(text[m.start():end + 1], tools)
            if calls is not None:
                return Found("call_in_content_pythonic", [c for c in calls if c[0] in tools], m.start(), end + 1)
            end = text.find("]", end + 1)
    return None


class _Pairs(dict):  # type: ignore[type-arg]
    """A decoded JSON object that also keeps its pairs as written (a key given twice keeps its last value)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _containers(value: Any) -> list[Any]:
    """The arrays and objects of a decoded JSON value in the order they open in its text (each pair of an
    object counted, a key given twice included)."""
    out, todo = [], [value]
    while todo:
        node = todo.pop()
        if isinstance(node, _Pairs):
            out.append(node)
            todo.extend(v for _, v in reversed(node.pairs))
        elif isinstance(node, list):
            out.append(node)
            todo.extend(reversed(node))
    return out


def _calls_in(obj: Any, tools: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [c for c in (_as_call(o, tools, True) for o in (obj if isinstance(obj, list) else [obj])) if c]


def json_objects(text: str, tools: dict[str, Any]) -> Found | None:
    """A JSON object (or a list of them) naming an offered tool: {"name": ..., "arguments": {...}}; the first
    that opens in the text, a value nested in another included.

    Linear time (`jsonscan`): each outermost value is decoded once and the values nested in it are read from
    that decoding, in the order they open (brackets inside its strings are not looked at). A value nested
    deeper than `JSON_MAX_DEPTH` holds no call found."""
    if not tools:
        return None
    for start, end, value in json_values(text, object_pairs_hook=_Pairs):
        for k, node in enumerate(_containers(value)):
            if not _calls_in(node, tools):
                continue
            at, until = start, end
            if k:  # the k-th value that opens in this one: where it is
                at, until = nested_spans(text[start:end])[k]
                at, until = start + at, start + until
            return Found("call_in_content_json", _calls_in(json.loads(text[at:until]), tools), at, until)
    return None


def find_calls(text: Any, tools: dict[str, Any]) -> Found | None:
    """The first syntax that finds calls of offered tools in `text` (Hermes, then Python-style, then JSON)."""
    if not isinstance(text, str) or not tools or not text.strip() or len(text) > MAX_TEXT:
        return None
    for finder in (hermes, pythonic, json_objects):
        found = finder(text, tools)
        if found is not None:
            return found
    return None
