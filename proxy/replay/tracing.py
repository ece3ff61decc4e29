"""Replay traces (`[tracing] enabled`, docs/tracing.md): one trace per case, one span per arm's request (a child
of the case's span), whose context the replay sends to the proxy, so the proxy's spans of that request join it.
A run can then be browsed case by case: the arms of one case side by side, each with its verdict."""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog

from toolquake.proxy.server.config import Config

log = structlog.get_logger("toolquake.tracing")


class ReplayTraces:
    """The case spans of one run (open while any of the case's arms is unsent), and the arm spans."""

    def __init__(self, config: Config, pairs: list[tuple[Any, str, int]]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        from toolquake.proxy.server.app import tracer
        from toolquake.proxy.server.tracing import PROPAGATOR

        self.tracing = tracer(config)
        self.tracing.start()
        self.kind, self.in_context, self.propagator = SpanKind, set_span_in_context, PROPAGATOR
        self.arms = Counter((case.id, trial) for case, _, trial in pairs)
        self.cases: dict[tuple[str, int], list[Any]] = {}  # (case id, trial) -> [span, arms left]

    def arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        """The span of one arm's request, and the headers that carry its context to the proxy (fail-open: no span
        and no headers when tracing raised)."""
        try:
            return self._arm(case, profile, trial)
        except Exception as exc:
            self.tracing.failed(exc)
            return None, {}

    def _arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        key = (case.id, trial)
        entry = self.cases.get(key)
        if entry is None:
            span = self.tracing.tracer.start_span(f"replay case {case.id}", attributes={
                "toolquake.case_id": case.id, "toolquake.category": case.category, "toolquake.trial": trial})
            entry = self.cases[key] = [span, self.arms[key]]
        span = self.tracing.tracer.start_span(
            f"replay {profile}", context=self.in_context(entry[0]), kind=self.kind.CLIENT,
            attributes={"toolquake.case_id": case.id, "toolquake.profile": profile, "toolquake.trial": trial})
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.in_context(span))
        return span, carrier

    def done(self, span: Any, case: Any, trial: int, rec: Any) -> None:
        """The arm's record is final: its verdict on its span; the case's span ends with its last arm."""
        if span is None:
            return
        try:
            self._done(span, case, trial, rec)
        except Exception as exc:
            self.tracing.failed(exc)

    def _done(self, span: Any, case: Any, trial: int, rec: Any) -> None:
        attrs = {} if rec is None else {"toolquake.replay.status": rec.status, "toolquake.verdict.valid": rec.valid,
                 "toolquake.verdict.error_type": rec.error_type, "toolquake.error_code": rec.error_code,
                 "http.response.status_code": rec.http_status, "toolquake.request_id": rec.request_id}
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})
        span.end()
        key = (case.id, trial)
        entry = self.cases.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].end()
                del self.cases[key]

    def close(self) -> None:
        for span, _ in self.cases.values():  # a run stopped early: the cases it left are ended as they are
            span.end()
        self.cases.clear()
        self.tracing.shutdown()
