"""A call's arguments against the tool it names: a JSON object, never empty, matching the parameter schema."""

from __future__ import annotations

from typing import Any

import msgspec

from toolquake.proxy.server.conformance.rules import Violation, excerpt, short

_decode = msgspec.json.decode


class _ToolsOnly(msgspec.Struct):
    """The two fields of a request the rules read; the rest (messages) is parsed past, not built, and the
    tools kept as their bytes (an agent sends the same tools with every request: see `_TOOLS`)."""

    tools: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: no "tools" key
    tool_choice: Any = None


_tools_only = msgspec.json.Decoder(_ToolsOnly).decode
#: the tools of recent requests by their bytes, as `Offered.tools` has them (read-only once built)
_TOOLS: dict[bytes, dict[str, dict[str, Any]]] = {}
_TOOLS_MAX, _TOOLS_MAX_BYTES = 64, 256 * 1024
#: the bytes `_TOOLS` may hold in all, counting each entry as its key and a decoded form of ~3x its size (#28:
#: client-keyed caches are bounded in bytes); over it, or at _TOOLS_MAX entries, it starts again empty
_TOOLS_BUDGET = 8 * 1024 * 1024
_tools_held = [0]


class Offered:
    """What the request offered: its function tools' parameter schemas by name, and its tool_choice."""

    def __init__(self, tools: dict[str, dict[str, Any]], tool_choice: Any = None) -> None:
        self.tools = tools
        self.tool_choice = tool_choice

    @classmethod
    def from_request(cls, body: Any) -> Offered:
        """From a chat-completions or Responses request body (function tools of either shape)."""
        tools: dict[str, dict[str, Any]] = {}
        if not isinstance(body, dict):
            return cls(tools)
        listed = body.get("tools")
        for tool in listed if isinstance(listed, list) else []:
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                continue
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = fn.get("name")
            if isinstance(name, str):
                params = fn.get("parameters")
                tools[name] = params if isinstance(params, dict) else {}
        return cls(tools, body.get("tool_choice"))

    @classmethod
    def from_raw(cls, raw: bytes) -> Offered:
        """`from_request` of a request's bytes, without building its messages; nothing offered when they are
        not a JSON object."""
        try:
            found = _tools_only(raw)
            key = bytes(found.tools)
            if not key or key == b"null":
                return cls({}, found.tool_choice)
            tools = _TOOLS.get(key)
            if tools is None:
                tools = cls.from_request({"tools": _decode(key)}).tools
                if len(key) <= _TOOLS_MAX_BYTES:
                    cost = 4 * len(key)
                    if len(_TOOLS) >= _TOOLS_MAX or _tools_held[0] + cost > _TOOLS_BUDGET:
                        _TOOLS.clear()
                        _tools_held[0] = 0
                    _TOOLS[key] = tools
                    _tools_held[0] += cost
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
            return cls({})
        return cls(tools, found.tool_choice)

    @property
    def calls_allowed(self) -> bool:
        """The request lets the model call a tool (offered some, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"


def check_arguments(arguments: Any, name: Any, offered: Offered, call: int) -> list[Violation]:
    """The rules on one call's complete arguments (`arguments_*`, `call_unknown_tool`)."""
    label = f"call {call} ({short(name)})"
    out: list[Violation] = []
    if offered.tools and isinstance(name, str) and name and name not in offered.tools:
        out.append(Violation("call_unknown_tool", f"{label}: names a tool the request did not offer", short(name),
                             call))
    if arguments is None or arguments == "":
        return [*out, Violation("arguments_empty", f"{label}: arguments are empty (a call without parameters "
                                "sends {})", "", call)]
    if not isinstance(arguments, str):
        return [*out, Violation("arguments_not_string", f"{label}: arguments are a JSON {type(arguments).__name__}, "
                                "not a string", excerpt(arguments), call)]
    try:
        value = _decode(arguments)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        return [*out, Violation("arguments_invalid_json", f"{label}: arguments are not JSON ({str(exc)[:80]})",
                                excerpt(arguments), call)]
    if not isinstance(value, dict):
        return [*out, Violation("arguments_invalid_json", f"{label}: arguments are JSON but not an object",
                                excerpt(arguments), call)]
    schema = offered.tools.get(name) if isinstance(name, str) else None
    if schema:
        try:
            problem = schema_problem(value, schema, "")
        except RecursionError:  # a value and a schema both nested too deep to follow: not judged
            problem = None
        if problem:
            out.append(Violation("arguments_schema", f"{label}: {problem}", excerpt(arguments), call))
    return out


_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "boolean": (bool,), "object": (dict,), "array": (list,),
                                       "null": (type(None),)}


def _is(value: Any, kind: str) -> bool | None:
    """Whether `value` is of JSON-schema type `kind`; None for a type name this check does not know."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = _TYPES.get(kind)
    return None if kinds is None else isinstance(value, kinds)


def schema_problem(value: Any, schema: Any, path: str) -> str | None:
    """The first way `value` breaks `schema` (required properties, types, enums, nested objects and arrays),
    or None. Keywords it does not know are not checked."""
    if not isinstance(schema, dict):
        return None
    where = path or "arguments"
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            if all(schema_problem(value, o, path) for o in options):
                return f"{where} matches none of {key}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    verdicts = [_is(value, k) for k in kinds]
    if verdicts and None not in verdicts and not any(verdicts):
        return f"{where} should be {' or '.join(kinds)}, got {_json_type(value)}"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, (str, int, float, bool)) for e in enum) \
            and value not in enum:
        return f"{where} is not one of the enum values"
    if isinstance(value, dict):
        required = schema.get("required")
        for key in required if isinstance(required, list) else []:
            if key not in value:
                return f"required parameter {short(key)!r} is missing" + (f" in {path}" if path else "")
        props = schema.get("properties")
        if isinstance(props, dict):
            for key, sub in props.items():
                if key in value:
                    problem = schema_problem(value[key], sub, f"{path}.{key}" if path else str(key))
                    if problem:
                        return problem
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = schema_problem(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), type(value).__name__)
