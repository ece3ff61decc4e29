"""tool_failure: replaces a tool result with a realistic failure (timeout, rate limit, server error, truncated,
empty or drifted result), so an agent's recovery can be watched (docs/perturbers-faults.md).

Chat `tool` messages and Responses `function_call_output` items (they arrive here as `tool` messages) are
handled alike. Draws come from the step's RNG, which the proxy seeds per conversation: every turn of one
conversation decides the same way for the same tool result.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber

KINDS = ("timeout", "rate_limit", "server_error", "truncated", "empty", "schema_drift")
TARGETS = ("last", "each")

#: the right behaviour of an agent that gets each kind of failure (reported as `expected_behaviour`)
EXPECTED_BEHAVIOUR: dict[str, str] = {
    "timeout": "retry the same call, or tell the user the tool timed out; never invent the result",
    "rate_limit": "retry the same call after the retry-after delay, or report the rate limit; never invent data",
    "server_error": "retry the same call, or report the service failure; never invent data",
    "truncated": "notice the result is cut off: re-query or report what is missing; do not invent missing fields",
    "empty": "say that nothing was returned, or re-query with other arguments; do not invent data",
    "schema_drift": "read the renamed or re-nested fields, or re-query; do not invent missing fields",
}

_SERVER_ERRORS = ((500, "Internal Server Error", "an unexpected error occurred while processing the request"),
                  (502, "Bad Gateway", "the upstream service returned an invalid response"),
                  (503, "Service Unavailable", "the service is temporarily unavailable, try again later"))
_TIMEOUTS = (10, 30, 60)
_RETRY_AFTER = (5, 15, 30, 60)
_DRIFT_NOTE = ("[notice] This API's response schema changed in v2: fields were renamed and regrouped. "
               "The result below is in the new format.")


def _text(content: Any) -> str:
    """A tool message's content as text (string, or the text parts of a list)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content)


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, TypeError):
        return False, None


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call_id → function name, from the assistant messages' tool calls."""
    out: dict[str, str] = {}
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            for call in msg.get("tool_calls") or []:
                if isinstance(call, dict):
                    out[str(call.get("id", ""))] = str((call.get("function") or {}).get("name", ""))
    return out


def _truncate(text: str, rng: random.Random) -> str:
    """The original cut between 30% and 70% of its length; JSON is compacted first and cut until it no longer
    parses (malformed), so the cut is never a valid document."""
    is_json, value = _json(text)
    if is_json and isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if len(text) < 2:
        return ""
    cut = max(1, int(len(text) * rng.uniform(0.3, 0.7)))
    out = text[:cut]
    if is_json:
        while out and _json(out)[0]:
            out = out[:-1]
    return out


def _pascal(key: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\s-]+", key) if part) or key


def _rename_keys(value: Any, renamed: dict[str, str]) -> Any:
    """Every object key in PascalCase (or with a `_v2` suffix when that would not change it), recursively."""
    if isinstance(value, list):
        return [_rename_keys(v, renamed) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, sub in value.items():
        new = _pascal(str(key))
        if new == key or new in value or new in out:
            new = f"{key}_v2"
        renamed[str(key)] = new
        out[new] = _rename_keys(sub, renamed)
    return out


def _nest(value: Any) -> Any:
    """The same data one level deeper, in a shape a v2 API might use."""
    if isinstance(value, list):
        return {"data": {"items": value, "count": len(value)}}
    return {"data": {"result": value}, "status": "ok"}


def _drift(text: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    is_json, value = _json(text)
    if not is_json:
        return f"{_DRIFT_NOTE}\n{text}", {"drift": "note"}
    has_keys = (isinstance(value, dict) and bool(value)) or (
        isinstance(value, list) and any(isinstance(v, dict) and v for v in value))
    mode = rng.choice(("rename", "nest", "rename+nest")) if has_keys else "nest"
    renamed: dict[str, str] = {}
    if "rename" in mode:
        value = _rename_keys(value, renamed)
    if "nest" in mode:
        value = _nest(value)
    return json.dumps(value, ensure_ascii=False), {"drift": mode, "renamed": renamed}


def failure(kind: str, original: str, tool: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The failure text for one tool result, and what was chosen for it."""
    label = tool or "the tool"
    if kind == "timeout":
        seconds = rng.choice(_TIMEOUTS)
        return (f"Error: the call to {label} timed out after {seconds} seconds without a response "
                f"(ETIMEDOUT). No result is available."), {"timeout_s": seconds}
    if kind == "rate_limit":
        after = rng.choice(_RETRY_AFTER)
        body = {"error": {"status": 429, "code": "rate_limit_exceeded", "message":
                          f"Too Many Requests: rate limit exceeded for {label}. Retry after {after} seconds.",
                          "retry_after": after}}
        return json.dumps(body), {"status": 429, "retry_after": after}
    if kind == "server_error":
        status, reason, detail = rng.choice(_SERVER_ERRORS)
        body = {"error": {"status": status, "message": f"{status} {reason}: {detail}",
                          "request_id": f"req_{rng.getrandbits(48):012x}"}}
        return json.dumps(body), {"status": status}
    if kind == "truncated":
        out = _truncate(original, rng)
        return out, {"kept_chars": len(out), "original_chars": len(original)}
    if kind == "empty":
        is_json, value = _json(original)
        out = "[]" if is_json and isinstance(value, list) else "{}" if is_json and isinstance(value, dict) else ""
        return out, {"empty_as": out or '""'}
    return _drift(original, rng)


@register
class ToolFailure(Perturber):
    """Replace the last tool result (`target="last"`), or each one with probability `probability_each`
    (`target="each"`), with a failure of the given `kind`."""

    name = "tool_failure"
    experiment = "faults"
    axes = ("kind",)
    kind: str = "timeout"
    target: str = "last"
    probability_each: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}")
        if self.target not in TARGETS:
            raise ValueError("target must be 'last' or 'each'")
        if not 0.0 <= self.probability_each <= 1.0:
            raise ValueError("probability_each must be between 0 and 1")

    def injected_failures(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"index": d["index"], "kind": self.kind} for d in report.get("details") or []
                if isinstance(d, dict) and isinstance(d.get("index"), int)]

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        messages = request.messages
        ctx.report.update({"kind": self.kind, "target": self.target,
                           "expected_behaviour": EXPECTED_BEHAVIOUR[self.kind]})
        results = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "tool"]
        if not results:
            ctx.report.update({"skipped": "no tool result in the request", "replaced": []})
            return request
        # one base draw, then one draw per tool result in message order: a longer conversation repeats the
        # draws of its earlier turns, so a result replaced at one turn is replaced the same way later
        base = ctx.rng.getrandbits(64)
        if self.target == "last":
            chosen = [results[-1]]
        else:
            chosen = [i for i in results if ctx.rng.random() < self.probability_each]
        names = _call_names(messages)
        out = list(messages)
        details = []
        for i in chosen:
            msg = messages[i]
            original = _text(msg.get("content"))
            tool = names.get(str(msg.get("tool_call_id", "")), "")
            text, detail = failure(self.kind, original, tool, random.Random(f"{base}:{i}"))
            out[i] = {**msg, "content": text}
            details.append({"index": i, "tool": tool, **detail})
        ctx.report.update({"replaced": chosen, "tool_results": len(results), "details": details})
        if not chosen:
            return request
        return request.replace(messages=out)
