"""Function documentation rendered as BFCL V4 shows it to prompting models: json, xml or python.

Input is a list of BFCL-style function docs (`{"name", "description", "parameters"}`); the output
text is laid out exactly as BFCL's format-sensitivity prompts lay it out, quirks included (commas
deleted from XML opening tags, nothing XML-escaped, the blank-line rhythm of the python blocks).
"""

from __future__ import annotations

import json
from typing import Any, Callable

DOC_FORMATS = ("python", "xml", "json")

# JSON-schema primitive types as python annotations; other types are shown under their own name
_PY_PRIMITIVES = {"string": "str", "number": "float", "integer": "int", "boolean": "bool"}


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _description(meta: dict[str, Any]) -> str:
    desc = meta.get("description") or ""
    if "enum" in meta:
        desc += f" Enum values: {meta['enum']}."
    return str(desc)


# --- json -----------------------------------------------------------------------------------------

def render_json(functions: list[dict[str, Any]]) -> str:
    return json.dumps(functions, indent=4)


# --- xml ------------------------------------------------------------------------------------------

def _xml_type(meta: dict[str, Any]) -> str:
    base = meta.get("type", "string")
    items = meta.get("items")
    if isinstance(items, dict) and "type" in items:
        return f"{base}[{items['type']}]"
    if "additionalProperties" in meta:
        return f"{base}[{_as_dict(meta['additionalProperties']).get('type', 'string')}]"
    return str(base)


def _xml_param(name: str, meta: dict[str, Any], required: list[str] | None, level: int, out: list[str]) -> None:
    pad = "  " * level
    flag = "true" if required is None or name in required else "false"
    tag = f'<param name="{name}" type="{_xml_type(meta)}" required="{flag}"'
    if "default" in meta:
        tag += f' default="{meta["default"]!r}"'
    out.append(pad + tag.replace(",", "") + ">\n")
    out.append(f"{pad}  <desc>{_description(meta)}</desc>\n")
    if "properties" in meta:
        child_required = meta.get("required")
        out.append(f"{pad}  <params>\n")
        for child, child_meta in _as_dict(meta["properties"]).items():
            _xml_param(child, _as_dict(child_meta), child_required, level + 2, out)
        out.append(f"{pad}  </params>\n")
    out.append(f"{pad}</param>\n")


def render_xml(functions: list[dict[str, Any]]) -> str:
    blocks = []
    for fn in functions:
        schema = _as_dict(fn.get("parameters"))
        required = schema.get("required")
        out = [f'<function name="{fn["name"]}">\n', f"  <desc>{fn.get('description', '')}</desc>\n", "  <params>\n"]
        for name, meta in _as_dict(schema.get("properties")).items():
            _xml_param(name, _as_dict(meta), required, 2, out)
        out += ["  </params>\n", "</function>\n"]
        blocks.append("".join(out))
    return "\n".join(blocks)


# --- python ---------------------------------------------------------------------------------------

def _py_type(meta: dict[str, Any]) -> str:
    kind = meta.get("type", "string")
    if kind in _PY_PRIMITIVES:
        return _PY_PRIMITIVES[kind]
    if kind in ("array", "list", "tuple") and "items" in meta:
        return f"list[{_py_type(_as_dict(meta['items']))}]"
    if kind in ("object", "dict"):
        if "additionalProperties" in meta:
            return f"dict[str, {_py_type(_as_dict(meta['additionalProperties']))}]"
        return "dict"
    return str(kind)


def _py_param(name: str, meta: dict[str, Any], depth: int, out: list[str]) -> None:
    default = f", default={meta['default']!r}" if "default" in meta else ""
    out.append(f"{' ' * (8 + 4 * depth)}{name} ({_py_type(meta)}{default}): {_description(meta)}\n")
    for child, child_meta in _as_dict(meta.get("properties")).items():
        _py_param(child, _as_dict(child_meta), depth + 1, out)


def render_python(functions: list[dict[str, Any]]) -> str:
    pieces = []
    for fn in functions:
        out = [f"# Function: {fn['name']}\n", '    """\n', f"    {fn.get('description', '')}\n\n"]
        props = _as_dict(_as_dict(fn.get("parameters")).get("properties"))
        if props:
            out.append("    Args:\n")
            for name, meta in props.items():
                _py_param(name, _as_dict(meta), 0, out)
        out.append('    """\n')
        pieces += ["".join(out), "\n"]
    return "\n\n".join(pieces)


RENDERERS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "python": render_python,
    "xml": render_xml,
    "json": render_json,
}


def render_docs(functions: list[dict[str, Any]], doc_format: str) -> str:
    """The function docs as text in `doc_format` (python, xml or json)."""
    try:
        return RENDERERS[doc_format](functions)
    except KeyError:
        raise ValueError(f"function_doc_format must be one of {', '.join(DOC_FORMATS)}") from None
