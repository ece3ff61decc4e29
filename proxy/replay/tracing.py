"""Replay and sweep traces (`[tracing] enabled`, docs/tracing.md): one trace per case, one span per arm's request
(a child of the case's span), whose context the replay sends to the proxy, so the proxy's spans of that request
join it. A run can then be browsed case by case: the arms of one case side by side, each with its verdict. A
sweep's case span holds every intensity asked (its trials included) and ends with the case's breaking point."""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog

from toolquake.proxy.server.config import Config

log = structlog.get_logger("toolquake.tracing")


class ReplayTraces:
    """The case spans of one run (open while any of the case's arms is unsent), and the arm spans. `pairs` None
    (a sweep: how many requests a case takes is found as it goes): a case's span is keyed by the case alone and
    stays open until `case_done`."""

    def __init__(self, config: Config, pairs: list[tuple[Any, str, int]] | None, command: str = "replay") -> None:
        from toolquake.proxy.tracing import make_tracer

        self.tracing = make_tracer(config)
        self.tracing.start()
        self.command = command
        self.arms = None if pairs is None else Counter((case.id, trial) for case, _, trial in pairs)
        #: (case id, trial; None in a sweep) -> [the case's span (None: not sampled), its trace id, arms left]
        self.cases: dict[tuple[str, int | None], list[Any]] = {}

    def arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        """The span of one arm's request, and the headers that carry its context to the proxy (fail-open: no span
        and no headers when tracing raised)."""
        try:
            return self._arm(case, profile, trial)
        except Exception as exc:
            self.tracing.failed(exc)
            return None, {}

    def _arm(self, case: Any, profile: str, trial: int) -> tuple[Any, dict[str, str]]:
        from toolquake.proxy.tracing.spans import CLIENT, INTERNAL, new_id, traceparent

        key = self._key(case, trial)
        entry = self.cases.get(key)
        if entry is None:  # one trace per case (and trial, in a replay)
            attributes = {"toolquake.case_id": case.id, "toolquake.category": case.category}
            if key[1] is not None:
                attributes["toolquake.trial"] = trial
            trace_id, case_span = self.tracing.root(f"{self.command} case {case.id}", INTERNAL, None, attributes)
            entry = self.cases[key] = [case_span, trace_id, None if self.arms is None else self.arms[key]]
        if entry[0] is None:  # the sampler left the case out: its requests still carry its trace, unsampled
            return None, {"traceparent": traceparent(entry[1], new_id(64), False)}
        span = entry[0].child(f"{self.command} {profile}", CLIENT, attributes={
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
        key = self._key(case, trial)
        entry = self.cases.get(key)
        if entry is not None and entry[2] is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                if entry[0] is not None:
                    entry[0].finish()
                del self.cases[key]

    def _key(self, case: Any, trial: int) -> tuple[str, int | None]:
        return (case.id, trial) if self.arms is not None else (case.id, None)

    def case_done(self, case: Any, attributes: dict[str, Any]) -> None:
        """A sweep's case is finished (or left for a rerun): its span ends with what was found."""
        try:
            entry = self.cases.pop((case.id, None), None)
            if entry is not None and entry[0] is not None:
                entry[0].attributes.update({k: v for k, v in attributes.items() if v is not None})
                entry[0].finish()
        except Exception as exc:
            self.tracing.failed(exc)

    def close(self) -> None:
        for span, _, _ in self.cases.values():  # a run stopped early: the cases it left are ended as they are
            if span is not None:
                span.finish()
        self.cases.clear()
        self.tracing.shutdown()
