"""Conformance checks: the backend's answer, as relayed, against the tool-call rules of the OpenAI wire format
(`server/conformance/`), once the client has it and the request was counted; violations counted, logged and
handed to the conformance sinks."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from toolquake.proxy.server import conformance
from toolquake.proxy.server.answer.base import BYTES, AnswerStep, off_loop

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served

log = structlog.get_logger("toolquake.proxy")
_decode = msgspec.json.decode


def offered(served: Served) -> conformance.Offered:
    """The tools the backend was offered (the request as sent upstream)."""
    if served.outcome is not None and served.outcome.request.body is not None:
        return conformance.Offered.from_request(served.outcome.request.body)
    return conformance.Offered.from_raw(served.sent_raw) if served.sent_raw else conformance.Offered({})


def _check(route: str, stream: bool, tools: conformance.Offered, relayed: bytes) -> list[conformance.Violation]:
    answer: bytes | Any = relayed if stream else _decode(relayed)
    return conformance.check(route, stream, answer, tools)


class Conformance(AnswerStep):
    """`[server] conformance`: check every answer. Fail-open: a checker that raises is counted."""

    name = "conformance"

    def needs(self, asked: Asked, served: Served) -> str | None:
        return BYTES if self.st.config.server.conformance else None

    async def on_bytes(self, asked: Asked, served: Served, relayed: bytes) -> None:
        st, m = self.st, self.st.metrics
        if not relayed:
            return
        route, s = asked.route, "true" if asked.stream else "false"
        try:
            tools = offered(served)
            if not asked.stream and conformance.nothing_to_check(route, relayed, tools):
                found = []
            else:  # a large answer is checked in a thread: the loop serves other requests meanwhile
                found = await off_loop(partial(_check, route, asked.stream, tools), relayed)
        except Exception as exc:  # fail-open: the client has its answer; the check counts its own failure
            m.conformance_failures.labels(route).inc()
            log.warning("conformance_check_failed", request_id=asked.request_id, error_type=type(exc).__name__)
            return
        model = m.model_label(asked.model)
        for v in found:
            m.conformance_violations.labels(model, route, s, v.rule).inc()
        m.child(m.conformance_checks, model, route, s).inc()  # after its violations: a reader sees both
        if served.trace is not None:
            served.trace.conformance([v.rule for v in found])
        if not found:
            return
        served.violations = found
        contents = st.config.server.log_contents
        log.warning("conformance_violations", request_id=asked.request_id, route=route, stream=asked.stream,
                    model=asked.model, violations=[v.as_dict(contents) for v in found])
        for sink in st.conformance_sinks:
            try:
                sink(asked, served, found)
            except Exception as exc:  # fail-open
                log.warning("conformance_sink_failed", error_type=type(exc).__name__, error=str(exc)[:200])
