"""Function calls parsed back out of a model's text answer, in strict (BFCL) or lenient mode.

`parse_strict` accepts exactly what BFCL V4's prompting decoder accepts and fails where it fails:
the text is stripped of backticks/newlines/spaces and wrapped in `[ ]`, the first
`<TOOLCALL>…</TOOLCALL>` is taken when the tag is on, then per format: python call syntax
(`toolquake.bfcl.decode.decode_python`), json (BFCL's two regexes; invalid JSON is *no calls*, not a decode
failure), or the first `<functions>…</functions>` block as XML with values converted by their
`type` attribute. A failure is `decoder_failed`; a decoded value that is not a list of
`{name: {params}}` is `decoder_wrong_output_format`.

`parse_lenient` additionally accepts the near-misses that BFCL V4's format-sensitivity study
documents, and says which one fired:

- `code_fence`: calls inside a ```` ```lang ```` fence (BFCL fails on a fence with a language tag);
- `per_call_toolcall`, `per_call_functions`, `per_call_block`: each call wrapped in its own
  `<TOOLCALL>`, `<functions>` or JSON list (BFCL keeps only the first);
- `python_no_brackets`: python calls one per line, without the list brackets;
- `unclosed_tag`: a `<TOOLCALL>`, `<functions>`, `<function>` or `<params>` that is never closed,
  where the place of the missing end tag is unambiguous;
- `xml_type_from_schema`: an XML value whose `type` is not one of BFCL's names (`int`, `str`, …),
  is missing, or does not convert, typed by the function's schema instead;
- `json_nested_objects`: a JSON call whose argument holds a list of objects (BFCL's regex cuts the
  text at the first `}]` and decodes no calls);
- `json_bare_object`: one JSON call object, not in a list, inside `<TOOLCALL>`;
- `reasoning_block`: the answer starts with a reasoning model's `<think>…</think>` (BFCL's handlers
  for such models drop it before decoding; its generic decoder does not).

`parse_live` is not a BFCL decoder: it gives an agent's client every call to a function the client
offered, wherever the model wrote it (prose, fences, a missing `<TOOLCALL>`), with positional python
arguments named by the parameter order of the tool's schema; calls to other functions are left out.
Grading never reads it.

Python call syntax is read by the one parser of `toolquake.bfcl.pycall` (BFCL's value rules), JSON values in
text are found by the one scanner of `toolquake.bfcl.jsonscan`: both shared with BFCL's decoder and the
conformance checker. A call is `{"name": str, "arguments": dict}` with values as decoded (tuples stay tuples).
"""

from __future__ import annotations

import ast
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from toolquake.bfcl.jsonscan import json_values
from toolquake.bfcl.pycall import bfcl_call, call_spans, expression_calls, statement_calls

DECODER_FAILED = "decoder_failed"
WRONG_OUTPUT_FORMAT = "decoder_wrong_output_format"
LENIENCIES = ("code_fence", "per_call_toolcall", "per_call_functions", "per_call_block", "python_no_brackets",
              "unclosed_tag", "xml_type_from_schema", "json_nested_objects", "json_bare_object", "reasoning_block")

_TOOLCALL = re.compile(r"<TOOLCALL>(.*?)</TOOLCALL>", re.DOTALL)
_FUNCTIONS = re.compile(r"<functions>(.*?)</functions>", re.DOTALL)
_CLOSING = {_TOOLCALL: "</TOOLCALL>", _FUNCTIONS: "</functions>"}
# BFCL's json regexes are `\[.*\]` (greedy) and then `\[\s*{.*?}\s*(?:,\s*{.*?}\s*)*\]` (lazy); the second
# backtracks exponentially on an unclosed list, so both are computed directly: the first spans the first
# `[` to the last `]`; the second, when it matches at all, spans the first `[{` to the first `}]` after it
_JSON_OPEN = re.compile(r"\[\s*{")
_JSON_CLOSE = re.compile(r"}\s*]")
_FENCE = re.compile(r"```[A-Za-z0-9_+.-]*")
# an XML tag is `<`, an optional `/`, a name `[A-Za-z_][\w.:-]*`, then `>`, `/>`, or whitespace and any text
# without `<`/`>` up to the first `>` (`/>` makes it self-closing). Found by `_xml_tags` in linear time (the
# regex `<(/?)([A-Za-z_][\w.:-]*)((?:\s+[^<>]*?)?)(/?)>` was quadratic on `<a` and a long whitespace run)
_XML_NAME = re.compile(r"[A-Za-z_][\w.:-]*")
_BFCL_XML_TYPES = ("string", "integer", "float", "boolean", "null", "array", "tuple", "object", "dict")
#: end tags lenient parsing may add where a model forgot them
_AUTO_CLOSE = ("functions", "function", "params")

Schemas = dict[str, dict[str, Any]]  # function name → {param name: JSON schema}


class DecodeError(ValueError):
    """The text does not decode into calls."""


@dataclass(frozen=True)
class Decoded:
    """The outcome of parsing one answer."""

    ok: bool
    calls: list[dict[str, Any]] = field(default_factory=list)
    #: `decoder_failed` or `decoder_wrong_output_format` (BFCL's error names) when not ok
    error: str | None = None
    detail: str = ""
    #: the leniencies that made the difference (lenient mode only; empty when strict would agree)
    leniencies: tuple[str, ...] = ()

    @property
    def has_calls(self) -> bool:
        return self.ok and bool(self.calls)

    def summary(self) -> dict[str, Any]:
        """JSON-safe facts for reports: ok, error, number of calls, leniencies."""
        out: dict[str, Any] = {"ok": self.ok, "calls": len(self.calls)}
        if self.error:
            out["error"] = self.error
            out["detail"] = self.detail
        if self.leniencies:
            out["leniencies"] = list(self.leniencies)
        return out


def _failed(exc: Exception, error: str = DECODER_FAILED) -> Decoded:
    return Decoded(False, [], error, f"{type(exc).__name__}: {exc}"[:300])


# --- shared steps ---------------------------------------------------------------------------------

def _tag_blocks(pattern: re.Pattern[str], text: str) -> list[re.Match[str]]:
    """`pattern.finditer(text)` in linear time: the lazy `<tag>(.*?)</tag>` search is quadratic over
    openings that no end tag follows, and none of those can match, so the text after the last end
    tag is left out of the search (same matches)."""
    closing = _CLOSING[pattern]
    end = text.rfind(closing)
    return list(pattern.finditer(text, 0, end + len(closing))) if end >= 0 else []


def _tag_block(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """`pattern.search(text)` in linear time (see _tag_blocks)."""
    closing = _CLOSING[pattern]
    end = text.rfind(closing)
    return pattern.search(text, 0, end + len(closing)) if end >= 0 else None


def _as_calls(decoded: Any) -> list[dict[str, Any]]:
    """BFCL's output-format check: a list of one-key dicts whose value is a dict."""
    if not isinstance(decoded, list):
        raise _WrongFormat(f"decoded a {type(decoded).__name__}, not a list")
    calls = []
    for item in decoded:
        if not (isinstance(item, dict) and len(item) == 1):
            raise _WrongFormat("an element is not a one-key {name: params} dict")
        ((name, args),) = item.items()
        if not isinstance(args, dict):
            raise _WrongFormat(f"the parameters of {name!r} are a {type(args).__name__}, not a dict")
        calls.append({"name": name, "arguments": args})
    return calls


class _WrongFormat(Exception):
    pass


def _run(decode: Callable[[], Any]) -> Decoded:
    try:
        raw = decode()
    except Exception as exc:  # any decoding exception is BFCL's decoder_failed
        return _failed(exc)
    try:
        return Decoded(True, _as_calls(raw))
    except _WrongFormat as exc:
        return Decoded(False, [], WRONG_OUTPUT_FORMAT, str(exc))


# --- python ---------------------------------------------------------------------------------------

def _python(text: str, tool_call_tag: bool = False) -> list[dict[str, Any]]:
    """BFCL's python decoding of a whole answer (`toolquake.bfcl.decode`), as {name: arguments} items."""
    from toolquake.bfcl.decode import DecodeFailure, decode_python

    if tool_call_tag and _tag_block(_TOOLCALL, text) is None:  # spares decode_python a quadratic search
        raise DecodeError("no <TOOLCALL>…</TOOLCALL> block")
    calls = decode_python(text, tool_call_tag)
    if isinstance(calls, DecodeFailure):
        raise DecodeError(calls.reason)
    return [{c["name"]: c["arguments"]} for c in calls]


def _python_segment(segment: str, tagged: bool) -> list[dict[str, Any]]:
    """One segment decoded as BFCL decodes an answer that is only this segment (in its tag if tagged)."""
    return _python(f"<TOOLCALL>{segment}</TOOLCALL>" if tagged else segment, tagged)


# --- json -----------------------------------------------------------------------------------------

def _json_elements(data: Any) -> list[dict[str, Any]]:
    out = []
    for element in data:  # a dict iterates over its keys and a str over its characters: both are skipped
        if isinstance(element, dict):
            out.append({element["function"]: element["parameters"]})
    return out


def _json_list_text(text: str) -> str:
    """What BFCL's two json regexes leave of `text` (see _JSON_OPEN), in linear time."""
    first, last = text.find("["), text.rfind("]")
    if first != -1 and last > first:
        text = text[first:last + 1]
    opening = _JSON_OPEN.search(text)
    if opening:
        closing = _JSON_CLOSE.search(text, opening.end())
        if closing:
            text = text[opening.start():closing.end()]
    return text


def _json_body(text: str) -> list[dict[str, Any]]:
    text = _json_list_text(text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    return _json_elements(data)


# --- xml ------------------------------------------------------------------------------------------

def _bfcl_value(raw: str, kind: str) -> Any:
    if kind == "string":
        return raw
    if kind == "integer":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "boolean":
        return raw.lower() == "true"
    if kind == "null":
        return None
    if kind in ("array", "tuple", "object", "dict"):
        return ast.literal_eval(raw)
    return raw


Typer = Callable[[str, str | None, str, str | None], Any]  # (raw, type attr, function, param) → value


def _strict_typer(raw: str, kind: str | None, function: str, param: str | None) -> Any:
    return _bfcl_value(raw, kind if kind is not None else "string")


def _xml_params(function: ET.Element, concise: bool) -> list[ET.Element]:
    if concise:
        return function.findall("param")
    container = function.find("params")
    return container.findall("param") if container is not None else function.findall("param")


def _xml_body(block: str, concise: bool, typer: Typer = _strict_typer) -> list[dict[str, Any]]:
    root = ET.fromstring(block)
    out = []
    for function in root.findall("function"):
        name = function.attrib["name"]
        args: dict[Any, Any] = {}
        for param in _xml_params(function, concise):
            if concise:
                pname = param.attrib["name"]
                raw = (param.text or "").strip()
            else:
                pname = param.attrib.get("name")
                raw = param.attrib.get("value", "")
            args[pname] = typer(raw, param.attrib.get("type"), name, pname)
        out.append({name: args})
    return out


def _xml_first_block(text: str) -> str:
    m = _tag_block(_FUNCTIONS, text)
    if not m:
        raise DecodeError("no <functions>…</functions> block")
    return m.group(0)


# --- strict ---------------------------------------------------------------------------------------

def _strict_raw(text: str, return_format: str, tool_call_tag: bool) -> Any:
    from toolquake.bfcl.decode import prepare_text

    if return_format == "python":
        return _python(text, tool_call_tag)
    if tool_call_tag and _tag_block(_TOOLCALL, text) is None:  # spares prepare_text a quadratic search
        raise DecodeError("no <TOOLCALL>…</TOOLCALL> block")
    text = prepare_text(text, tool_call_tag)
    if return_format == "json":
        return _json_body(text)
    if return_format in ("verbose_xml", "concise_xml"):
        return _xml_body(_xml_first_block(text), return_format == "concise_xml")
    raise ValueError(f"unknown return format {return_format!r}")


def parse_strict(text: str, return_format: str, tool_call_tag: bool = False) -> Decoded:
    """Decode `text` exactly as BFCL V4 decodes a prompting model's answer."""
    return _run(lambda: _strict_raw(text, return_format, tool_call_tag))


# --- lenient --------------------------------------------------------------------------------------

def _segments(text: str, tool_call_tag: bool, fired: list[str]) -> list[str]:
    """The pieces of text that hold calls: every <TOOLCALL> block when tagged, else the whole text."""
    if not tool_call_tag:
        return [text]
    blocks = [m.group(1).strip() for m in _tag_blocks(_TOOLCALL, text)]
    last_close = text.rfind("</TOOLCALL>")
    tail_open = text.find("<TOOLCALL>", last_close + 1 if last_close >= 0 else 0)
    if tail_open >= 0:  # an opening tag never closed: the rest of the answer is its content
        blocks.append(text[tail_open + len("<TOOLCALL>"):].strip("`\n "))
        fired.append("unclosed_tag")
    if not blocks:
        raise DecodeError("no <TOOLCALL> block")
    if len(blocks) > 1:
        fired.append("per_call_toolcall")
    return blocks


def _unfence(text: str, fired: list[str]) -> str:
    if "```" not in text:
        return text
    fired.append("code_fence")
    return _FENCE.sub("", text).strip()


def _python_statements(text: str) -> list[dict[str, Any]]:
    """Calls written one per line (or `;`-separated) without list brackets, decoded as BFCL decodes the same
    calls in one bracketed list (`pycall.statement_calls`), in or out of a <TOOLCALL> block alike."""
    try:
        return [{c["name"]: c["arguments"]} for c in map(_bfcl_call, statement_calls(text))]
    except Exception as exc:  # noqa: BLE001 — as in BFCL's decoder, any failure is a decode failure
        raise DecodeError(f"{type(exc).__name__}: {exc}"[:300]) from None


def _bfcl_call(node: ast.expr) -> dict[str, Any]:
    if not isinstance(node, ast.Call):
        raise DecodeError(f"list element is not a call: {type(node).__name__}")
    return bfcl_call(node)


def _python_lenient(segment: str, tagged: bool, fired: list[str], strict: Decoded | None) -> list[dict[str, Any]]:
    """`strict`: the strict decode of this very segment when it is the whole (untagged) answer."""
    if strict is not None and strict.ok:
        return [{c["name"]: c["arguments"]} for c in strict.calls]
    strict_failed = strict is not None
    notes: list[str] = []
    unfenced = _unfence(segment, notes)
    attempts = [] if strict_failed else [(segment, ())]
    if notes:
        attempts.append((unfenced, tuple(notes)))
    first_error: Exception = DecodeError("not python call syntax")
    for n, (candidate, used) in enumerate(attempts):
        try:
            result = _python_segment(candidate, tagged)
        except DecodeError as exc:
            first_error = exc if n == 0 else first_error
            continue
        fired.extend(used)
        return result
    if "\n" not in unfenced.strip() and ";" not in unfenced:  # statements need a separator
        raise first_error
    try:
        result = _python_statements(unfenced.strip())
    except DecodeError:
        raise first_error from None
    fired.extend(notes)
    fired.append("python_no_brackets")
    return result


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON array or object in `text`, left to right (a broken value: the next one is looked for
    after the break), in linear time (`jsonscan.json_values`)."""
    return [value for _, _, value in json_values(text, skip_broken=True)]


def _is_call_object(value: Any) -> bool:
    return isinstance(value, dict) and "function" in value


def _json_lenient(segment: str, tagged: bool, fired: list[str]) -> list[dict[str, Any]]:
    from toolquake.bfcl.decode import prepare_text

    strict = _json_body(segment if tagged else prepare_text(segment))
    values = [v for v in _json_values(segment)
              if (isinstance(v, list) and any(_is_call_object(e) for e in v)) or _is_call_object(v)]
    calls: list[dict[str, Any]] = []
    for v in values:
        calls.extend(_json_elements(v if isinstance(v, list) else [v]))
    if not calls or repr(calls) == repr(strict):
        return strict
    if len(values) > 1:
        fired.append("per_call_block")
    if any(isinstance(v, dict) for v in values):
        fired.append("json_bare_object")
    if not strict and any(isinstance(v, list) for v in values):
        fired.append("json_nested_objects")
    return calls


def _xml_tags(block: str) -> Iterator[tuple[int, int, bool, str, bool]]:
    """Each tag of `block` (see `_XML_NAME`) as (start, end, closing, name, self-closing), left to right.

    Linear: a tag's text holds no `<`, so each try at a `<` reads only up to the next `<`."""
    n = len(block)
    at = block.find("<")
    while at >= 0:
        closing = block.startswith("/", at + 1)
        m = _XML_NAME.match(block, at + 1 + closing)
        name = m.group(0) if m is not None else ""
        end = -1
        if m is not None and m.end() < n:
            after = m.end()
            c = block[after]
            if c == ">":
                end = after + 1
            elif c == "/":
                end = after + 2 if block.startswith(">", after + 1) else -1
            elif c.isspace():  # str.isspace is the regex `\s` on str
                following = block.find("<", after)
                gt = block.find(">", after, n if following < 0 else following)
                end = gt + 1 if gt >= 0 else -1
        if end < 0:
            at = block.find("<", at + 1)
            continue
        yield at, end, closing, name, block[end - 2] == "/"
        at = block.find("<", end)


def _close_tags(block: str, fired: list[str]) -> str:
    """Insert end tags a model forgot, where their place is unambiguous; DecodeError otherwise."""
    out: list[str] = []
    stack: list[str] = []
    pos = 0
    for start, end, closing, name, selfclosing in _xml_tags(block):
        out.append(block[pos:start])
        pos = end
        if not selfclosing and not closing:
            stack.append(name)
        elif closing and stack and stack[-1] == name:
            stack.pop()
        elif closing:
            if name not in stack:
                raise DecodeError(f"</{name}> does not close an open element")
            at = len(stack) - 1 - stack[::-1].index(name)
            missing = stack[at + 1:]
            if any(n not in _AUTO_CLOSE for n in missing):
                raise DecodeError(f"<{missing[-1]}> is never closed")
            out.extend(f"</{n}>" for n in reversed(missing))
            del stack[at:]
        out.append(block[start:end])
    out.append(block[pos:])
    if any(n not in _AUTO_CLOSE for n in stack):
        raise DecodeError(f"<{stack[-1]}> is never closed")
    out.extend(f"</{n}>" for n in reversed(stack))
    repaired = "".join(out)
    if repaired != block:
        fired.append("unclosed_tag")
    return repaired


def _xml_blocks(segment: str, fired: list[str]) -> list[str]:
    blocks = [m.group(0) for m in _tag_blocks(_FUNCTIONS, segment)]
    last_close = segment.rfind("</functions>")
    tail_open = segment.find("<functions>", last_close + 1 if last_close >= 0 else 0)
    if tail_open >= 0:
        blocks.append(segment[tail_open:].rstrip("`\n ]"))
    if not blocks:
        raise DecodeError("no <functions> block")
    if len(blocks) > 1:
        fired.append("per_call_functions")
    return blocks


def _schema_type(schema: dict[str, Any] | None) -> str | None:
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _schema_value(raw: str, kind: str | None) -> Any:
    if kind == "integer":
        try:
            return int(raw)
        except ValueError:
            number = float(raw)
            if not number.is_integer():
                raise
            return int(number)
    if kind in ("number", "float"):
        return float(raw)
    if kind == "boolean":
        flag = raw.strip().lower()
        if flag not in ("true", "false"):
            raise DecodeError(f"{raw!r} is not a boolean")
        return flag == "true"
    if kind in ("array", "tuple", "object", "dict"):
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = json.loads(raw)
        return tuple(value) if kind == "tuple" and isinstance(value, list) else value
    return raw


def _lenient_typer(schemas: Schemas, fired: list[str]) -> Typer:
    def typed(raw: str, kind: str | None, function: str, param: str | None) -> Any:
        schema = (schemas.get(function) or {}).get(param) if param is not None else None
        if kind in _BFCL_XML_TYPES:
            try:
                return _bfcl_value(raw, kind)
            except (ValueError, SyntaxError):
                if schema is None:
                    raise
        if schema is None:
            return raw
        try:
            value = _schema_value(raw, _schema_type(schema))
        except (ValueError, SyntaxError):
            if kind in _BFCL_XML_TYPES:
                raise
            return raw
        if repr(value) != repr(raw):
            fired.append("xml_type_from_schema")
        return value

    return typed


def _xml_lenient(segment: str, concise: bool, schemas: Schemas, fired: list[str]) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    typer = _lenient_typer(schemas, fired)
    for block in _xml_blocks(segment, fired):
        try:
            ET.fromstring(block)
        except ET.ParseError:
            block = _close_tags(block, fired)
        calls.extend(_xml_body(block, concise, typer))
    return calls


def _lenient_raw(text: str, return_format: str, tool_call_tag: bool, schemas: Schemas, strict: Decoded,
                 fired: list[str]) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    seen: Decoded | None = None if tool_call_tag else strict  # what strict decoding made of the whole answer
    end_of_thought = text.rfind("</think>")
    if end_of_thought >= 0:
        text = text[end_of_thought + len("</think>"):]
        fired.append("reasoning_block")
        seen = None
    for segment in _segments(text, tool_call_tag, fired):
        if return_format == "python":
            calls.extend(_python_lenient(segment, tool_call_tag, fired, seen))
        elif return_format == "json":
            calls.extend(_json_lenient(segment, tool_call_tag, fired))
        elif return_format in ("verbose_xml", "concise_xml"):
            calls.extend(_xml_lenient(segment, return_format == "concise_xml", schemas, fired))
        else:
            raise ValueError(f"unknown return format {return_format!r}")
    return calls


def parse_lenient(text: str, return_format: str, tool_call_tag: bool = False, schemas: Schemas | None = None,
                  strict: Decoded | None = None) -> Decoded:
    """Decode `text` like BFCL, also accepting the documented near-misses; says which leniency fired.

    `schemas` ({function: {param: JSON schema}}) types XML values whose `type` attribute is not
    one of BFCL's names. Whatever strict parsing accepts, lenient parsing accepts with the same
    calls unless a leniency recovers more.
    """
    strict = strict if strict is not None else parse_strict(text, return_format, tool_call_tag)
    fired: list[str] = []
    lenient = _run(lambda: _lenient_raw(text, return_format, tool_call_tag, schemas or {}, strict, fired))
    if not lenient.ok or (strict.ok and repr(lenient.calls) == repr(strict.calls)):
        return strict
    used = tuple(dict.fromkeys(n for n in fired))
    return Decoded(True, lenient.calls, leniencies=used)


def parse_both(text: str, return_format: str, tool_call_tag: bool = False,
               schemas: Schemas | None = None) -> tuple[Decoded, Decoded]:
    """Both verdicts for one answer: (strict, lenient)."""
    strict = parse_strict(text, return_format, tool_call_tag)
    return strict, parse_lenient(text, return_format, tool_call_tag, schemas, strict)


# --- live -----------------------------------------------------------------------------------------
# What an agent's client should get from a text answer: every call to a function it offered, wherever
# in the answer the model wrote it, with positional arguments named by the tool's parameter order.
# BFCL verdicts never use this decode (they use parse_strict / parse_lenient).

LIVE_NOTES = ("positional_args", "outside_format", "unoffered_function", "unfit_call", "first_call_only")
_PLACEHOLDER = "__toolquake_arg{}"


def _live_python_call(source: str, shown: str, params: list[str], notes: list[str]) -> dict[str, Any] | None:
    """One `name(…)` source as a call, positional arguments named by `params`; None when it does not fit."""
    try:
        (node,) = expression_calls(source, containers=())
    except (SyntaxError, ValueError):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args):
        return None
    written = [kw.arg for kw in node.keywords]
    if None in written or len(node.args) > len(params):
        return None
    named = params[:len(node.args)]
    if any(p in written for p in named):
        return None  # a parameter given twice
    # positional values go in as placeholder keywords (a parameter may be named like a python keyword)
    keywords = [ast.keyword(arg=_PLACEHOLDER.format(i), value=a) for i, a in enumerate(node.args)] + node.keywords
    try:
        decoded = bfcl_call(ast.Call(func=node.func, args=[], keywords=keywords))
    except Exception:  # noqa: BLE001 — a value BFCL's decoder refuses: the call does not fit
        return None
    real = {_PLACEHOLDER.format(i): p for i, p in enumerate(named)}
    if named:
        notes.append("positional_args")
    return {"name": shown, "arguments": {real.get(k, k): v for k, v in decoded["arguments"].items()}}


def _live_python(segment: str, offered: dict[str, str], schemas: Schemas, notes: list[str]) -> list[dict[str, Any]]:
    calls = []
    for written, start, end in call_spans(segment, list(offered)):
        shown = offered[written]
        source = "f" + segment[start + len(written):end]  # a tool name need not be a python name (`get-weather`)
        call = _live_python_call(source, shown, list(schemas.get(shown) or {}), notes)
        if call is not None:
            calls.append(call)
        else:
            notes.append("unfit_call")
    return calls


def _live_json_call(value: Any, offered: dict[str, str], schemas: Schemas, notes: list[str]) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    name = value.get("function", value.get("name"))
    args = value.get("parameters", value.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(name, str) or name not in offered:
        return None
    shown = offered[name]
    params = list(schemas.get(shown) or {})
    if isinstance(args, list) and len(args) <= len(params):
        notes.append("positional_args")
        args = dict(zip(params, args))
    if not isinstance(args, dict):
        notes.append("unfit_call")
        return None
    return {"name": shown, "arguments": args}


def _live_json(segment: str, offered: dict[str, str], schemas: Schemas, notes: list[str]) -> list[dict[str, Any]]:
    calls = []
    for value in _json_values(segment):
        for item in value if isinstance(value, list) else [value]:
            call = _live_json_call(item, offered, schemas, notes)
            if call is not None:
                calls.append(call)
    return calls


def _live_xml(segment: str, concise: bool, offered: dict[str, str], schemas: Schemas) -> list[dict[str, Any]]:
    try:
        found = _as_calls(_xml_lenient(segment, concise, schemas, []))
    except Exception:  # noqa: BLE001 — a block that does not decode holds no call for the client
        return []
    return [{"name": offered[c["name"]], "arguments": c["arguments"]} for c in found if c["name"] in offered]


def _live_segments(text: str, tool_call_tag: bool) -> list[str]:
    """Where to look: after a reasoning block; inside the <TOOLCALL> blocks when tagged and there are any."""
    end_of_thought = text.rfind("</think>")
    if end_of_thought >= 0:
        text = text[end_of_thought + len("</think>"):]
    if tool_call_tag:
        try:
            return _segments(text, True, [])
        except DecodeError:
            pass
    return [text]


def parse_live(text: str, return_format: str, tool_call_tag: bool, offered: dict[str, str],
               schemas: Schemas | None = None, lenient: Decoded | None = None, single: bool = False) -> Decoded:
    """The calls an agent's client should get from `text`: every call to an offered function, anywhere.

    `offered` maps each name the model may write (the name shown to it, the client's own name) to
    the shown name, which the calls carry. Python calls are found inside prose, code fences and tags
    alike, positional arguments named in the order of the function's `schemas` parameters; JSON call
    objects (`function`/`name` with `parameters`/`arguments`) wherever they are; XML as lenient
    parsing finds it. Calls to other functions are left out. `single` keeps the first call only.
    `lenient` (the lenient decode, when already made) only feeds the notes (`LIVE_NOTES`).
    """
    schemas = schemas or {}
    lenient = lenient if lenient is not None else parse_lenient(text, return_format, tool_call_tag, schemas)
    notes: list[str] = []
    calls: list[dict[str, Any]] = []
    from toolquake.perturbers.helpers.callformats import RETURN_FORMATS

    if return_format not in RETURN_FORMATS:
        raise ValueError(f"unknown return format {return_format!r}")
    for segment in _live_segments(text, tool_call_tag):
        try:
            if return_format == "python":
                calls.extend(_live_python(segment, offered, schemas, notes))
            elif return_format == "json":
                calls.extend(_live_json(segment, offered, schemas, notes))
            else:
                calls.extend(_live_xml(segment, return_format == "concise_xml", offered, schemas))
        except Exception:  # noqa: BLE001 — e.g. RecursionError on absurdly nested JSON: no call from this segment
            notes.append("unfit_call")
    if lenient.ok and any(c["name"] not in offered for c in lenient.calls):
        notes.append("unoffered_function")
    if calls and not lenient.has_calls:
        notes.append("outside_format")
    if single and len(calls) > 1:
        calls = calls[:1]
        notes.append("first_call_only")
    used = tuple(n for n in LIVE_NOTES if n in notes)
    if calls or lenient.ok:
        return Decoded(True, calls, leniencies=used)
    return Decoded(False, [], lenient.error, lenient.detail or "no call to an offered function", used)
