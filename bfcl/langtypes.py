"""Java and JavaScript argument values: BFCL expects them as source text and converts them by schema type.

Each converter returns the converted value, or the text unchanged (as a string) when the text does not
have the shape its type needs, as BFCL's checker does; the later type check then decides. Shapes
(patterns) are BFCL's, including its known gaps (a Java `char` never converts, a Java HashMap body is
parsed only when present, JS arrays split on commas).
"""

from __future__ import annotations

import re
from typing import Any

# schema type → the Python type a converted value must have
JAVA_TYPES: dict[str, type] = {
    "byte": int, "short": int, "integer": int, "float": float, "double": float, "long": int,
    "boolean": bool, "char": str, "Array": list, "ArrayList": list, "Set": set, "HashMap": dict,
    "Hashtable": dict, "Queue": list, "Stack": list, "String": str, "any": str,
}
JS_TYPES: dict[str, type] = {
    "String": str, "integer": int, "float": float, "Bigint": int, "Boolean": bool, "dict": dict,
    "array": list, "any": str,
}
# schema types whose items carry their own type (converted item by item)
NESTED_TYPES = ("Array", "ArrayList", "array")

_INT = re.compile(r"^-?\d+$")
_JAVA_FLOAT = re.compile(r"^-?\d+(\.\d+)?([eE][+-]?\d+)?[fF]$")
_JAVA_DOUBLE = re.compile(r"^-?\d+(\.\d+)?([eE][+-]?\d+)?$")
_JAVA_LONG = re.compile(r"^-?\d+[lL]$")
_JAVA_ASLIST = re.compile(r"new\s+ArrayList<\w*>\(Arrays\.asList\((.+?)\)\)")
_JAVA_ADD_BLOCK = re.compile(r"new\s+ArrayList<\w*>\(\)\s*\{\{\s*(.+?)\s*\}\}", re.DOTALL)
_JAVA_ADD = re.compile(r"add\((.+?)\)")
_JAVA_EMPTY_LIST = re.compile(r"new\s+ArrayList<\w*>\(\)")
_JAVA_ARRAY = re.compile(r"new\s+\w+\[\]\s*\{(.*?)\}")
_JAVA_MAP = re.compile(r"new\s+HashMap<.*?>\s*\(\)\s*\{\s*\{?\s*(.*?)\s*\}?\s*\}", re.DOTALL)
_JAVA_PUT = re.compile(r"put\(\"(.*?)\",\s*(.*?)\)")
_JAVA_EMPTY_MAP = re.compile(r"new\s+HashMap<.*?>\s*\(\)")
_FLOAT_SUFFIX = re.compile(r"[fF]$")
_LONG_SUFFIX = re.compile(r"[lL]$")

_JS_FLOAT = re.compile(r"^-?\d+(\.\d+)?$")
_JS_BIGINT = re.compile(r"^-?\d+n$")
_JS_ARRAY_2D = re.compile(r"\[\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\]|\bnew\s+Array\(\s*\[.*?\]\s*(,\s*\[.*?\]\s*)*\)")
_JS_ARRAY = re.compile(r"\[(.*?)\]|\bnew\s+Array\((.*?)\)")
_JS_INNER = re.compile(r"\[(.*?)\]")
_JS_DICT = re.compile(r"\{(.*?)\}")
_JS_PAIR = re.compile(r"([^:]+):\s*(.*?)(?:,\s*(?=[^,]+:)|$)")


def _number(text: str) -> Any:
    """int, else float, else the text itself (Python's own literal rules)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


# --- Java ----------------------------------------------------------------------------------------


def _java_literal(text: str) -> Any:
    """A Java literal whose type is not known from the schema."""
    if text == "true":
        return True
    if text == "false":
        return False
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if _JAVA_LONG.match(text):
        return int(text[:-1])
    if _JAVA_FLOAT.match(text):
        return float(_FLOAT_SUFFIX.sub("", text))
    return _number(text)


def _java_item(text: str, item_type: str | None) -> Any:
    if item_type in ("char", "String"):
        return text[1:-1]  # quotes dropped without looking
    return java_convert(text, item_type) if item_type else _java_literal(text)


def _java_arraylist(text: str, item_type: str | None) -> Any:
    found = _JAVA_ASLIST.search(text)
    if found:
        return [_java_item(part.strip(), item_type) for part in found.group(1).split(",")]
    block = _JAVA_ADD_BLOCK.search(text)
    if block:
        return [_java_item(m.strip(), item_type) for m in _JAVA_ADD.findall(block.group(1))]
    if _JAVA_EMPTY_LIST.search(text):
        return []
    return text


def _java_array(text: str, item_type: str | None) -> Any:
    found = _JAVA_ARRAY.search(text)
    if not found:
        return text
    parts = [p.strip() for p in found.group(1).split(",") if p.strip()]
    return [java_convert(p, item_type) if item_type else _java_literal(p) for p in parts]


def _java_hashmap(text: str) -> Any:
    found = _JAVA_MAP.search(text)
    if found:
        out: dict[str, Any] = {}
        body = found.group(1)
        if body.strip():
            for key, raw in _JAVA_PUT.findall(body):
                out[key] = _java_literal(raw.strip())
        return out
    if _JAVA_EMPTY_MAP.search(text):
        return {}
    return text


def java_convert(text: str, java_type: str, item_type: str | None = None) -> Any:
    """Convert Java source text by schema type; unsupported collection types raise as BFCL's do."""
    if java_type not in JAVA_TYPES:
        raise ValueError(f"unsupported Java type {java_type!r}")
    if java_type in ("byte", "short", "integer"):
        return int(text) if _INT.match(text) else str(text)
    if java_type == "float":
        return float(_FLOAT_SUFFIX.sub("", text)) if _JAVA_FLOAT.match(text) else str(text)
    if java_type == "double":
        return float(text) if _JAVA_DOUBLE.match(text) else str(text)
    if java_type == "long":
        return int(_LONG_SUFFIX.sub("", text)) if _JAVA_LONG.match(text) else str(text)
    if java_type == "boolean":
        return text == "true" if text in ("true", "false") else str(text)
    if java_type in ("char", "String", "any"):
        return str(text)  # BFCL's char pattern can never match: a char stays text
    if java_type == "ArrayList":
        return _java_arraylist(text, item_type)
    if java_type == "Array":
        return _java_array(text, item_type)
    if java_type == "HashMap":
        return _java_hashmap(text)
    raise NotImplementedError(f"{java_type} conversion is not supported")


# --- JavaScript ----------------------------------------------------------------------------------


def _js_literal(text: str) -> Any:
    text = text.strip()
    if text == "true":
        return True
    if text == "false":
        return False
    if len(text) >= 1 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return _number(text)


def _js_array(code: str, item_type: str | None) -> Any:
    two_d = _JS_ARRAY_2D.match(code)
    if two_d:
        rows = []
        for idx, inner in enumerate(_JS_INNER.findall(two_d.group(0))):
            inner = inner.strip()
            if idx == 0 and inner.startswith("["):
                inner = inner[1:]
            rows.append([_js_literal(e.strip()) for e in inner.split(",")])
        return rows
    one_d = _JS_ARRAY.match(code)
    if not one_d:
        return code
    body = one_d.group(1) if one_d.group(1) is not None else one_d.group(2)
    body = (body or "").strip()
    elements = body.split(",") if body else []
    if not item_type:
        return [_js_literal(e.strip()) for e in elements]
    out = []
    for e in elements:
        e = e.strip()
        quoted = e.startswith("'") or e.startswith('"')
        out.append(js_convert(e, item_type, "String") if quoted else js_convert(e, item_type))
    return out


def _js_dict(code: str) -> Any:
    if code == "{}":
        return {}
    found = _JS_DICT.match(code)
    if not found:
        return code
    out: dict[str, Any] = {}
    for key, value in _JS_PAIR.findall(found.group(1)):
        key = key.strip().strip("'\"")
        value = value.strip()
        if value.startswith("[") and value.endswith("]"):
            out[key] = _js_collection(value, "array")
        elif value.startswith("{") and value.endswith("}"):
            out[key] = _js_collection(value, "dict")
        else:
            out[key] = _js_literal(value.strip("'\""))
    return out


def _js_collection(code: str, kind: str, item_type: str | None = None) -> Any:
    code = code.strip()
    try:
        return _js_array(code, item_type) if kind == "array" else _js_dict(code)
    except Exception:  # noqa: BLE001 — an unparseable collection stays text, as in BFCL
        return code


def js_convert(text: str, js_type: str, item_type: str | None = None) -> Any:
    """Convert JavaScript source text by schema type."""
    if js_type not in JS_TYPES:
        raise ValueError(f"unsupported JavaScript type {js_type!r}")
    if js_type == "String":
        quoted = (text.startswith('"') and text.endswith('"')) or (text.startswith("'") and text.endswith("'"))
        return text[1:-1] if quoted else str(text)
    if js_type == "integer":
        return int(text) if _INT.match(text) else str(text)
    if js_type == "float":
        return float(text) if _JS_FLOAT.match(text) else str(text)
    if js_type == "Bigint":
        return int(text[:-1]) if _JS_BIGINT.match(text) else str(text)
    if js_type == "Boolean":
        return text == "true" if text in ("true", "false") else str(text)
    if js_type in ("dict", "array"):
        return _js_collection(text, js_type, item_type)
    return str(text)  # any
