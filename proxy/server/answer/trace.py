"""Trace: the final answer's GenAI attributes (response model and id, finish reasons, token usage, the calls
made) on the request's span, when a tracer is attached and the span is sampled (through `hooks.TraceHooks`: the
tracing wing, proxy/tracing/, implements it). A request
that went upstream as it came (not decoded, not changed) has its answer read from the bytes relayed (a summary
read without building the rest): a whole answer's in the proxy's check that they are a JSON object (one decode for
both), a stream's once the client has it; any other's from the answer as the client got it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.proxy.server.answer.base import ANSWER, BYTES, CHECK, AnswerStep

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served


class Trace(AnswerStep):
    """ANSWER (or, for an answer relayed undecoded, CHECK: a whole answer, BYTES: a stream) when the request's span
    records; reads the answer, never changes it (the trace fails open)."""

    name = "trace"

    def needs(self, asked: Asked, served: Served) -> str | None:
        trace = served.trace
        if trace is None or not trace.sampled:
            return None
        if asked.request is None and served.outcome is None and not asked.observed:
            return BYTES if asked.stream else CHECK
        return ANSWER

    def summary_enough(self, asked: Asked, served: Served) -> bool:
        return not self.st.tracing.contents  # with contents, the span carries the answer's messages

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        served.trace.answered(asked, served, answer)
        return None

    async def on_bytes(self, asked: Asked, served: Served, relayed: bytes) -> None:
        served.trace.relayed(asked, relayed)

    def on_check(self, asked: Asked, served: Served, data: bytes) -> Any:
        return served.trace.checked(asked, data)
