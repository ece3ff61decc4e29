"""Conformance of Responses API answers: a streamed answer's events, or a complete response object."""

from __future__ import annotations

from typing import Any

import msgspec

from toolquake.proxy.server.conformance.arguments import Offered, check_arguments
from toolquake.proxy.server.conformance.chat import content_rules
from toolquake.proxy.server.conformance.rules import Violation, excerpt, short
from toolquake.proxy.server.streaming import SSEParser

_decode = msgspec.json.decode
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _text(output: Any) -> str:
    parts = []
    for item in output if isinstance(output, list) else []:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
    return "".join(parts)


def _calls(output: Any) -> list[dict[str, Any]]:
    return [i for i in output if isinstance(i, dict) and i.get("type") == "function_call"] \
        if isinstance(output, list) else []


def _item_rules(item: dict[str, Any], n: int, where: str) -> list[Violation]:
    out = []
    if not item.get("call_id"):
        out.append(Violation("call_missing_id", f"call {n} ({short(item.get('name'))}): {where} has no call_id",
                             excerpt(_shape(item)), n))
    if not item.get("name"):
        out.append(Violation("call_missing_name", f"call {n}: {where} has no name", excerpt(_shape(item)), n))
    return out


def _shape(item: dict[str, Any]) -> dict[str, Any]:
    args = item.get("arguments")
    return {**item, "arguments": args[:40] + "…"} if isinstance(args, str) and len(args) > 40 else item


def check_answer(response: Any, offered: Offered) -> list[Violation]:
    """A complete Responses object."""
    if not isinstance(response, dict):
        return []
    out: list[Violation] = []
    calls = _calls(response.get("output"))
    for n, item in enumerate(calls):
        out += _item_rules(item, n, "function_call item")
        out += check_arguments(item.get("arguments"), item.get("name"), offered, n)
    if not calls:
        out += content_rules(_text(response.get("output")), offered)
    return out


class _Call:
    __slots__ = ("n", "item", "arguments", "done", "final")

    def __init__(self, n: int, item: dict[str, Any]) -> None:
        self.n, self.item = n, item
        self.arguments = item.get("arguments") if isinstance(item.get("arguments"), str) else ""
        self.done: str | None = None
        #: the arguments of its last complete form (output_item.done, the final response): what is checked
        self.final: Any = None


def check_stream(data: bytes, offered: Offered) -> list[Violation]:
    """A whole Responses event stream: each function_call item's events agree with one another and with
    the final response; then the rules of a complete answer on what the stream added up to."""
    parser = SSEParser()
    out: list[Violation] = []
    by_index: dict[int, _Call] = {}
    by_id: dict[str, _Call] = {}
    final: dict[str, Any] | None = None
    text = ""
    for payload in parser.feed(data) + parser.flush():
        try:
            event = _decode(payload)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
            event = None
        if not isinstance(event, dict):
            out.append(Violation("chunk_invalid_json", "an event's data is not a JSON object",
                                 excerpt(payload.decode("utf-8", "replace"))))
            continue
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            text += event["delta"]
        elif kind == "response.output_item.added" and isinstance(event.get("item"), dict) \
                and event["item"].get("type") == "function_call":
            call = _Call(len(by_index), event["item"])
            by_index[event.get("output_index") if isinstance(event.get("output_index"), int) else -1] = call
            if isinstance(call.item.get("id"), str):
                by_id[call.item["id"]] = call
            out += _item_rules(call.item, call.n, "output_item.added")
        elif kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            call = by_index.get(event.get("output_index")) or by_id.get(event.get("item_id"))  # type: ignore[arg-type]
            if call is None:
                out.append(Violation("delta_missing_index", f"{kind.rsplit('.', 1)[1]} event for an output_index/"
                                     "item_id with no function_call item", excerpt(event)))
                continue
            if kind.endswith(".delta"):
                if isinstance(event.get("delta"), str):
                    call.arguments += event["delta"]
            else:
                call.done = event.get("arguments")
                if call.done != call.arguments:
                    out.append(_mismatch(call, "arguments.done's arguments", event.get("arguments")))
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict) \
                and event["item"].get("type") == "function_call":
            call = by_index.get(event.get("output_index")) or by_id.get(event["item"].get("id"))  # type: ignore[arg-type]
            if call is not None:
                out += _agree(call, event["item"], "output_item.done")
        elif kind in FINAL_EVENTS and isinstance(event.get("response"), dict):
            final = event["response"]
    calls = sorted(by_index.values(), key=lambda c: c.n)
    if final is not None:
        done = _calls(final.get("output"))
        if len(done) != len(calls):
            out.append(Violation("done_mismatch", f"{len(calls)} function_call item(s) streamed, {len(done)} in "
                                 "the final response", ""))
        for call, item in zip(calls, done):
            out += _agree(call, item, "the final response")
    for call in calls:
        args = call.final if call.final is not None else call.done if call.done is not None else call.arguments
        out += check_arguments(args, call.item.get("name"), offered, call.n)
    if not calls:
        out += content_rules(text or _text((final or {}).get("output")), offered)
    return out


def _mismatch(call: _Call, where: str, value: Any) -> Violation:
    return Violation("done_mismatch", f"call {call.n} ({short(call.item.get('name'))}): {where} differ from its "
                     "deltas", excerpt(value if value is not None else ""), call.n)


def _agree(call: _Call, item: dict[str, Any], where: str) -> list[Violation]:
    out = []
    call.final = item.get("arguments")
    if item.get("arguments") != call.arguments:
        out.append(_mismatch(call, f"{where}'s arguments", item.get("arguments")))
    for key in ("call_id", "name"):
        if call.item.get(key) and item.get(key) != call.item.get(key):
            out.append(Violation("done_mismatch", f"call {call.n} ({short(call.item.get('name'))}): {where} has "
                                 f"another {key}", excerpt(short(item.get(key))), call.n))
    return out
