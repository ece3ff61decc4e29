"""Conformance of chat-completions answers: a streamed answer's chunks, or a complete answer."""

from __future__ import annotations

from typing import Any

from toolquake.proxy.server.conformance.arguments import Offered, check_arguments
from toolquake.proxy.server.conformance.content import find_calls
from toolquake.proxy.server.conformance.rules import Violation, excerpt, short
from toolquake.proxy.server.streaming import DONE, Pieces, SSEParser, decode_event


def finish_rules(calls: int, finish: Any, choice: int) -> list[Violation]:
    if calls and finish != "tool_calls":
        return [Violation("finish_reason_not_tool_calls", f"choice {choice}: {calls} call(s) but finish_reason "
                          f"{short(finish) if finish is not None else 'missing'}", excerpt(str(finish)))]
    if not calls and finish == "tool_calls":
        return [Violation("finish_reason_without_calls", f"choice {choice}: finish_reason tool_calls without "
                          "a call", "tool_calls")]
    return []


def content_rules(text: Any, offered: Offered, finish: Any = None) -> list[Violation]:
    """A call left in the text of an answer without calls (`finish`: its finish_reason, for the detail)."""
    if not offered.calls_allowed:
        return []
    found = find_calls(text, offered.tools)
    if found is None:
        return []
    names = ", ".join(sorted({short(n) for n, _ in found.calls})) or "no offered tool parsed"
    ended = f", finish_reason {short(finish)}" if finish is not None else ""
    return [Violation(found.rule, f"text holds {len(found.calls)} call(s) ({names}) and no tool_calls{ended}",
                      excerpt(text[found.start:found.end]))]


def check_answer(answer: Any, offered: Offered) -> list[Violation]:
    """A complete chat.completion."""
    out: list[Violation] = []
    choices = answer.get("choices") if isinstance(answer, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        calls = message.get("tool_calls") if isinstance(message.get("tool_calls"), list) else []
        for n, call in enumerate(calls):
            call = call if isinstance(call, dict) else {}
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            label = f"call {n} ({short(fn.get('name'))})"
            if not call.get("id"):
                out.append(Violation("call_missing_id", f"{label}: no id", excerpt(_shape(call)), n))
            if call.get("type") != "function":
                out.append(Violation("call_missing_type", f"{label}: type is {short(call.get('type'))}",
                                     excerpt(_shape(call)), n))
            if not fn.get("name"):
                out.append(Violation("call_missing_name", f"call {n}: no function.name", excerpt(_shape(call)), n))
            out += check_arguments(fn.get("arguments"), fn.get("name"), offered, n)
        out += finish_rules(len(calls), choice.get("finish_reason"), int(choice.get("index") or 0))
        if not calls:
            out += content_rules(message.get("content"), offered, choice.get("finish_reason"))
    return out


def _shape(call: dict[str, Any]) -> dict[str, Any]:
    """A call or delta with its arguments shortened (an excerpt shows its keys, not a long argument string)."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str) and len(fn["arguments"]) > 40:
        return {**call, "function": {**fn, "arguments": fn["arguments"][:40] + "…"}}
    return call


class _Call:
    __slots__ = ("id", "name", "arguments", "bad_arguments")

    def __init__(self, id_: Any, name: Any) -> None:
        self.id, self.name, self.arguments, self.bad_arguments = id_, name, Pieces(), None


def check_stream(data: bytes, offered: Offered) -> list[Violation]:
    """A whole chat-completions SSE body, chunk by chunk, then the answer the chunks add up to (in time linear in
    the body: text and arguments are joined once, at the end)."""
    parser = SSEParser()
    out: list[Violation] = []
    calls: dict[int, dict[int, _Call]] = {}
    finish: dict[int, Any] = {}
    text: dict[int, Pieces] = {}
    for payload in parser.feed(data) + parser.flush():
        if payload.strip() == DONE:
            continue
        chunk = decode_event(payload)
        if chunk is None:
            out.append(Violation("chunk_invalid_json", "a data payload is not a JSON object", excerpt(
                payload.decode("utf-8", "replace"))))
            continue
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            idx = choice.get("index") if isinstance(choice.get("index"), int) else 0
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if isinstance(delta.get("content"), str):
                text.setdefault(idx, Pieces()).add(delta["content"])
            open_calls = calls.setdefault(idx, {})
            for pos, tc in enumerate(delta.get("tool_calls") or []):
                if isinstance(tc, dict):
                    out += _delta(tc, pos, open_calls)
            if choice.get("finish_reason") is not None:
                finish[idx] = choice["finish_reason"]
    for idx in sorted(set(calls) | set(finish) | set(text)):
        made = calls.get(idx, {})
        for n in sorted(made):
            call = made[n]
            args = call.bad_arguments if call.bad_arguments is not None else call.arguments.text()
            out += check_arguments(args, call.name, offered, n)
        out += finish_rules(len(made), finish.get(idx), idx)
        if not made:
            out += content_rules(text[idx].text() if idx in text else None, offered, finish.get(idx))
    return out


def _delta(tc: dict[str, Any], pos: int, open_calls: dict[int, _Call]) -> list[Violation]:
    out: list[Violation] = []
    index = tc.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        out.append(Violation("delta_missing_index", f"a tool-call delta (position {pos}) has no index",
                             excerpt(_shape(tc)), pos))
        index = pos
    fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
    call = open_calls.get(index)
    if call is None:  # the first delta of this call
        call = open_calls[index] = _Call(tc.get("id") or None, fn.get("name") or None)
        label = f"call {index} ({short(call.name)})"
        if not call.id:
            out.append(Violation("call_missing_id", f"{label}: first delta has no id", excerpt(_shape(tc)), index))
        if tc.get("type") != "function":
            out.append(Violation("call_missing_type", f"{label}: first delta has type {short(tc.get('type'))}",
                                 excerpt(_shape(tc)), index))
        if not call.name:
            out.append(Violation("call_missing_name", f"call {index}: first delta has no function.name",
                                 excerpt(_shape(tc)), index))
    else:
        again = []
        # an id or name the first delta lacked was reported there; sent a second time, clients join the two
        if tc.get("id"):
            if call.id:
                again.append("id")
            call.id = call.id or tc["id"]
        if fn.get("name"):
            if call.name:
                again.append("function.name")
            call.name = call.name or fn["name"]
        if tc.get("type") not in (None, "function"):
            again.append("type")
        if again:
            out.append(Violation("delta_not_append", f"call {index} ({short(call.name)}): a later delta sends "
                                 f"{' and '.join(again)} again", excerpt(_shape(tc)), index))
    args = fn.get("arguments")
    if isinstance(args, str):
        call.arguments.add(args)
    elif args is not None and call.bad_arguments is None:
        call.bad_arguments = args  # an object where a string belongs: reported once, at the end
    return out
