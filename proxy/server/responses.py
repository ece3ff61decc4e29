"""The Responses API in the one internal representation: a chat-completions request and answer.

Perturbers, restorers and scorers are written once, for chat-shaped requests. A Responses request
is converted to one (`instructions` → a leading system message, `input` items → messages,
`function_call` items → assistant `tool_calls`, `function_call_output` → `tool` messages, function
tools → chat tools), perturbed, and converted back over the original body, so every field and item
the conversion does not know survives. Messages a perturber left as they were (the same object)
are written back as the exact original items; items with no chat equivalent (reasoning, built-in
tool calls, item references) keep their place after the item they followed.

Answers go the other way for restoring and scoring (`output` → one chat message), and back again
when a perturber rewrote the answer. Streams: relayed as they come; assembled from the final
`response.completed` event; re-emitted as a well-formed event sequence when rewritten.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec

from toolquake.proxy.server.streaming import FINAL_EVENTS, Pieces, SSEParser, read_events

_encode = msgspec.json.encode
_ids = itertools.count(1)
MESSAGE_ROLES = ("user", "assistant", "system", "developer")

@dataclass
class Conversion:
    """What is needed to write a (perturbed) chat request back over the original Responses body."""

    #: id(chat message) → the original input items it was made from
    items_of: dict[int, list[Any]] = field(default_factory=dict)
    #: items with no chat form, keyed by the index (in the converted messages) of the message they follow
    #: (-1: before the first message)
    opaque_after: dict[int, list[Any]] = field(default_factory=dict)
    #: id of the system message made from `instructions`, if any
    instructions_id: int | None = None
    #: tools that are not functions (web search, file search, ...), kept as they were
    other_tools: list[Any] = field(default_factory=list)
    #: the function tools as converted, by name, to write untouched ones back exactly
    tools_by_name: dict[str, Any] = field(default_factory=dict)
    converted_tools: list[dict[str, Any]] = field(default_factory=list)
    #: the converted messages (held, so their ids stay unique while the request lives)
    messages: list[dict[str, Any]] = field(default_factory=list)


def _text_parts(content: Any) -> Any:
    """Responses content parts as chat content: text parts joined when all are text, else chat parts."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            return [_chat_part(p) for p in content]
    return "".join(texts)


def _chat_part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    return part


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], Conversion]:
    """A Responses request body as a chat-completions body (and what converting it back needs)."""
    conv = Conversion()
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
        conv.instructions_id = id(messages[-1])
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else (raw if isinstance(raw, list) else [])
    pending_calls: dict[str, Any] | None = None  # the assistant message collecting consecutive function calls
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(item, dict) and kind in (None, "message") and item.get("role") in MESSAGE_ROLES:
            msg = {"role": item["role"], "content": _text_parts(item.get("content"))}
            messages.append(msg)
            conv.items_of[id(msg)] = [item]
            pending_calls = msg if item["role"] == "assistant" else None
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
            if pending_calls is not None:
                pending_calls.setdefault("tool_calls", []).append(call)
                conv.items_of[id(pending_calls)].append(item)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                messages.append(msg)
                conv.items_of[id(msg)] = [item]
                pending_calls = msg
        elif kind == "function_call_output":
            output = item.get("output")
            msg = {"role": "tool", "tool_call_id": item.get("call_id", ""),
                   "content": output if isinstance(output, str) else _text_parts(output)}
            messages.append(msg)
            conv.items_of[id(msg)] = [item]
            pending_calls = None
        else:
            conv.opaque_after.setdefault(len(messages) - 1, []).append(item)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "tool_choice")}
    chat["messages"] = messages
    conv.messages = list(messages)
    tools = body.get("tools")
    if isinstance(tools, list):
        for tool in tools:
            if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str):
                converted = _chat_tool(tool)
                conv.converted_tools.append(converted)
                conv.tools_by_name[tool["name"]] = (converted, tool)
            else:
                conv.other_tools.append(tool)
        if conv.converted_tools:
            chat["tools"] = list(conv.converted_tools)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat, conv


def _content_items(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """One chat message (not from the original input) as Responses input items."""
    role = msg.get("role")
    if role == "tool":
        content = msg.get("content")
        return [{"type": "function_call_output", "call_id": msg.get("tool_call_id", ""),
                 "output": content if isinstance(content, str) else _encode(content).decode()}]
    out: list[dict[str, Any]] = []
    content = msg.get("content")
    if content not in (None, "", []):
        if isinstance(content, list):
            kind = "output_text" if role == "assistant" else "input_text"
            content = [{"type": kind, "text": p.get("text", "")} if isinstance(p, dict) and p.get("type") == "text"
                       else p for p in content]
        out.append({"type": "message", "role": role if role in MESSAGE_ROLES else "user", "content": content})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        out.append({"type": "function_call", "call_id": call.get("id", ""), "name": fn.get("name", ""),
                    "arguments": fn.get("arguments") or "{}"})
    return out


def from_chat(chat: dict[str, Any], original: dict[str, Any], conv: Conversion) -> dict[str, Any]:
    """The perturbed chat body written back over the original Responses body."""
    body = {k: v for k, v in original.items()}
    for key, value in chat.items():  # top-level fields a perturber set or removed (model, temperature, ...)
        if key in ("messages", "tools", "tool_choice", "parallel_tool_calls"):
            continue
        body[key] = value
    for key in list(body):
        if key not in chat and key not in ("input", "instructions", "tools", "tool_choice") and key in original:
            body.pop(key)
    items: list[Any] = list(conv.opaque_after.get(-1, []))
    instructions: str | None = None
    by_id = {id(m): i for i, m in enumerate(conv.messages)}
    for msg in chat.get("messages") or []:
        if id(msg) == conv.instructions_id:
            instructions = msg.get("content")
        elif id(msg) in conv.items_of:
            items.extend(conv.items_of[id(msg)])
        else:
            items.extend(_content_items(msg))
        position = by_id.get(id(msg))
        if position is not None:
            items.extend(conv.opaque_after.get(position, []))
    body["input"] = items
    if instructions is not None:
        body["instructions"] = instructions
    else:
        body.pop("instructions", None)
    tools: list[Any] = []
    for tool in chat.get("tools") or []:
        fn = tool.get("function") or {} if isinstance(tool, dict) else {}
        known = conv.tools_by_name.get(fn.get("name"))
        if known is not None and known[0] is tool:
            tools.append(known[1])
        elif fn:
            tools.append({"type": "function", **fn})
    tools.extend(conv.other_tools)
    if tools:
        body["tools"] = tools
    else:
        body.pop("tools", None)
    choice = chat.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        body["tool_choice"] = {"type": "function", "name": (choice.get("function") or {}).get("name")}
    elif choice is not None:
        body["tool_choice"] = choice
    else:
        body.pop("tool_choice", None)
    if "parallel_tool_calls" in chat:
        body["parallel_tool_calls"] = chat["parallel_tool_calls"]
    else:
        body.pop("parallel_tool_calls", None)
    return body


# --- answers ---------------------------------------------------------------------------------------


def answer_to_chat(response: dict[str, Any]) -> dict[str, Any]:
    """A Responses answer as a chat.completion (one choice) for restoring and scoring."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    text.append(part["text"])
        elif item.get("type") == "function_call":
            calls.append({"id": item.get("call_id") or item.get("id") or "", "type": "function",
                          "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        message["tool_calls"] = calls
    usage = response.get("usage") or {}
    out: dict[str, Any] = {"id": response.get("id"), "object": "chat.completion", "model": response.get("model"),
                           "created": int(response.get("created_at") or 0),
                           "choices": [{"index": 0, "message": message,
                                        "finish_reason": "tool_calls" if calls else "stop"}]}
    if usage:
        out["usage"] = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
                        "total_tokens": usage.get("total_tokens")}
    return out


def answer_from_chat(chat_answer: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """A (restored) chat.completion written back as the original Responses answer's `output`."""
    choices = chat_answer.get("choices") or [{}]
    message = (choices[0] or {}).get("message") or {}
    kept = [item for item in original.get("output") or []
            if isinstance(item, dict) and item.get("type") not in ("message", "function_call")]
    output: list[dict[str, Any]] = kept
    content = message.get("content")
    if isinstance(content, str) and content:
        output.append({"type": "message", "id": f"msg_tq{next(_ids)}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append({"type": "function_call", "id": f"fc_tq{next(_ids)}", "status": "completed",
                       "call_id": call.get("id") or f"call_tq{next(_ids)}", "name": fn.get("name", ""),
                       "arguments": fn.get("arguments") or "{}"})
    return {**original, "output": output}


# --- streams ---------------------------------------------------------------------------------------


def assemble_events(data: bytes) -> dict[str, Any] | None:
    """The final response of a Responses event stream (`response.completed` and friends), or, when the
    stream ended without one, what its `output_item.done` events hold; None without any."""
    final: dict[str, Any] | None = None
    created: dict[str, Any] | None = None
    done: dict[int, Any] = {}
    for event in read_events(data):
        kind = event.get("type")
        if kind in FINAL_EVENTS and isinstance(event.get("response"), dict):
            final = event["response"]
        elif kind == "response.created" and isinstance(event.get("response"), dict):
            created = event["response"]
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            done[int(event.get("output_index") or len(done))] = event["item"]
    if final is not None:
        return final
    if created is None and not done:
        return None
    return {**(created or {}), "output": [done[i] for i in sorted(done)], "status": "incomplete"}


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    payload = _encode({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def item_events(item: dict[str, Any], index: int, seq: Iterator[int], *, piece: int = 64) -> Iterator[bytes]:
    """The events of one complete output item: added, its text or argument deltas, done."""
    kind = item.get("type") if isinstance(item, dict) else None
    if kind == "message":
        yield _event("response.output_item.added", next(seq), output_index=index,
                     item={**item, "status": "in_progress", "content": []})
        for c, part in enumerate(item.get("content") or []):
            text = part.get("text", "") if isinstance(part, dict) else ""
            yield _event("response.content_part.added", next(seq), item_id=item.get("id"), output_index=index,
                         content_index=c, part={**part, "text": ""})
            for start in range(0, len(text), piece):
                yield _event("response.output_text.delta", next(seq), item_id=item.get("id"), output_index=index,
                             content_index=c, delta=text[start:start + piece])
            yield _event("response.output_text.done", next(seq), item_id=item.get("id"), output_index=index,
                         content_index=c, text=text)
            yield _event("response.content_part.done", next(seq), item_id=item.get("id"), output_index=index,
                         content_index=c, part=part)
    elif kind == "function_call":
        args = item.get("arguments") or ""
        yield _event("response.output_item.added", next(seq), output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
        for start in range(0, len(args), piece):
            yield _event("response.function_call_arguments.delta", next(seq), item_id=item.get("id"),
                         output_index=index, delta=args[start:start + piece])
        yield _event("response.function_call_arguments.done", next(seq), item_id=item.get("id"),
                     output_index=index, arguments=args)
    else:
        yield _event("response.output_item.added", next(seq), output_index=index, item=item)
    yield _event("response.output_item.done", next(seq), output_index=index, item=item)


def emit_events(response: dict[str, Any], *, piece: int = 64) -> Iterator[bytes]:
    """A complete Responses answer as a well-formed event stream (what a client's SDK expects)."""
    seq = itertools.count()
    started = {**response, "status": "in_progress", "output": []}
    yield _event("response.created", next(seq), response=started)
    yield _event("response.in_progress", next(seq), response=started)
    for index, item in enumerate(response.get("output") or []):
        yield from item_events(item, index, seq, piece=piece)
    yield completed(response, seq)


def completed(response: dict[str, Any], seq: Iterator[int]) -> bytes:
    final = {**response, "status": response.get("status") or "completed"}
    final.setdefault("created_at", int(time.time()))
    return _event("response.completed", next(seq), response=final)


class ResponsesTextThrough:
    """A Responses stream whose plain text is released as it arrives (the message item opened early), the
    rest of the answer — remaining text, then other items such as calls — emitted once it is complete."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.parser = SSEParser()
        self.created: dict[str, Any] | None = None
        self.pieces = Pieces()
        self.released = 0
        self.item = {"type": "message", "id": f"msg_tq{next(_ids)}", "status": "in_progress", "role": "assistant",
                     "content": []}

    def feed(self, data: bytes) -> None:
        for event in self.parser.events(data):
            if event.get("type") == "response.created" and isinstance(event.get("response"), dict):
                self.created = event["response"]
            elif event.get("type") == "response.output_text.delta" and isinstance(event.get("delta"), str):
                self.pieces.add(event["delta"])

    @property
    def text(self) -> str:
        return self.pieces.text()

    def release(self, upto: int) -> bytes:
        """Events for the text up to `upto` not sent yet ('' before the stream said who it is)."""
        if self.created is None or upto <= self.released:
            return b""
        out = b""
        if self.released == 0:
            out += _event("response.created", next(self.seq), response={**self.created, "output": []})
            out += _event("response.output_item.added", next(self.seq), output_index=0, item=self.item)
            out += _event("response.content_part.added", next(self.seq), item_id=self.item["id"], output_index=0,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        out += _event("response.output_text.delta", next(self.seq), item_id=self.item["id"], output_index=0,
                      content_index=0, delta=self.text[self.released:upto])
        self.released = upto
        return out

    def answer(self, whole: bytes) -> dict[str, Any] | None:
        """The stream's answer, once it ended (`whole`: all its bytes)."""
        return assemble_events(whole)

    def finish(self, final: dict[str, Any]) -> Iterator[bytes]:
        """The rest of the answer `final` (the restored, complete response)."""
        if self.released == 0:
            yield from emit_events(final)
            return
        output = list(final.get("output") or [])
        first = next((i for i, item in enumerate(output) if isinstance(item, dict) and item.get("type") == "message"),
                     None)
        text = ""
        if first is not None:
            text = "".join(p.get("text", "") for p in output[first].get("content") or [] if isinstance(p, dict))
            output.pop(first)
        sent = self.text[:self.released]
        rest = text[len(sent):] if text.startswith(sent) else ""
        if rest:
            yield _event("response.output_text.delta", next(self.seq), item_id=self.item["id"], output_index=0,
                         content_index=0, delta=rest)
        part = {"type": "output_text", "text": sent + rest, "annotations": []}
        yield _event("response.output_text.done", next(self.seq), item_id=self.item["id"], output_index=0,
                     content_index=0, text=part["text"])
        yield _event("response.content_part.done", next(self.seq), item_id=self.item["id"], output_index=0,
                     content_index=0, part=part)
        item = {**self.item, "status": "completed", "content": [part]}
        yield _event("response.output_item.done", next(self.seq), output_index=0, item=item)
        for index, other in enumerate(output, start=1):
            yield from item_events(other, index, self.seq)
        yield completed({**final, "output": [item, *output]}, self.seq)
