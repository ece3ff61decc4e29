"""The conformance rules: one short, stable name each (the `rule` label), and what a violation carries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

#: rule name → what it checks (docs/conformance.md says the same, with the bug reports behind each)
RULES: dict[str, str] = {
    "chunk_invalid_json": "every `data:` payload of a stream (other than `[DONE]`) is a JSON object",
    "delta_missing_index": "every streamed tool-call delta is keyed to a call: chat `index`, Responses "
                           "`output_index`/`item_id` of an opened function_call item",
    "call_missing_id": "a call has an id: the first delta of a streamed chat call, each `tool_calls` entry, "
                       "each Responses function_call item (`call_id`)",
    "call_missing_type": "a chat call says `type: \"function\"` (its first delta, or its entry)",
    "call_missing_name": "a call has `function.name` (Responses: `name`) in its first delta or entry",
    "delta_not_append": "later deltas of a chat call only append `function.arguments`: no second id or name "
                        "(clients concatenate them)",
    "arguments_not_string": "`arguments` is a JSON-encoded string, not an object",
    "arguments_empty": "`arguments` is never empty: a call without parameters has `{}`",
    "arguments_invalid_json": "the arguments (streamed fragments joined) are a JSON object",
    "arguments_schema": "the arguments match the offered tool's parameter schema (required present, types)",
    "call_unknown_tool": "a call names a tool the request offered",
    "finish_reason_not_tool_calls": "a chat answer with calls ends with `finish_reason: \"tool_calls\"`",
    "finish_reason_without_calls": "`finish_reason: \"tool_calls\"` only when the answer has calls",
    "done_mismatch": "a Responses call's `arguments.done`, `output_item.done` and `response.completed` forms "
                     "say what its deltas said (arguments, name, call_id)",
    "call_in_content_hermes": "no call left in the text as `<tool_call>…</tool_call>` (the server's parser "
                              "missed it)",
    "call_in_content_pythonic": "no call left in the text as a Python-style list `[f(a=1)]` naming an offered tool",
    "call_in_content_json": "no call left in the text as a JSON object naming an offered tool",
}
#: the rules a `repair` step can fix (a call left in the text)
CONTENT_RULES = ("call_in_content_hermes", "call_in_content_pythonic", "call_in_content_json")
EXCERPT_CHARS = 200


@dataclass
class Violation:
    """One broken rule in one answer. `detail` names positions and tool names only (never contents);
    `excerpt` is the offending text (a delta, arguments, the text around a call), kept only where contents are."""

    rule: str
    detail: str
    excerpt: str = ""
    call: int | None = None

    def as_dict(self, contents: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "detail": self.detail, "call": self.call}
        if contents:
            out["excerpt"] = self.excerpt
        return out


def excerpt(value: Any) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode("utf-8", "replace")
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS - 1] + "…"


def short(name: Any) -> str:
    """A tool name as it may appear in a detail (names come from the model: kept short)."""
    text = str(name)
    return text if len(text) <= 64 else text[:63] + "…"
