"""Restore: what a profile's steps rewrote in the request (`rewrites_response`) undone in the answer, last
step first (`pipeline.restore`: a restore that raises leaves the answer as it was, and is counted)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.proxy.server.answer.base import WHOLE, AnswerStep
from toolquake.proxy.server.pipeline import restore

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served


class Restore(AnswerStep):
    name = "restore"

    def needs(self, asked: Asked, served: Served) -> str | None:
        return WHOLE if served.outcome is not None and served.outcome.rewrites_response else None

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        assert served.outcome is not None
        restored, failed = restore(served.outcome, answer)
        self.st.metrics.count_restore_failures(failed)
        return restored
