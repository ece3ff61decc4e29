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

#: text longer than this is not searched (a call left in the text is short)
MAX_TEXT = 20_000
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
_PY_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_json = json.JSONDecoder()


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
        except ValueError:
            return None
    if not isinstance(args, dict) or (tools and obj["name"] not in tools):
        return None
    return obj["name"], args


def hermes(text: str, tools: dict[str, Any]) -> Found | None:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen): the tag alone is a call left
    in the text; the calls are those whose JSON parses and names an offered tool."""
    matches = list(_HERMES.finditer(text))
    if not matches:
        return None
    found = Found("call_in_content_hermes", start=matches[0].start(), end=matches[-1].end())
    for m in matches:
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item, tools)
            if call is not None:
                found.calls.append(call)
    return found


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _py_calls(source: str, tools: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return None
        calls.append((name, args))
    return calls if any(name in tools for name, _ in calls) else None


def pythonic(text: str, tools: dict[str, Any]) -> Found | None:
    """`[get_weather(city="Paris"), f(x=1)]` (Llama 3.2/4, BFCL's prompt format) naming an offered tool."""
    for m in _PY_START.finditer(text):
        end, tries = text.find("]", m.end()), 0
        while end >= 0 and tries < 64:  # the list ends at one of the next "]"s
            tries += 1
            calls = _py_calls(text[m.start():end + 1], tools)
            if calls is not None:
                return Found("call_in_content_pythonic", [c for c in calls if c[0] in tools], m.start(), end + 1)
            end = text.find("]", end + 1)
    return None


def json_objects(text: str, tools: dict[str, Any]) -> Found | None:
    """A JSON object (or a list of them) naming an offered tool: {"name": ..., "arguments": {...}}."""
    pos = 0
    while True:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            return None
        start = min(starts)
        try:
            obj, end = _json.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        calls = [c for c in (_as_call(o, tools, True) for o in (obj if isinstance(obj, list) else [obj])) if c]
        if calls and tools:
            return Found("call_in_content_json", calls, start, end)
        pos = start + 1


def find_calls(text: Any, tools: dict[str, Any]) -> Found | None:
    """The first syntax that finds calls of offered tools in `text` (Hermes, then Python-style, then JSON)."""
    if not isinstance(text, str) or not tools or not text.strip() or len(text) > MAX_TEXT:
        return None
    for finder in (hermes, pythonic, json_objects):
        found = finder(text, tools)
        if found is not None:
            return found
    return None
