"""Conformance of Responses API answers: a streamed answer's events, or a complete response object."""

from __future__ import annotations

from typing import Any

from toolquake.proxy.server.conformance.arguments import Offered, check_arguments
from toolquake.proxy.server.conformance.chat import content_rules
from toolquake.proxy.server.conformance.rules import Violation, excerpt, short
from toolquake.proxy.server.streaming import FINAL_EVENTS, Pieces, SSEParser, decode_event


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
        self.arguments = Pieces(item["arguments"] if isinstance(item.get("arguments"), str) else "")
        self.done: str | None = None
        #: the arguments of its last complete form (output_item.done, the final response): what is checked
        self.final: Any = None


class _Events:
    """What a Responses event stream said, event by event: its function_call items, its text, its final
    response, and the rules its events broke on the way."""

    def __init__(self) -> None:
        self.out: list[Violation] = []
        self.by_index: dict[int, _Call] = {}
        self.by_id: dict[str, _Call] = {}
        self.final: dict[str, Any] | None = None
        self.text = Pieces()

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.text.add(event["delta"])
        elif kind == "response.output_item.added" and isinstance(event.get("item"), dict) \
                and event["item"].get("type") == "function_call":
            call = _Call(len(self.by_index), event["item"])
            self.by_index[event.get("output_index") if isinstance(event.get("output_index"), int) else -1] = call
            if isinstance(call.item.get("id"), str):
                self.by_id[call.item["id"]] = call
            self.out += _item_rules(call.item, call.n, "output_item.added")
        elif kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            self._arguments(kind, event)
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict) \
                and event["item"].get("type") == "function_call":
            call = self.by_index.get(event.get("output_index")) \
                or self.by_id.get(event["item"].get("id"))  # type: ignore[arg-type]
            if call is not None:
                self.out += _agree(call, event["item"], "output_item.done")
        elif kind in FINAL_EVENTS and isinstance(event.get("response"), dict):
            self.final = event["response"]

    def _arguments(self, kind: str, event: dict[str, Any]) -> None:
        call = self.by_index.get(event.get("output_index")) or self.by_id.get(event.get("item_id"))  # type: ignore[arg-type]
        if call is None:
            self.out.append(Violation("delta_missing_index", f"{kind.rsplit('.', 1)[1]} event for an output_index/"
                                      "item_id with no function_call item", excerpt(event)))
        elif kind.endswith(".delta"):
            if isinstance(event.get("delta"), str):
                call.arguments.add(event["delta"])
        else:
            call.done = event.get("arguments")
            if not call.arguments.equals(call.done):
                self.out.append(_mismatch(call, "arguments.done's arguments", event.get("arguments")))

    def end(self, offered: Offered) -> list[Violation]:
        """The rules on what the stream added up to, after those its events broke."""
        out = self.out
        calls = sorted(self.by_index.values(), key=lambda c: c.n)
        if self.final is not None:
            done = _calls(self.final.get("output"))
            if len(done) != len(calls):
                out.append(Violation("done_mismatch", f"{len(calls)} function_call item(s) streamed, {len(done)} in "
                                     "the final response", ""))
            for call, item in zip(calls, done):
                out += _agree(call, item, "the final response")
        for call in calls:
            args = call.final if call.final is not None else call.done if call.done is not None else \
                call.arguments.text()
            out += check_arguments(args, call.item.get("name"), offered, call.n)
        if not calls:
            out += content_rules(self.text.text() or _text((self.final or {}).get("output")), offered)
        return out


def check_stream(data: bytes, offered: Offered) -> list[Violation]:
    """A whole Responses event stream: each function_call item's events agree with one another and with
    the final response; then the rules of a complete answer on what the stream added up to."""
    parser = SSEParser()
    events = _Events()
    for payload in parser.feed(data) + parser.flush():
        event = decode_event(payload)
        if event is None:
            events.out.append(Violation("chunk_invalid_json", "an event's data is not a JSON object",
                                        excerpt(payload.decode("utf-8", "replace"))))
        else:
            events.add(event)
    return events.end(offered)


def _mismatch(call: _Call, where: str, value: Any) -> Violation:
    return Violation("done_mismatch", f"call {call.n} ({short(call.item.get('name'))}): {where} differ from its "
                     "deltas", excerpt(value if value is not None else ""), call.n)


def _agree(call: _Call, item: dict[str, Any], where: str) -> list[Violation]:
    out = []
    call.final = item.get("arguments")
    if not call.arguments.equals(item.get("arguments")):
        out.append(_mismatch(call, f"{where}'s arguments", item.get("arguments")))
    for key in ("call_id", "name"):
        if call.item.get(key) and item.get(key) != call.item.get(key):
            out.append(Violation("done_mismatch", f"call {call.n} ({short(call.item.get('name'))}): {where} has "
                                 f"another {key}", excerpt(short(item.get(key))), call.n))
    return out
