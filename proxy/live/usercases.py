"""Your agent's own test cases: the case format (JSON lines, `proxy/case-schema.json`), its validation, and
the cases as BFCL-shaped `Case` objects, so that perturbers, the grader and the reports treat them as they
treat BFCL's.

One line is one case: `id`, `messages` and `tools` in chat-completions shape (or `input` / `instructions`
and Responses tools, converted by the proxy's own Responses conversion), and `expected`: the string
"no call", or a list of calls, each `{"name", "arguments": {param: [acceptable values]}}` with BFCL's
possible-answer rules ("" among the values marks an optional argument). `order` says whether several
expected calls may come in any order ("free", the default) or in the listed one ("fixed"). Optional:
`category` (default: the file's stem), `tags`, `tool_choice`, `meta` (free notes, never read).

As a `Case`: `functions` are the tools as BFCL docs, `ground_truth` BFCL's `[{name: {param: [values]}}]`,
and `extra["grade_as"]` the BFCL category whose checker grades it: `multiple` (one call), `parallel`
(several, any order), `ordered` (several, in order), `irrelevance` (no call).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from toolquake.bfcl.corpus import CATEGORIES, Case, normalize_query
from toolquake.proxy.server import responses

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "case-schema.json"
NO_CALL = "no call"
ORDERS = ("free", "fixed")
KEYS = frozenset({"id", "messages", "input", "instructions", "tools", "tool_choice", "expected", "order",
                  "category", "tags", "meta"})
ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
#: JSON-schema type → the BFCL type the AST checker knows (anything else is checked as a string)
_TYPES = {"object": "dict", "number": "float", "integer": "integer", "string": "string", "boolean": "boolean",
          "array": "array", "dict": "dict", "float": "float", "tuple": "tuple", "any": "any"}
_PY_TYPES = {"str": "string", "int": "integer", "float": "float", "bool": "boolean"}


class CaseError(ValueError):
    """One line that is not a usable case; the message says why."""


@dataclass
class Problem:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Loaded:
    cases: list[Case] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def schema() -> dict[str, Any]:
    """The JSON Schema of one line (shipped in the package)."""
    return json.loads(SCHEMA_PATH.read_text())


def is_user_case(case: Any) -> bool:
    return bool(getattr(case, "extra", None)) and "grade_as" in case.extra


def grade_as(case: Any) -> str:
    """The BFCL category whose rules grade `case` (a BFCL case: its own category)."""
    extra = getattr(case, "extra", None) or {}
    return extra.get("grade_as") or case.category


# -- reading ---------------------------------------------------------------------------------------


def _tool_name(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _chat_tool(tool: Any) -> Any:
    """A Responses function tool (`{"type": "function", "name": ...}`) as a chat tool; others as they are."""
    if isinstance(tool, dict) and "function" not in tool and tool.get("type") == "function" and "name" in tool:
        return responses.to_chat({"tools": [tool]})[0]["tools"][0]
    return tool


def _chat_form(entry: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """messages and tools in chat shape: a Responses-shaped entry goes through the proxy's own conversion."""
    tools = entry.get("tools", [])
    if not isinstance(tools, list):
        raise CaseError("'tools' must be a list")
    tools = [_chat_tool(t) for t in tools]
    if "messages" in entry:
        if "input" in entry or "instructions" in entry:
            raise CaseError("give 'messages' (chat) or 'input'/'instructions' (Responses), not both")
        return entry["messages"], tools
    if "input" not in entry:
        raise CaseError("missing 'messages' (or Responses 'input')")
    if not isinstance(entry["input"], (str, list)):
        raise CaseError("'input' must be a string or a list of Responses input items")
    chat, _ = responses.to_chat({k: entry[k] for k in ("input", "instructions") if k in entry})
    return chat["messages"], tools


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise CaseError("'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise CaseError(f"messages[{i}] is not an object")
        if msg.get("role") not in ROLES:
            raise CaseError(f"messages[{i}]: role must be one of {', '.join(ROLES)}, got {msg.get('role')!r}")
    if not any(m.get("role") == "user" for m in messages):
        raise CaseError("no user message")


def _check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name = _tool_name(tool)
        if name is None or (isinstance(tool, dict) and tool.get("type", "function") != "function"):
            raise CaseError(f"tools[{i}] is not a function tool {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"parameters\": {...}}}")
        if name in by_name:
            raise CaseError(f"tools[{i}]: a second tool named {name!r}")
        params = tool["function"].get("parameters", {})
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise CaseError(f"tools[{i}] ({name}): 'parameters' must be a JSON-schema object")
        by_name[name] = tool
    return by_name


def _check_expected(expected: Any, tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The expected calls (None: no call)."""
    if expected == NO_CALL:
        return None
    if not isinstance(expected, list) or not expected:
        raise CaseError(f"'expected' must be \"{NO_CALL}\" or a non-empty list of calls")
    for i, call in enumerate(expected):
        where = f"expected[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise CaseError(f"{where}: a call is {{\"name\": ..., \"arguments\": {{param: [values]}}}}")
        extra = set(call) - {"name", "arguments"}
        if extra:
            raise CaseError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
        tool = tools.get(call["name"])
        if tool is None:
            raise CaseError(f"{where}: {call['name']!r} is not one of the case's tools "
                            f"({', '.join(tools) or 'none'})")
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            raise CaseError(f"{where}: 'arguments' must be an object {{param: [acceptable values]}}")
        params = tool["function"].get("parameters") or {}
        props = params.get("properties") or {}
        for name, values in args.items():
            if name not in props:
                raise CaseError(f"{where}: {name!r} is not a parameter of {call['name']}")
            if not isinstance(values, list) or not values:
                raise CaseError(f"{where}: {name!r} must be a non-empty list of acceptable values "
                                "(\"\" among them: the argument may be left out)")
        for name in params.get("required") or []:
            if name not in args:
                raise CaseError(f"{where}: required parameter {name!r} of {call['name']} has no acceptable values")
    return expected


def _bfcl_schema(schema: Any) -> dict[str, Any]:
    """A JSON-schema property as the AST checker reads it (BFCL types; arrays always say their item type)."""
    out = dict(schema) if isinstance(schema, dict) else {}
    kind = out.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the first real type
        kind = next((k for k in kind if k != "null"), "string")
    if not isinstance(kind, str) or kind not in _TYPES:  # no type: the type of the enum's values, else string
        enum = out.get("enum") if isinstance(out.get("enum"), list) else []
        kind = _PY_TYPES.get(type(enum[0]).__name__, "string") if enum else "string"
    out["type"] = _TYPES[kind]
    if out["type"] in ("array", "tuple"):
        out["items"] = _bfcl_schema(out.get("items") or {"type": "string"})
    if out["type"] == "dict" and isinstance(out.get("properties"), dict):
        out["properties"] = {k: _bfcl_schema(v) for k, v in out["properties"].items()}
    return out


def bfcl_docs(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat tools as the BFCL function docs the AST checker grades against."""
    docs = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {}
        props = {k: _bfcl_schema(v) for k, v in (params.get("properties") or {}).items()}
        docs.append({"name": fn["name"], "description": fn.get("description", ""),
                     "parameters": {"type": "dict", "properties": props,
                                    "required": list(params.get("required") or [])}})
    return docs


def _bfcl_value(value: Any) -> Any:
    """One acceptable value in BFCL's answer form: an object's values become single-value lists."""
    if isinstance(value, dict):
        return {k: [v] for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [{k: [x] for k, x in v.items()} for v in value]
    return value


def ground_truth(expected: list[dict[str, Any]]) -> list[dict[str, dict[str, list[Any]]]]:
    return [{c["name"]: {p: [_bfcl_value(v) for v in vs] for p, vs in (c.get("arguments") or {}).items()}}
            for c in expected]


def parse_line(entry: Any, default_category: str, source: str = "") -> Case:
    """One decoded line → a Case (CaseError says what is wrong)."""
    if not isinstance(entry, dict):
        raise CaseError("a case is a JSON object")
    unknown = set(entry) - KEYS
    if unknown:
        raise CaseError(f"unknown key(s) {', '.join(sorted(unknown))} (free notes go under 'meta')")
    case_id = entry.get("id")
    if not isinstance(case_id, str) or not _NAME.match(case_id):
        raise CaseError("'id' must be a string of letters, digits, '_', '.', ':' or '-' (1 to 128)")
    if "tools" not in entry:
        raise CaseError("missing 'tools' (a list; [] for none)")
    if "expected" not in entry:
        raise CaseError(f"missing 'expected' (\"{NO_CALL}\" or a list of calls)")
    messages, tools = _chat_form(entry)
    _check_messages(messages)
    by_name = _check_tools(tools)
    calls = _check_expected(entry["expected"], by_name)
    order = entry.get("order", "free")
    if order not in ORDERS:
        raise CaseError(f"'order' must be one of {', '.join(ORDERS)}")
    category = entry.get("category", default_category)
    if not isinstance(category, str) or not _NAME.match(category):
        raise CaseError("'category' must be a string of letters, digits, '_', '.', ':' or '-'")
    if category in CATEGORIES:
        raise CaseError(f"'category' {category!r} is a BFCL category: choose another name")
    tags = entry.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise CaseError("'tags' must be a list of strings")
    if "meta" in entry and not isinstance(entry["meta"], dict):
        raise CaseError("'meta' must be an object")
    request: dict[str, Any] = {"messages": messages}
    if tools:
        request["tools"] = tools
    if "tool_choice" in entry:
        request["tool_choice"] = entry["tool_choice"]
    if calls is None:
        kind = "irrelevance"
    elif len(calls) == 1:
        kind = "multiple"
    else:
        kind = "parallel" if order == "free" else "ordered"
    return Case(id=case_id, category=category, turns=[messages], functions=bfcl_docs(tools),
                ground_truth=None if calls is None else ground_truth(calls),
                extra={"grade_as": kind, "request": request, "tags": list(tags), "source": source,
                       "expected": entry["expected"], "order": order})


def read_lines(path: str | Path) -> Iterable[tuple[int, bytes, bool]]:
    """(line number, line, is_last) of a JSON-lines file; blank lines are left out."""
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if line.strip():
            yield i + 1, line, i == last


def load_file(path: str | Path, seen: set[str] | None = None) -> Loaded:
    """Every good case of a file, and every bad line with its reason (a bad line never stops the others)."""
    path = Path(path)
    out = Loaded()
    seen = set() if seen is None else seen
    for n, line, _ in read_lines(path):
        try:
            entry = json.loads(line)
        except ValueError as exc:
            out.problems.append(Problem(str(path), n, f"not JSON: {exc}"))
            continue
        try:
            case = parse_line(entry, path.stem, str(path))
        except CaseError as exc:
            out.problems.append(Problem(str(path), n, str(exc)))
            continue
        if case.id in seen:
            out.problems.append(Problem(str(path), n, f"duplicate id {case.id!r}"))
            continue
        seen.add(case.id)
        out.cases.append(case)
    return out


def load_files(paths: Iterable[str | Path]) -> Loaded:
    out = Loaded()
    seen: set[str] = set()
    for p in paths:
        try:
            got = load_file(p, seen)
        except OSError as exc:
            out.problems.append(Problem(str(p), 0, f"cannot read: {exc.strerror or exc}"))
            continue
        out.cases += got.cases
        out.problems += got.problems
    return out


def request_body(case: Case, model: str | None = None) -> dict[str, Any]:
    """The chat-completions body that asks the case (its own tools, as written in the file)."""
    body = json.loads(json.dumps(case.extra["request"]))
    return {"model": model or "default", **body}


# -- matching live requests by content --------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return normalize_query(content)
    if isinstance(content, list):
        return normalize_query("".join(p.get("text", "") for p in content if isinstance(p, dict)
                                       and isinstance(p.get("text"), str)))
    return ""


def _args(raw: Any) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


def conversation_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """A hash of what a conversation says (roles, normalised texts, calls with their arguments) and of its
    tool names; call ids and formatting do not count."""
    said = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        calls = [[(c.get("function") or {}).get("name"), _args((c.get("function") or {}).get("arguments"))]
                 for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        said.append([m.get("role"), _text(m.get("content")), calls])
    names = sorted(str(_tool_name(t)) for t in tools)
    text = json.dumps([said, names], sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class UserCases:
    """Loaded user cases, by id and by conversation key (what the case resolver looks up)."""

    def __init__(self, cases: Iterable[Case]) -> None:
        self.by_id: dict[str, Case] = {}
        self.by_key: dict[str, Case] = {}
        names: set[frozenset[str]] = set()
        for case in cases:
            self.by_id[case.id] = case
            req = case.extra["request"]
            tools = req.get("tools") or []
            self.by_key.setdefault(conversation_key(req["messages"], tools), case)
            names.add(frozenset(str(_tool_name(t)) for t in tools))
        #: the tool names of each case (as `conversation_key` names them): a request with other tools matches none
        self.tool_sets = frozenset(names)

    def __len__(self) -> int:
        return len(self.by_id)

    def match(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Case | None:
        return self.by_key.get(conversation_key(messages, tools)) if self.by_key else None


# -- from a recording to cases (snapshot testing: the answer of the day becomes the reference) -----------


def loosened(value: str) -> list[str]:
    """A recorded string and its case and whitespace variants (for `--loosen-strings`)."""
    out = [value, value.strip(), " ".join(value.split()), value.lower(), value.upper(), value.title(),
           value.casefold()]
    return list(dict.fromkeys(out))


@dataclass
class Conversion:
    """What `from_records` made and why it left exchanges out."""

    cases: list[dict[str, Any]] = field(default_factory=list)
    duplicates: int = 0
    #: same conversation, another answer: the first answer is kept
    conflicts: int = 0
    filtered: int = 0
    #: exchanges that do not make a valid case (a call to a tool the request did not offer, arguments not JSON)
    invalid: list[str] = field(default_factory=list)


def _expected(message: dict[str, Any], loosen: bool) -> list[dict[str, Any]] | str:
    calls = message.get("tool_calls") or []
    if not calls:
        return NO_CALL
    out = []
    for call in calls:
        fn = call.get("function") or {}
        args = _args(fn.get("arguments"))
        if not isinstance(args, dict):
            raise CaseError(f"arguments of {fn.get('name')!r} are not a JSON object")
        out.append({"name": fn.get("name"), "arguments": {
            k: (loosened(v) if loosen and isinstance(v, str) else [v]) for k, v in args.items()}})
    return out


def from_records(records: Iterable[dict[str, Any]], *, prefix: str, category: str | None = None,
                 loosen: bool = False, tools: set[str] | None = None, tags: set[str] | None = None,
                 calls_only: bool = False) -> Conversion:
    """Recorded exchanges → case lines: an answer with tool calls expects those calls, a text answer "no call".
    De-duplicated by conversation (`conversation_key`); each case is checked with `parse_line`."""
    out = Conversion()
    seen: dict[str, Any] = {}
    for rec in records:
        request = rec.get("request") or {}
        messages, offered = request.get("messages") or [], request.get("tools") or []
        message = (rec.get("answer") or {}).get("message") or {}
        try:
            expected = _expected(message, loosen)
        except CaseError as exc:
            out.invalid.append(f"{rec.get('request_id')}: {exc}")
            continue
        called = [c["name"] for c in expected] if expected != NO_CALL else []
        auto = [*(f"tool:{n}" for n in dict.fromkeys(called)), "call" if called else "no_call",
                f"api:{rec.get('route', 'chat_completions')}"]
        if (calls_only and not called) or (tools is not None and not set(called) & tools) \
                or (tags is not None and not set(auto) & tags):
            out.filtered += 1
            continue
        key = conversation_key(messages, offered)
        if key in seen:
            if seen[key] == expected:
                out.duplicates += 1
            else:
                out.conflicts += 1
            continue
        seen[key] = expected
        line: dict[str, Any] = {"id": f"{prefix}-{key[:12]}"}
        if category:
            line["category"] = category
        line.update(tags=auto, messages=messages, tools=offered)
        if "tool_choice" in request:
            line["tool_choice"] = request["tool_choice"]
        line["expected"] = expected
        line["meta"] = {"recorded": rec.get("ts"), "request_id": rec.get("request_id"), "model": rec.get("model")}
        try:
            parse_line(line, category or prefix)
        except CaseError as exc:
            out.invalid.append(f"{rec.get('request_id')}: {exc}")
            continue
        out.cases.append(line)
    return out
