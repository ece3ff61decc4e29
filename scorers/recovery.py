"""Recovery after a failed tool result: what the model's next answer did, as one deterministic verdict.

Input: the request as the model saw it (chat-shaped, the failure in place of the tool result), the
index of the failed `tool` message, the failure's kind, and the model's answer message. The verdicts:

* `retried` — a call to the failed function with compatible arguments (every argument both calls
  have is equal);
* `requeried` — a call to the failed function with other arguments;
* `invented` — a text answer, or a call to another function, carrying a number that appears nowhere
  in what the model was sent (messages and tools): data the failed tool never gave it;
* `reported` — a text answer that says something went wrong (the words of `FAILURE_WORDS` for every
  kind, or of `KIND_WORDS` for this kind);
* `answered` — a text answer that neither reports the failure nor invents a number;
* `other_call` — calls to other functions only, without an invented number;
* `no_answer` — neither calls nor text.

Numbers are compared by value (`1,200` = `1200` = `1200.0`); single-digit integers are not data (they
are too common in prose: "1 file", "step 2") and a list marker at the start of a line is skipped.
Which verdicts count as recovered depends on the kind (`RECOVERED`, after the tool_failure
perturber's `expected_behaviour`, docs/perturbers-faults.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

VERDICTS = ("retried", "requeried", "reported", "answered", "invented", "other_call", "no_answer")

#: per failure kind, the verdicts that are the right behaviour (never `invented`)
RECOVERED: dict[str, frozenset[str]] = {
    # retry the same call, or tell the user; never invent the result
    "timeout": frozenset({"retried", "reported"}),
    "rate_limit": frozenset({"retried", "reported"}),
    "server_error": frozenset({"retried", "reported"}),
    # notice the cut: re-query (same or other arguments) or report what is missing
    "truncated": frozenset({"retried", "requeried", "reported"}),
    # say nothing was returned, or re-query with other arguments
    "empty": frozenset({"requeried", "reported"}),
    # read the renamed fields (an answer or the next call from them), or re-query, or report the change
    "schema_drift": frozenset({"retried", "requeried", "reported", "answered", "other_call"}),
}
#: for a kind not in RECOVERED
DEFAULT_RECOVERED = frozenset({"retried", "reported"})

#: words that report a failure, for every kind (matched case-insensitively at a word start)
FAILURE_WORDS = ("error", "fail", "unable", "could not", "couldn't", "cannot", "can't", "unavailable",
                 "not available", "try again", "retry", "problem", "issue", "went wrong", "unsuccessful")
#: words that report this kind of failure
KIND_WORDS: dict[str, tuple[str, ...]] = {
    "timeout": ("timed out", "time out", "timeout", "timed-out", "no response", "did not respond", "didn't respond",
                "not responding", "took too long"),
    "rate_limit": ("rate limit", "rate-limit", "too many requests", "429", "throttl", "retry after", "wait"),
    "server_error": ("server", "500", "502", "503", "internal", "bad gateway", "service"),
    "truncated": ("truncat", "cut off", "cut short", "incomplete", "partial", "malformed", "invalid", "corrupt",
                  "missing", "garbled"),
    "empty": ("empty", "no result", "nothing", "no data", "returned no", "did not return", "didn't return",
              "no matching", "none", "not find", "not found", "no records", "no entries"),
    "schema_drift": ("schema", "format", "renamed", "changed", "structure", "unexpected"),
}

_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.])-?\d+(?:\.\d+)?")
_LIST_MARKER = re.compile(r"^\s*\d+[.)]\s", re.MULTILINE)


@dataclass(frozen=True)
class Recovery:
    """The verdict on one answer after one failed tool result."""

    kind: str
    verdict: str
    recovered: bool
    tool: str = ""
    #: the numbers an `invented` answer carried that the model was never sent
    invented: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "tool": self.tool, "verdict": self.verdict,
                               "recovered": self.recovered}
        if self.invented:
            out["invented"] = list(self.invented)
        return out


def recovered(kind: str, verdict: str) -> bool:
    return verdict in RECOVERED.get(kind, DEFAULT_RECOVERED)


def _value(token: str) -> float | None:
    try:
        return float(token.replace(",", ""))
    except ValueError:
        return None


def numbers(text: str) -> dict[float, str]:
    """The numbers in a text that count as data: value → first spelling (single-digit integers left out)."""
    out: dict[float, str] = {}
    for m in _NUMBER.finditer(text):
        token = m.group(0)
        digits = token.lstrip("-").replace(",", "")
        if "." not in digits and len(digits) < 2:
            continue
        v = _value(token)
        if v is not None:
            out.setdefault(abs(v), token)
    return out


def _all_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def seen_numbers(request: dict[str, Any]) -> set[float]:
    """Every number in what the model was sent: its messages (contents and call arguments) and its tools."""
    found: set[float] = set()
    for part in (request.get("messages") or [], request.get("tools") or []):
        found.update(numbers(_all_text(part)))
    return found


def _arguments(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
            return None
        return value if isinstance(value, dict) else None
    return None


def failed_call(messages: list[dict[str, Any]], index: int) -> tuple[str, dict[str, Any] | None]:
    """(function name, arguments) of the call whose result is `messages[index]`; ("", None) when unknown."""
    if not 0 <= index < len(messages):
        return "", None
    call_id = str((messages[index] or {}).get("tool_call_id", ""))
    for msg in reversed(messages[:index]):
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            for call in msg.get("tool_calls") or []:
                if isinstance(call, dict) and str(call.get("id", "")) == call_id:
                    fn = call.get("function") or {}
                    return str(fn.get("name", "")), _arguments(fn.get("arguments"))
    return "", None


def answer_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]]:
    out = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") or {}
            out.append((str(fn.get("name", "")), _arguments(fn.get("arguments"))))
    return out


def answer_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _compatible(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _invented(texts: Iterable[str], seen: set[float]) -> tuple[str, ...]:
    out: list[str] = []
    for text in texts:
        for value, token in numbers(_LIST_MARKER.sub(" ", text)).items():
            if value not in seen and token not in out:
                out.append(token)
    return tuple(out)


def reports_failure(text: str, kind: str) -> bool:
    """True when the text says something went wrong (FAILURE_WORDS, or KIND_WORDS of this kind)."""
    lower = text.lower()
    return any(re.search(r"(?<![a-z])" + re.escape(w), lower) for w in (*FAILURE_WORDS, *KIND_WORDS.get(kind, ())))


def classify(request: dict[str, Any], index: int, kind: str, message: dict[str, Any],
             seen: set[float] | None = None) -> Recovery:
    """The verdict on `message` (the model's answer) after the failed tool result `request["messages"][index]`.

    `seen` (the numbers of `seen_numbers(request)`) may be passed to share it between failures of one request.
    """
    messages = request.get("messages") or []
    name, args = failed_call(messages, index)
    seen = seen_numbers(request) if seen is None else seen
    calls = answer_calls(message)
    text = answer_text(message)

    def verdict(v: str, invented: tuple[str, ...] = ()) -> Recovery:
        return Recovery(kind, v, recovered(kind, v), name, invented)

    if calls:
        same = [a for n, a in calls if n == name and name]
        if any(_compatible(a, args) for a in same):
            return verdict("retried")
        if same:
            return verdict("requeried")
        invented = _invented((_all_text(a) for _, a in calls if a), seen)
        return verdict("invented", invented) if invented else verdict("other_call")
    if not text.strip():
        return verdict("no_answer")
    invented = _invented([text], seen)
    if invented:
        return verdict("invented", invented)
    return verdict("reported" if reports_failure(text, kind) else "answered")


def after_last_answer(messages: list[dict[str, Any]], indexes: Iterable[int]) -> list[int]:
    """The indexes that come after the last assistant message: the results the next answer reacts to
    (a failure kept from an earlier turn was answered at that turn)."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=-1)
    return sorted(i for i in set(indexes) if i > last)
