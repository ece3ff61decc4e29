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

