"""The JSON schemas that constrain the embedded model's answers (turned into llama.cpp grammars by the server).

With tools on offer the model answers one JSON object, the way llama.cpp's llama-server does generic tool
calling: `{"tool_calls": [{"name": ..., "arguments": {...}}]}` (a name from the offered tools, the arguments
from that tool's own schema) or `{"response": "..."}` (a text reply). Which of the two is allowed follows
`tool_choice`:

| tool_choice | allowed |
|---|---|
| `auto` | a call to any offered tool, or a text reply: the model decides under the grammar |
| `required` | a call to any offered tool |
| `{"type": "function", ...}` | a call to that tool only |
| `none` | no grammar: plain text |

`parallel_tool_calls: false` caps the list at one call. Tool schemas come from real clients and from BFCL
(types such as `dict`, `float`, `tuple`, `any`); `sanitize` maps them onto JSON Schema the grammar
converter understands and drops what only documents (descriptions, defaults, examples).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: BFCL's Python-flavoured type names and their JSON Schema equivalents
TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "int": "integer",
                "bool": "boolean", "str": "string", "double": "number", "long": "integer", "char": "string",
                "byte": "integer", "short": "integer", "hashmap": "object", "arraylist": "array"}
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
#: schema keys kept (everything else documents the schema rather than constraining it)
KEPT = {"type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "minItems", "maxItems",
        "additionalProperties"}
#: limits on what a request's schemas may ask of the grammar (beyond them: a 400, never a crash or a hang):
#: nesting levels of one schema, values of one enum / alternatives of one anyOf, minItems / maxItems (the
#: grammar writes a bounded repetition out in full), a tool name's length
MAX_SCHEMA_DEPTH = 24
MAX_CHOICES = 512
MAX_REPEAT = 64
MAX_NAME = 256


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


class ToolChoiceError(ValueError):
    """A tool_choice that does not fit the request (names a tool it does not offer, `required` without tools)."""


class SchemaError(ValueError):
    """A tool or response schema the grammar cannot be built from within the limits (nesting, enum size...)."""


def sanitize(schema: Any, depth: int = 0) -> dict[str, Any]:
    """A JSON Schema the grammar converter accepts, for one parameter or a whole parameter object.

    Raises SchemaError for what would make a grammar too large to build or sample (see the limits above)."""
    if not isinstance(schema, dict):
        return {}
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"a schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    out: dict[str, Any] = {}
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [TYPE_ALIASES.get(str(k).lower(), str(k).lower()) for k in kind]
        kinds = [k for k in kinds if k in JSON_TYPES]
        kind = kinds if len(kinds) > 1 else (kinds[0] if kinds else None)
    elif isinstance(kind, str):
        kind = TYPE_ALIASES.get(kind.lower(), kind.lower())
        if kind not in JSON_TYPES:  # "any" and unknown names: no constraint
            kind = None
    else:
        kind = None
    if kind is not None:
        out["type"] = kind
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or len(enum) > MAX_CHOICES:
            raise SchemaError(f"'enum' must be an array of at most {MAX_CHOICES} values")
        if enum:
            out["enum"] = enum
    if "const" in schema:
        out["const"] = schema["const"]
    for key in ("minItems", "maxItems"):
        if key in schema:
            n = schema[key]
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_REPEAT:
                raise SchemaError(f"'{key}' must be an integer between 0 and {MAX_REPEAT}")
            out[key] = n
    if out.get("minItems", 0) > out.get("maxItems", MAX_REPEAT):
        raise SchemaError("'minItems' is larger than 'maxItems'")
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            if len(schema[key]) > MAX_CHOICES:
                raise SchemaError(f"'{key}' must have at most {MAX_CHOICES} alternatives")
            out[key] = [sanitize(s, depth + 1) for s in schema[key]]
    if "items" in schema:
        items = schema["items"]
        out["items"] = sanitize(items, depth + 1) if isinstance(items, dict) else {}
    props = schema.get("properties")
    if isinstance(props, dict) and props:
        out["properties"] = {str(k): sanitize(v, depth + 1) for k, v in props.items()}
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("'required' must be an array of property names")
        required = [r for r in required if r in out["properties"]]
        if required:
            out["required"] = required
        # a closed object keeps a small model from inventing parameters
        out["additionalProperties"] = False
    elif kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = sanitize(extra, depth + 1)
    # "enum" with a type the values do not have (BFCL: integer enums typed "string") would make an empty rule
    if "enum" in out and "type" in out and not isinstance(out["type"], list):
        del out["type"]
    return out


def parse_tools(raw: Any, api: str) -> list[Tool]:
    """Function tools from a chat (`{type, function: {...}}`) or Responses (`{type, name, ...}`) request.

    Raises ValueError with a client-facing message when a tool is malformed."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("'tools' must be an array")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}] must be an object")
        if t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported (got type {repr(t.get('type'))[:100]})")
        fn = t.get("function") if api == "chat" else t
        if api == "chat" and not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise ValueError(f"tools[{i}]: a function tool needs a name (a string of 1 to {MAX_NAME} characters)")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].parameters must be an object")
        description = fn.get("description")
        if not isinstance(description, (str, type(None))):
            raise ValueError(f"tools[{i}].description must be a string")
        tools.append(Tool(name, description or "", params or {"type": "object", "properties": {}}))
    return tools


def choose(tools: list[Tool], tool_choice: Any, api: str) -> tuple[str, list[Tool]]:
    """The mode (`auto`, `required`, `none`) and the tools the model may call, from the request's tool_choice."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required", "none"):
            raise ToolChoiceError("tool_choice must be 'auto', 'required', 'none' or a function, not "
                                  f"{tool_choice[:100]!r}")
        if tool_choice == "required" and not tools:
            raise ToolChoiceError("tool_choice 'required' needs at least one tool")
        return (tool_choice if tools else "none"), tools
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") == "allowed_tools":  # Responses: {type, mode, tools: [{type, name}]}
            listed = tool_choice.get("tools") or []
            if not isinstance(listed, list):
                raise ToolChoiceError("tool_choice.tools must be an array")
            names = {_name_of(t, api) for t in listed}
            allowed = [t for t in tools if t.name in names]
            mode = tool_choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise ToolChoiceError(f"tool_choice.mode must be 'auto' or 'required', not {str(mode)[:100]!r}")
            return (mode if allowed else "none"), allowed
        name = _name_of(tool_choice, api)
        if tool_choice.get("type") == "function" and name is not None:
            named = [t for t in tools if t.name == name]
            if not named:
                raise ToolChoiceError(f"tool_choice names the function {name[:MAX_NAME]!r}, which is not among the "
                                      "tools")
            return "required", named
    raise ToolChoiceError(f"unsupported tool_choice: {json.dumps(tool_choice)[:200]}")


def _name_of(choice: Any, api: str) -> str | None:
    """The function name in a tool_choice (or allowed_tools entry): chat's `{function: {name}}` or Responses'
    `{name}`, either shape accepted on either API; None when there is no string name."""
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    nested = fn.get("name") if isinstance(fn, dict) else None
    flat = choice.get("name")
    first, second = (nested, flat) if api == "chat" else (flat, nested)
    for name in (first, second):
        if isinstance(name, str) and name:
            return name
    return None


def call_schema(tool: Tool) -> dict[str, Any]:
    params = sanitize(tool.parameters)
    if params.get("type") not in (None, "object"):
        params = {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def answer_schema(mode: str, tools: list[Tool], parallel: bool) -> dict[str, Any] | None:
    """The schema of the whole answer, or None for unconstrained text (`none`, no tools)."""
    if mode == "none" or not tools:
        return None
    calls: dict[str, Any] = {"type": "array", "minItems": 1}
    items = [call_schema(t) for t in tools]
    calls["items"] = items[0] if len(items) == 1 else {"anyOf": items}
    if not parallel:
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
            "additionalProperties": False}
    if mode == "required":
        return call
    return {"anyOf": [call, reply_schema()]}


def reply_schema() -> dict[str, Any]:
    """A text reply only, in the same JSON wrapper."""
    return {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
            "additionalProperties": False}


def decode_answer(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(text reply, [(name, arguments JSON)]) from a grammar-constrained answer.

    An answer cut short by max_tokens is not valid JSON: it comes back as text, unparsed."""
    try:
        obj = json.loads(text)
    except ValueError:
        return _cut_reply(text), []
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        calls = [(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False))
                 for c in obj["tool_calls"] if isinstance(c, dict) and isinstance(c.get("name"), str)]
        if calls:
            return None, calls
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []


def _cut_reply(text: str) -> str:
    """The text of a `{"response": "...` answer cut by max_tokens; any other cut answer as it is."""
    head = text.lstrip()
    prefix = '{"response":'
    if not head.startswith(prefix):
        return text
    rest = head[len(prefix):].lstrip()
    if not rest.startswith('"'):
        return text
    body = rest[1:]
    for end in range(len(body), -1, -1):  # the longest prefix that decodes as a JSON string
        try:
            return json.loads('"' + body[:end] + '"')
        except ValueError:
            continue
    return text
