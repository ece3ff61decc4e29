"""BFCL function docs ⇄ OpenAI `tools`, converted the way BFCL compiles tools for OpenAI-style FC models.

Forward (`to_openai_tools`): names lose their dots (`math.factorial` → `math_factorial`, OpenAI allows
`^[a-zA-Z0-9_-]{1,64}$`), `parameters.type` becomes `object`, and each property type is mapped
(`dict`→`object`, `float`→`number` plus `format: float` and a note in the description, `tuple`→`array`,
`any`→`string`, Java/JS type names to their JSON equivalents, unknown → `string`), through nested
`properties` and two levels of `items`, as BFCL does.

Backward (`from_openai_tools`): the name map restores the original names; `object`→`dict`, `number` with
`format: float` → `float` (the note is removed), `number` items → `float`; other JSON-schema names stay as
they are. `tuple`, `any` and the Java/JS names do not survive the
trip (they come back as `array` / `string` / their JSON equivalents): see `projected_type`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# BFCL type name → OpenAPI / JSON-schema type name (the table BFCL applies for OpenAI-style tools)
OPENAPI_TYPES = {
    "integer": "integer",
    "number": "number",
    "float": "number",
    "string": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "dict": "object",
    "object": "object",
    "tuple": "array",
    "any": "string",
    "byte": "integer",
    "short": "integer",
    "long": "integer",
    "double": "number",
    "char": "string",
    "ArrayList": "array",
    "Array": "array",
    "HashMap": "object",
    "Hashtable": "object",
    "Queue": "array",
    "Stack": "array",
    "Any": "string",
    "String": "string",
    "Bigint": "integer",
}
FLOAT_NOTE = " This is a float type value."
_BACK = {"object": "dict"}


def openai_name(name: str) -> str:
    return name.replace(".", "_")


def projected_type(bfcl_type: str) -> str:
    """The BFCL type a property has after a round trip (what `from_openai_tools` can restore)."""
    if bfcl_type == "float":
        return "float"
    mapped = OPENAPI_TYPES.get(bfcl_type, "string")
    return _BACK.get(mapped, mapped)


def _copy(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def _map_type(name: Any) -> str:
    return OPENAPI_TYPES.get(name, "string") if isinstance(name, str) else "string"


def _to_openai_props(props: dict[str, Any]) -> dict[str, Any]:
    for schema in props.values():
        if "type" not in schema:
            schema["type"] = "string"
        else:
            if schema["type"] == "float":
                schema["format"] = "float"
                schema["description"] = schema.get("description", "") + FLOAT_NOTE
            schema["type"] = _map_type(schema["type"])
        if schema["type"] not in ("array", "object"):
            continue
        if "properties" in schema:
            _to_openai_props(schema["properties"])
        elif "items" in schema:
            items = schema["items"]
            items["type"] = _map_type(items.get("type"))
            if items["type"] == "array" and "items" in items:
                items["items"]["type"] = _map_type(items["items"].get("type"))
            elif items["type"] == "object" and "properties" in items:
                _to_openai_props(items["properties"])
    return props


def to_openai_tools(functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """BFCL docs → (OpenAI chat-completions `tools`, {OpenAI name: original name})."""
    tools: list[dict[str, Any]] = []
    name_map: dict[str, str] = {}
    for doc in _copy(functions):
        original = doc["name"]
        doc["name"] = openai_name(original)
        if name_map.get(doc["name"], original) != original:
            raise ValueError(
                f"function names {name_map[doc['name']]!r} and {original!r} collide "
                f"as {doc['name']!r} once dots become underscores"
            )
        name_map[doc["name"]] = original
        params = doc.setdefault("parameters", {})
        params["type"] = "object"
        params["properties"] = _to_openai_props(params.get("properties") or {})
        tools.append({"type": "function", "function": doc})
    return tools, name_map


def _back_type(schema: dict[str, Any], item: bool) -> None:
    kind = schema.get("type")
    if kind == "number" and item:  # BFCL marks float items with no format; only Python docs have them
        schema["type"] = "float"
    elif kind == "number" and schema.get("format") == "float":
        schema["type"] = "float"
        del schema["format"]
        desc = schema.get("description")
        if isinstance(desc, str) and desc.endswith(FLOAT_NOTE):
            schema["description"] = desc[: -len(FLOAT_NOTE)]
    elif isinstance(kind, str):
        schema["type"] = _BACK.get(kind, kind)


def _from_openai_schema(schema: dict[str, Any], item: bool = False) -> None:
    _back_type(schema, item)
    for sub in (schema.get("properties") or {}).values():
        if isinstance(sub, dict):
            _from_openai_schema(sub)
    items = schema.get("items")
    if isinstance(items, dict):
        _from_openai_schema(items, item=True)


def from_openai_tools(tools: list[dict[str, Any]], name_map: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """OpenAI `tools` → BFCL-style docs (names restored through `name_map` when given)."""
    names = name_map or {}
    docs: list[dict[str, Any]] = []
    for tool in _copy(tools):
        doc = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            continue
        doc["name"] = names.get(doc["name"], doc["name"])
        params = doc.get("parameters")
        if isinstance(params, dict):
            params["type"] = "dict"
            for sub in (params.get("properties") or {}).values():
                if isinstance(sub, dict):
                    _from_openai_schema(sub)
        docs.append(doc)
    return docs


def _language(category: str) -> str:
    if "java" in category and "javascript" not in category:
        return "Java"
    return "JavaScript" if "javascript" in category else "Python"


_HINTS = {
    "Java": " Note that the provided function is in Java 8 SDK syntax.",
    "JavaScript": " Note that the provided function is in JavaScript syntax.",
    "Python": " Note that the provided function is in Python 3 syntax.",
}


def with_language_hints(functions: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    """The docs as BFCL shows them to a model at generation time (a copy).

    Every description gets a language note; for Java and JavaScript each parameter becomes a
    `string` whose description tells its real type (values are expected as source text).
    """
    lang = _language(category)
    docs = _copy(functions)
    for doc in docs:
        doc["description"] = doc.get("description", "") + _HINTS[lang]
        if lang == "Python":
            continue
        for schema in (doc.get("parameters", {}).get("properties") or {}).values():
            kind = schema.get("type")
            desc = schema.get("description", "")
            if kind == "any":
                desc += f" This parameter can be of any type of {lang} object in string representation."
            else:
                desc += f" This is {lang} {kind} type parameter in string representation."
            if kind in (("ArrayList", "Array") if lang == "Java" else ("array",)) and "items" in schema:
                desc += (
                    f" The list elements are of type {schema['items'].get('type')}; "
                    "they are not in string representation."
                )
                del schema["items"]
            if lang == "JavaScript" and kind == "dict" and "properties" in schema:
                desc += (
                    " The dictionary entries have the following schema; they are not in string "
                    f"representation. {json.dumps(schema['properties'])}"
                )
                del schema["properties"]
            schema["description"] = desc
            schema["type"] = "string"
    return docs


def original_name(name: str, name_map: dict[str, str]) -> str:
    """The corpus name of an OpenAI tool name (unchanged when it is not in the map)."""
    return name_map.get(name, name)
