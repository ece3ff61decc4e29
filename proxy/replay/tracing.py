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
        from toolquake.proxy.server.app import tracer

        self.tracing = tracer(config)
        self.tracing.start()
        self.arms = Counter((case.id, trial) for case, _, trial in pairs)
        #: (case id, trial) -> [the case's span (None: not sampled), its trace id, arms left]
        self.cases: dict[tuple[str, int], list[Any]] = {}

    def arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        """The span of one arm's request, and the headers that carry its context to the proxy (fail-open: no span
        and no headers when tracing raised)."""
        try:
            return self._arm(case, profile, trial)
        except Exception as exc:
            self.tracing.failed(exc)
            return None, {}

    def _arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        from toolquake.proxy.server.spans import CLIENT, INTERNAL, new_id, traceparent

        key = (case.id, trial)
        entry = self.cases.get(key)
        if entry is None:  # one trace per case (and trial)
            trace_id, case_span = self.tracing.root(f"replay case {case.id}", INTERNAL, None, {
                "toolquake.case_id": case.id, "toolquake.category": case.category, "toolquake.trial": trial})
            entry = self.cases[key] = [case_span, trace_id, self.arms[key]]
        if entry[0] is None:  # the sampler left the case out: its requests still carry its trace, unsampled
            return None, {"traceparent": traceparent(entry[1], new_id(64), False)}
        span = entry[0].child(f"replay {profile}", CLIENT, attributes={
            "toolquake.case_id": case.id, "toolquake.profile": profile, "toolquake.trial": trial})
        return span, {"traceparent": traceparent(span.trace_id, span.span_id, True)}

    def done(self, span: Any, case: Any, trial: int, rec: Any) -> None:
        """The arm's record is final: its verdict on its span; the case's span ends with its last arm."""
        try:
            self._done(span, case, trial, rec)
        except Exception as exc:
            self.tracing.failed(exc)

    def _done(self, span: Any, case: Any, trial: int, rec: Any) -> None:
        attrs = {} if rec is None else {"toolquake.replay.status": rec.status, "toolquake.verdict.valid": rec.valid,
                 "toolquake.verdict.error_type": rec.error_type, "toolquake.error_code": rec.error_code,
                 "http.response.status_code": rec.http_status, "toolquake.request_id": rec.request_id}
        if span is not None:
            span.attributes.update({k: v for k, v in attrs.items() if v is not None})
            span.finish()
        key = (case.id, trial)
        entry = self.cases.get(key)
        if entry is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                if entry[0] is not None:
                    entry[0].finish()
                del self.cases[key]

    def close(self) -> None:
        for span, _, _ in self.cases.values():  # a run stopped early: the cases it left are ended as they are
            if span is not None:
                span.finish()
        self.cases.clear()
        self.tracing.shutdown()
