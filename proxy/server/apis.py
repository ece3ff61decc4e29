"""The two OpenAI APIs a model route serves, behind one small interface.

Inside, every request and answer is chat-completions shaped (the one representation perturbers,
restorers and scorers know). An `Api` converts the wire form to it and back, and knows its own
stream format: how to assemble a stream into one answer, re-emit an answer as a stream, and tell a
finished stream from a cut one.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec

from toolquake.proxy.server import responses, streaming
from toolquake.proxy.server.protocol import request_decoder, responses_request_decoder
from toolquake.proxy.server.state import CaseHint


class Api:
    #: the `route` metric label, and the upstream path after /v1/
    route = ""
    path = ""
    decoder: msgspec.json.Decoder

    def to_internal(self, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """The chat-shaped body, and whatever `to_wire` needs to write a changed one back."""
        return body, None

    def case_hint(self, typed: Any) -> CaseHint:  # pragma: no cover - interface
        """From the typed decode (`decoder`): the first user message and the tool names of the chat-shaped body
        `to_internal` would give, without decoding the body whole."""
        raise NotImplementedError

    def to_wire(self, chat: dict[str, Any], original: dict[str, Any], conversion: Any) -> dict[str, Any]:
        return chat

    def answer_to_internal(self, answer: dict[str, Any]) -> dict[str, Any]:
        return answer

    def answer_to_wire(self, chat_answer: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
        return chat_answer

    def assemble(self, data: bytes) -> dict[str, Any] | None:  # pragma: no cover - interface
        raise NotImplementedError

    def emit(self, answer: dict[str, Any]) -> Iterator[bytes]:  # pragma: no cover - interface
        raise NotImplementedError

    def summarize(self, data: bytes) -> dict[str, Any] | None:
        """A whole stream's summary, chat-shaped (`streaming.summarize_sse`: ids, model, usage, finish reasons and
        the calls' names), cheaper than `assemble`; None: assemble it instead."""
        return None

    def text_through(self) -> Any:  # pragma: no cover - interface
        """A stream whose plain text is released as it arrives: `feed(bytes)`, `text` (so far),
        `release(upto) -> bytes`, `answer(whole) -> native answer | None`, `finish(final) -> frames`."""
        raise NotImplementedError

    #: byte strings of which one must appear in a stream that ended properly
    end_markers: tuple[bytes, ...] = ()


class ChatCompletions(Api):
    route = "chat_completions"
    path = "chat/completions"
    decoder = request_decoder
    end_markers = (b"[DONE]",)

    def case_hint(self, typed: Any) -> CaseHint:
        first = next(([{"role": "user", "content": m.content}] for m in typed.messages if m.role == "user"), [])
        return CaseHint(first, frozenset(t.function.name for t in typed.tools or ()))

    def assemble(self, data: bytes) -> dict[str, Any] | None:
        return streaming.assemble_sse(data) if data.strip() else None

    def summarize(self, data: bytes) -> dict[str, Any] | None:
        return streaming.summarize_sse(data) if data.strip() else None

    def emit(self, answer: dict[str, Any]) -> Iterator[bytes]:
        return streaming.emit_stream(answer)

    def text_through(self) -> streaming.ChatTextThrough:
        return streaming.ChatTextThrough()


class Responses(Api):
    route = "responses"
    path = "responses"
    decoder = responses_request_decoder
    end_markers = tuple(kind.encode() for kind in responses.FINAL_EVENTS)

    def to_internal(self, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        return responses.to_chat(body)

    def to_wire(self, chat: dict[str, Any], original: dict[str, Any], conversion: Any) -> dict[str, Any]:
        return responses.from_chat(chat, original, conversion)

    def case_hint(self, typed: Any) -> CaseHint:
        # the input's items as `to_chat` turns them into messages (the tools are named by the typed decode)
        chat, _ = responses.to_chat({"instructions": typed.instructions, "input": typed.input})
        return CaseHint(chat["messages"], frozenset(t.name for t in typed.tools or ()
                                                    if t.type == "function" and isinstance(t.name, str)))

    def answer_to_internal(self, answer: dict[str, Any]) -> dict[str, Any]:
        return responses.answer_to_chat(answer)

    def answer_to_wire(self, chat_answer: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
        return responses.answer_from_chat(chat_answer, original)

    def assemble(self, data: bytes) -> dict[str, Any] | None:
        return responses.assemble_events(data)

    def emit(self, answer: dict[str, Any]) -> Iterator[bytes]:
        return responses.emit_events(answer)

    def text_through(self) -> responses.ResponsesTextThrough:
        return responses.ResponsesTextThrough()


CHAT = ChatCompletions()
RESPONSES = Responses()
