"""Repair (a profile's `repair = true`): a call the model left in its text becomes a proper tool call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.proxy.server import conformance
from toolquake.proxy.server.answer.base import WHOLE, AnswerStep
from toolquake.proxy.server.answer.conformance import offered

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served


class Repair(AnswerStep):
    name = "repair"

    def needs(self, asked: Asked, served: Served) -> str | None:
        return WHOLE if asked.profile is not None and asked.profile.spec.repair else None

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        fixed, served.repaired = conformance.repair_answer(answer, offered(served))
        if served.repaired is None:
            return None
        m = self.st.metrics
        m.conformance_repairs.labels(m.model_label(asked.model), asked.route, "true" if asked.stream else "false",
                                     served.repaired).inc()
        return fixed
