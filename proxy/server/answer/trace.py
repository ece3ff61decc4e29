"""Trace: the final answer's GenAI attributes (response model and id, finish reasons, token usage, the calls
made) on the request's span, when `[tracing]` is on and the span is sampled (proxy/server/tracing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.proxy.server.answer.base import ANSWER, AnswerStep

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served


class Trace(AnswerStep):
    """ANSWER when the request's span records; reads the answer, never changes it (the trace fails open)."""

    name = "trace"

    def needs(self, asked: Asked, served: Served) -> str | None:
        trace = served.trace
        return ANSWER if trace is not None and trace.recording else None

    def summary_enough(self, asked: Asked, served: Served) -> bool:
        return not self.st.tracing.config.contents  # with contents, the span carries the answer's messages

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        served.trace.answered(asked, served, answer)
        return None
