"""Model output → calls `[{"name": dotted_name, "arguments": {...}}]`, decoded as BFCL decodes it.

Two paths:
* `decode_python(text)`: BFCL's python call syntax (`[f(a=1), g(b='x')]`) through a safe walk of
  Python's AST (`pycall.py`, the one parser of call syntax), with BFCL's value-resolution rules and quirks
  (see docs/scoring.md). Nothing is ever evaluated: the arithmetic BFCL computes with `eval` is computed by
  a small evaluator that only accepts literal operands and refuses results that would be huge.
* `calls_from_message(message, name_map)`: an OpenAI chat-completions assistant message (native tool
  calls, the FC path); OpenAI names go back to the corpus's dotted names through `name_map`.

A failure is returned as a `DecodeFailure`, never raised.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from toolquake.bfcl.pycall import _Unsupported, bfcl_call, expression_calls

DECODER_FAILED = "ast_decoder:decoder_failed"
WRONG_OUTPUT_FORMAT = "ast_decoder:decoder_wrong_output_format"


class DecodeFailure(msgspec.Struct, frozen=True):
    """The model output could not be turned into calls (`error_type` is BFCL's decoder error)."""

    reason: str
    error_type: str = DECODER_FAILED


Calls = list[dict[str, Any]]

_TOOLCALL = re.compile(r"<TOOLCALL>(.*?)</TOOLCALL>", re.DOTALL)


def prepare_text(text: str, tool_call_tag: bool = False) -> str:
    """BFCL's pre-processing: strip backticks/newlines/spaces, wrap in [ ], optional <TOOLCALL> extraction.

    ValueError when a <TOOLCALL> block is required and missing.
    """
    text = text.strip("`\n ")
    if not text.startswith("["):
        text = "[" + text
    if not text.endswith("]"):
        text = text + "]"
    if tool_call_tag:
        # the lazy search is quadratic over openings no end tag follows, and none of those can match: the
        # text after the last end tag is left out of it (same match)
        closing = text.rfind("</TOOLCALL>")
        match = _TOOLCALL.search(text, 0, closing + len("</TOOLCALL>")) if closing >= 0 else None
        if match is None:
            raise _Unsupported("no <TOOLCALL>…</TOOLCALL> block")
        text = match.group(1).strip()
    return text


def decode_python(text: Any, tool_call_tag: bool = False) -> Calls | DecodeFailure:
    """BFCL's python call-syntax decoding (prompting models), without ever evaluating the text."""
    if not isinstance(text, str):
        return DecodeFailure(f"expected text, got {type(text).__name__}")
    try:
        source = prepare_text(text, tool_call_tag).strip().strip("'")
        return [bfcl_call(call) for call in expression_calls(source)]
    except Exception as exc:  # noqa: BLE001 — any failure to decode is a decode failure, as in BFCL
        return DecodeFailure(f"{type(exc).__name__}: {exc}"[:300])


def calls_from_message(message: dict[str, Any] | None, name_map: dict[str, str] | None = None
                       ) -> Calls | DecodeFailure:
    """An OpenAI assistant message → calls (FC path). A text answer is a DecodeFailure, as in BFCL."""
    names = name_map or {}
    if not isinstance(message, dict):
        return DecodeFailure("no assistant message")
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        content = message.get("content")
        if content == "" or content == []:
            return []
        return DecodeFailure("the model answered in text, with no tool call")
    if not isinstance(tool_calls, list):
        return DecodeFailure("tool_calls is not a list")
    calls: Calls = []
    for tc in tool_calls:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return DecodeFailure("a tool call without a function name")
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to decode
            return DecodeFailure(f"tool call arguments are not JSON: {exc}"[:300])
        if raw is None:
            return DecodeFailure("tool call without arguments")
        if not isinstance(args, dict):
            return DecodeFailure("tool call arguments are not a JSON object", WRONG_OUTPUT_FORMAT)
        calls.append({"name": names.get(fn["name"], fn["name"]), "arguments": args})
    return calls


def is_well_formed(calls: Any) -> bool:
    """BFCL's call-format check: a list of calls, each with a string name and an arguments dict."""
    if type(calls) is not list:
        return False
    for call in calls:
        if type(call) is not dict or type(call.get("arguments")) is not dict or type(call.get("name")) is not str:
            return False
    return True


# --- JSON values in free text, in linear time -----------------------------------------------------
# Finding the JSON values a model left in its text by calling `json.JSONDecoder.raw_decode` at every
# `{`/`[` is quadratic (each failure builds an error whose line number counts from the text's start, and
# a value nested in a broken one is scanned again from each of its openings). `JsonSpans` answers "where
# does the value that opens here end" with a scanner that follows `json`'s grammar (strict strings,
# NaN/Infinity, ASCII numbers) and remembers every container it has scanned: a container's extent does not
# depend on what surrounds it, so each character is scanned about once however many openings are asked.

_J_WS = re.compile(r"[ \t\n\r]*+")
#: an opening bracket that can start a value (what follows it may come next): the others fail at once
_J_OPENERS = re.compile(r'\{(?=[ \t\n\r]*+["}])|\[(?=[ \t\n\r]*+[-"\[\]{0-9tfnNI])')
#: one token after optional whitespace (its group): 1 an opening bracket, 2 a string, 3 a number or literal,
#: 4 a closing bracket, 5 a comma, 6 a colon
_J_TOKEN = re.compile(r'[ \t\n\r]*+(?:([\[{])|("(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+")|'
                      r"(-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][-+]?[0-9]++)?|true|false|null|NaN|Infinity|"
                      r"-Infinity)|([\]}])|(,)|(:))")
_J_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+')
#: containers nested deeper than this inside one value are not decoded (json's own limit is about 1,000)
JSON_MAX_DEPTH = 200
_FIRST, _VALUE, _KEY, _COLON, _NEXT = range(5)  # what the scanner expects next
_CLOSER = {"[": "]", "{": "}"}


class JsonSpans:
    """`end(start)`: the index just past the JSON array or object that opens at `text[start]`, as
    `json.JSONDecoder().raw_decode(text, start)` would decode it, or -1 where it would fail (or where the
    value nests deeper than JSON_MAX_DEPTH). `fail_at(start)`: where the scan of a failed value stopped."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._end: dict[int, int] = {}
        self._fail: dict[int, int] = {}

    def openers(self, pos: int = 0) -> Any:
        """The positions from `pos` of the `[` and `{` that may open a value, in order (`end` of the others
        is -1)."""
        return (m.start() for m in _J_OPENERS.finditer(self.text, pos))

    def scanned(self) -> list[int]:
        """The starts of the values scanned so far that end, in order (after `end(0)` on a fresh instance whose
        text is one value: that value and every value nested in it, not the brackets inside its strings)."""
        return sorted(k for k, v in self._end.items() if v >= 0)

    def fail_at(self, start: int) -> int:
        """Where the scan of the failed value at `start` stopped (json's error position, near enough)."""
        return self._fail.get(start, start)

    def end(self, start: int) -> int:
        known = self._end.get(start)
        if known is None:
            self._scan(start)
            known = self._end.get(start, -1)
        return known

    def _scan(self, start: int) -> None:
        text, ends, token = self.text, self._end, _J_TOKEN.match
        stack = [start]  # the open containers' starts
        i, state = start + 1, _FIRST
        while True:
            m = token(text, i)
            if m is None:  # a broken string or no token: where json would stop is found below
                break
            kind = m.lastindex
            top = text[stack[-1]]
            if kind == 4:  # a closing bracket: after a value, or right after the opening
                if state not in (_FIRST, _NEXT) or text[m.end() - 1] != _CLOSER[top]:
                    break
                ends[stack.pop()] = i = m.end()
                if not stack:
                    return
                state = _NEXT
            elif state == _NEXT:  # "," then a value (or a key)
                if kind != 5:
                    break
                i, state = m.end(), _KEY if top == "{" else _VALUE
            elif state == _COLON:
                if kind != 6:
                    break
                i, state = m.end(), _VALUE
            elif state == _KEY or (state == _FIRST and top == "{"):
                if kind != 2:
                    break
                i, state = m.end(), _COLON
            elif kind == 1:  # a value that is a container
                at = m.end() - 1
                known = ends.get(at)
                if known is not None and known >= 0:
                    i, state = known, _NEXT
                elif known is not None or len(stack) >= JSON_MAX_DEPTH:
                    i = at
                    break
                else:
                    stack.append(at)
                    i, state = at + 1, _FIRST
            elif kind in (2, 3):
                i, state = m.end(), _NEXT
            else:
                break
        i = _J_WS.match(text, i).end()  # type: ignore[union-attr]
        if m is None and state not in (_NEXT, _COLON) and text.startswith('"', i):
            # a broken string: json names its bad character, or its quote when it is never closed
            bad = _J_STRING_BODY.match(text, i + 1).end()  # type: ignore[union-attr]
            i = bad if bad < len(text) - text.startswith("\\", bad) else i
        for open_at in stack:  # each open value, scanned alone, stops at the same place
            ends[open_at] = -1
            self._fail[open_at] = i
