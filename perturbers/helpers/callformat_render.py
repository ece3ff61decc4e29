"""Function calls written as text in one of the four return formats, the way a model should write them.

Used to show earlier assistant calls in the conversation history, to render tool results the way
BFCL feeds them back to prompting models, and to build examples. A call is
`{"name": str, "arguments": dict}`.
"""

from __future__ import annotations

import json
from typing import Any
from xml.sax.saxutils import escape, quoteattr

_ATTR_ENTITIES = {"\n": "&#10;", "\r": "&#13;", "\t": "&#9;"}
_TEXT_ENTITIES = {"\r": "&#13;"}  # XML parsers turn a raw CR in text into LF


def python_call(call: dict[str, Any]) -> str:
    """`name(k=v, …)` with python literals, as BFCL writes an executed call."""
    args = ", ".join(f"{k}={v!r}" for k, v in (call.get("arguments") or {}).items())
    return f"{call['name']}({args})"


def render_python(calls: list[dict[str, Any]]) -> str:
    return "[" + ", ".join(python_call(c) for c in calls) + "]"


def render_json(calls: list[dict[str, Any]]) -> str:
    items = [{"function": c["name"], "parameters": c.get("arguments") or {}} for c in calls]
    return "```json\n" + json.dumps(items, ensure_ascii=False, separators=(",", ":")) + "\n```"


def xml_type(value: Any) -> str:
    """The type attribute a model should write for a python value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, tuple):
        return "tuple"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "dict"
    return "string"


def xml_text(value: Any) -> str:
    """A value as the text BFCL's XML decoding turns back into it (python literals for containers)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, (list, tuple, dict, float)):
        return repr(value)
    return str(value)


def _attr(value: str) -> str:
    return quoteattr(value, _ATTR_ENTITIES)


def _verbose_param(name: str, value: Any) -> str:
    return f"<param name={_attr(name)} value={_attr(xml_text(value))} type=\"{xml_type(value)}\"/>"


def _concise_param(name: str, value: Any) -> str:
    return f"<param name={_attr(name)} type=\"{xml_type(value)}\">{escape(xml_text(value), _TEXT_ENTITIES)}</param>"


def _render_xml(calls: list[dict[str, Any]], param: Any, wrap: tuple[str, str]) -> str:
    out = ["<functions>"]
    for c in calls:
        params = "".join(param(k, v) for k, v in (c.get("arguments") or {}).items())
        out.append(f"<function name={_attr(c['name'])}>{wrap[0]}{params}{wrap[1]}</function>")
    out.append("</functions>")
    return "".join(out)


def render_verbose_xml(calls: list[dict[str, Any]]) -> str:
    return _render_xml(calls, _verbose_param, ("<params>", "</params>"))


def render_concise_xml(calls: list[dict[str, Any]]) -> str:
    return _render_xml(calls, _concise_param, ("", ""))


RENDERERS = {
    "python": render_python,
    "json": render_json,
    "verbose_xml": render_verbose_xml,
    "concise_xml": render_concise_xml,
}


def render_calls(calls: list[dict[str, Any]], return_format: str, tool_call_tag: bool = False) -> str:
    """The calls as the model is asked to write them in `return_format`, inside `<TOOLCALL>` when tagged."""
    text = RENDERERS[return_format](calls)
    return f"<TOOLCALL>{text}</TOOLCALL>" if tool_call_tag else text


def tool_results_text(results: list[tuple[str, str]]) -> str:
    """Tool results as BFCL feeds them to prompting models: the repr of a list of tool messages.

    `results` holds (call text, result text) pairs, in the order the calls were made.
    """
    return repr([{"role": "tool", "name": name, "content": content} for name, content in results])
