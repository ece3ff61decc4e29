"""Server-sent events: the one SSE reader (both APIs), and chat completions' streams reassembled and emitted.

`SSEParser` turns raw bytes (split anywhere) into `data:` payloads, and `events` / `read_events`
into the JSON objects they carry (every stream the proxy reads goes through them); `StreamAssembler` folds
chat.completion.chunk objects into one chat.completion; `emit_stream` renders a complete
chat.completion as a valid OpenAI stream (role chunk, content, tool_call deltas with index and
id, finish chunk, `data: [DONE]`).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

import msgspec

DONE = b"[DONE]"
# The Responses API events that end a stream and carry the whole response object.
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_decode = msgspec.json.decode
_encode = msgspec.json.encode


class SSEParser:
    """Incremental SSE parser: feed bytes, get the `data` payload of each complete event."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        # Linear time: the buffer grows in place, only the new bytes are normalised ("\r\n" → "\n"; a chunk
        # may end between the two) and searched for an event's end, and the events are cut out by offsets, so
        # an event sent in many chunks, or many events in one chunk, cost what their bytes do
        buf = self._buf
        searched = len(buf)
        if searched and buf[-1] == 13 and chunk[:1] == b"\n":
            del buf[-1]
            searched -= 1
        buf += chunk.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        pos = 0
        end = buf.find(b"\n\n", max(searched - 1, 0))
        while end >= 0:
            lines = bytes(buf[pos:end]).split(b"\n") if end > pos else []
            data = [line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
            pos = end + 2
            end = buf.find(b"\n\n", pos)
        if pos:
            del buf[:pos]
        return out

    def flush(self) -> list[bytes]:
        """Whatever complete-looking event is left when the stream ends without a blank line."""
        rest = bytes(self._buf)
        self._buf = bytearray()
        return self.feed(rest + b"\n\n") if rest.strip() else []

    def events(self, chunk: bytes, *, end: bool = False) -> Iterator[dict[str, Any]]:
        """The JSON objects carried by the complete events of `chunk` (other data skipped); `end`: the stream
        ended with this chunk (what is left is read too)."""
        payloads = self.feed(chunk)
        if end:
            payloads += self.flush()
        return objects(payloads)


def decode_event(payload: bytes) -> dict[str, Any] | None:
    """One event's data as a JSON object; None when it is not one (not JSON, nested too deeply, not an object)."""
    try:
        event = _decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        return None
    return event if isinstance(event, dict) else None


def objects(payloads: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    for payload in payloads:
        event = decode_event(payload)
        if event is not None:
            yield event


def read_events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of a whole SSE body."""
    return SSEParser().events(data, end=True)


class Pieces:
    """Text that arrives in pieces (a stream's deltas): kept as a list and joined when read, so adding a piece
    costs its own length, never the text's so far (concatenating per delta was quadratic in the deltas)."""

    __slots__ = ("_parts", "size")

    def __init__(self, first: str = "") -> None:
        self._parts = [first] if first else []
        #: characters so far
        self.size = len(first)

    def add(self, piece: str) -> None:
        self._parts.append(piece)
        self.size += len(piece)

    def text(self) -> str:
        """The text so far (joined once; read again without new pieces, it costs nothing)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def equals(self, value: Any) -> bool:
        """`value` is this text (lengths compared first: a mismatch costs no join)."""
        return isinstance(value, str) and len(value) == self.size and value == self.text()


class StreamAssembler:
    """Fold chat.completion.chunk payloads into a single chat.completion dict (in time linear in the chunks:
    text, names and arguments are `Pieces`, joined once in `result`)."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}
        self.done = False
        self.chunks = 0
        self.extra: dict[str, Any] = {}

    def add_payload(self, payload: bytes) -> None:
        if payload.strip() == DONE:
            self.done = True
            return
        chunk = decode_event(payload)
        if chunk is not None:
            self.add_chunk(chunk)

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("system_fingerprint"):
            self.extra["system_fingerprint"] = chunk["system_fingerprint"]
        for choice in chunk.get("choices") or []:
            idx = choice.get("index", 0)
            acc = self.choices.setdefault(idx, {"role": None, "content": None, "tool_calls": {},
                                                "finish_reason": None})
            delta = choice.get("delta") or {}
            if delta.get("role"):
                acc["role"] = delta["role"]
            if delta.get("content") and isinstance(delta["content"], str):
                if acc["content"] is None:
                    acc["content"] = Pieces()
                acc["content"].add(delta["content"])
            for tc in delta.get("tool_calls") or []:
                slot = acc["tool_calls"].setdefault(tc.get("index", len(acc["tool_calls"])),
                                                    {"id": None, "type": "function", "name": Pieces(),
                                                     "arguments": Pieces()})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                if tc.get("type"):
                    slot["type"] = tc["type"]
                fn = tc.get("function") or {}
                if fn.get("name") and isinstance(fn["name"], str):
                    slot["name"].add(fn["name"])
                args = fn.get("arguments")
                if args and isinstance(args, str):
                    slot["arguments"].add(args)
                elif args is not None and not isinstance(args, str):  # a backend that sends an object (a bug)
                    slot["arguments"].add(_encode(args).decode())
            if choice.get("finish_reason"):
                acc["finish_reason"] = choice["finish_reason"]

    def text(self, idx: int) -> str:
        """The text of choice `idx` so far."""
        content = (self.choices.get(idx) or {}).get("content")
        return content.text() if content is not None else ""

    def result(self) -> dict[str, Any]:
        choices = []
        for idx in sorted(self.choices):
            acc = self.choices[idx]
            message: dict[str, Any] = {"role": acc["role"] or "assistant", "content": self.text(idx) or None}
            if acc["tool_calls"]:
                message["tool_calls"] = [
                    {"id": slot["id"], "type": slot["type"], "function": {
                        "name": slot["name"].text(), "arguments": slot["arguments"].text()}}
                    for slot in (acc["tool_calls"][i] for i in sorted(acc["tool_calls"]))]
            choices.append({"index": idx, "message": message, "finish_reason": acc["finish_reason"]})
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created,
                               "model": self.model, "choices": choices}
        out.update(self.extra)
        if self.usage:
            out["usage"] = self.usage
        return out


def assemble_sse(data: bytes) -> dict[str, Any]:
    """A whole SSE body (bytes) folded into one chat.completion dict."""
    parser, asm = SSEParser(), StreamAssembler()
    for payload in parser.feed(data) + parser.flush():
        asm.add_payload(payload)
    return asm.result()


class ChatTextThrough:
    """A chat stream whose plain text is released as it arrives (after a role chunk), the rest of the answer —
    remaining text, or the calls the text turned into — emitted once it is complete."""

    def __init__(self) -> None:
        self.parser, self.asm = SSEParser(), StreamAssembler()
        self.base: dict[str, Any] | None = None
        self.released = 0
        self.sent_role = False

    @property
    def text(self) -> str:
        return self.asm.text(0)

    def feed(self, data: bytes) -> None:
        for payload in self.parser.feed(data):
            self.asm.add_payload(payload)
        if self.base is None and self.asm.id is not None:
            self.base = {"id": self.asm.id, "object": "chat.completion.chunk", "created": self.asm.created or 0,
                         "model": self.asm.model or ""}

    def _frame(self, delta: dict[str, Any]) -> bytes:
        return _frame({**(self.base or {}), "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    def release(self, upto: int) -> bytes:
        """Frames for the text up to `upto` not sent yet (b"" before the stream said who it is)."""
        if self.base is None or upto <= self.released:
            return b""
        out = b""
        if not self.sent_role:
            out += self._frame({"role": "assistant", "content": ""})
            self.sent_role = True
        out += self._frame({"content": self.text[self.released:upto]})
        self.released = upto
        return out

    def answer(self, whole: bytes) -> dict[str, Any] | None:
        """The stream's answer, once it ended (`whole`: all its bytes); None for an empty stream."""
        for payload in self.parser.flush():
            self.asm.add_payload(payload)
        return self.asm.result() if whole.strip() else None

    def finish(self, final: dict[str, Any]) -> Iterator[bytes]:
        """The rest of the answer `final` (the restored, complete chat.completion), less the text sent."""
        text, released = self.text, self.released
        rest = _decode(_encode(final))
        for choice in rest.get("choices") or []:
            msg = choice.get("message") or {}
            if choice.get("index", 0) == 0 and released:
                content = msg.get("content")
                if msg.get("tool_calls") or not isinstance(content, str):
                    msg["content"] = None
                else:
                    msg["content"] = content[released:] if content.startswith(text[:released]) else content
        frames = emit_stream(rest)
        if self.sent_role:  # the role chunk went out with the first text
            next(frames, None)
        yield from frames


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def emit_stream(response: dict[str, Any], *, args_chunk: int = 64) -> Iterator[bytes]:
    """Render a complete chat.completion dict as OpenAI SSE frames, ending with `data: [DONE]`."""
    base = {"id": response.get("id") or "chatcmpl-toolquake", "object": "chat.completion.chunk",
            "created": response.get("created") or int(time.time()), "model": response.get("model") or ""}
    if response.get("system_fingerprint"):
        base["system_fingerprint"] = response["system_fingerprint"]

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _frame({**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]})

    for choice in response.get("choices") or []:
        idx = choice.get("index", 0)
        msg = choice.get("message") or {}
        yield chunk(idx, {"role": msg.get("role") or "assistant", "content": ""})
        if msg.get("content"):
            yield chunk(idx, {"content": msg["content"]})
        for n, tc in enumerate(msg.get("tool_calls") or []):
            fn = tc.get("function") or {}
            yield chunk(idx, {"tool_calls": [{"index": n, "id": tc.get("id"), "type": "function",
                                              "function": {"name": fn.get("name", ""), "arguments": ""}}]})
            args = fn.get("arguments") or ""
            for start in range(0, len(args), args_chunk):
                yield chunk(idx, {"tool_calls": [{"index": n, "function": {
                    "arguments": args[start:start + args_chunk]}}]})
        yield chunk(idx, {}, choice.get("finish_reason") or "stop")
    if response.get("usage"):
        yield _frame({**base, "choices": [], "usage": response["usage"]})
    yield b"data: [DONE]\n\n"


class _Delta(msgspec.Struct):
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    index: Any = 0
    delta: _Delta | None = None
    finish_reason: Any = None


class _Chunk(msgspec.Struct):
    """What `summarize_sse` reads of a chunk (the rest is skipped, not built)."""

    id: Any = None
    model: Any = None
    usage: Any = None
    choices: list[_Choice] | None = None


_read_chunk = msgspec.json.Decoder(_Chunk).decode


def summarize_sse(data: bytes) -> dict[str, Any] | None:
    """What `assemble_sse` would give of a whole SSE body but the text and the calls' arguments: the id, model and
    usage, each choice's finish reason, the calls' names; for readers of only those (a span's attributes). None
    when an event is not as a well-formed stream sends it (then assemble it): the same answer, or none."""
    parser = SSEParser()
    answer: dict[str, Any] = {"id": None, "model": None}
    usage = None
    choices: dict[int, dict[str, Any]] = {}
    try:
        for payload in parser.feed(data) + parser.flush():
            if payload.strip() == DONE:
                continue
            chunk = _read_chunk(payload)
            answer["id"] = answer["id"] or chunk.id
            answer["model"] = answer["model"] or chunk.model
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices or ():
                if type(choice.index) is not int:
                    return None
                acc = choices.setdefault(choice.index, {"finish_reason": None, "calls": {}})
                calls = choice.delta.tool_calls if choice.delta is not None else None
                for call in calls or ():
                    if type(call) is not dict:
                        return None
                    index = call.get("index", len(acc["calls"]))
                    if type(index) is not int:
                        return None
                    name = acc["calls"].setdefault(index, Pieces())
                    fn = call.get("function") or {}
                    if type(fn) is not dict:
                        return None
                    if fn.get("name") and isinstance(fn["name"], str):
                        name.add(fn["name"])
                if choice.finish_reason:
                    acc["finish_reason"] = choice.finish_reason
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError, TypeError,
            AttributeError):
        return None
    answer["choices"] = [{"index": i, "finish_reason": choices[i]["finish_reason"], "message": {"tool_calls": [
        {"function": {"name": choices[i]["calls"][c].text()}} for c in sorted(choices[i]["calls"])]}}
        for i in sorted(choices)]
    if usage:
        answer["usage"] = usage
    return answer
