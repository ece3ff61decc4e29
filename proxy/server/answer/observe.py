"""Observe: every finished request counted (requests, duration, upstream time, overhead), logged in one
line, and handed to the observers (recording, replay: those read; live scoring: every request, read or not).
Runs for every request, refused ones included (those are not observed)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from toolquake.proxy.server import logs

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Observer, ProxyState, Served

log = structlog.get_logger("toolquake.proxy")


def finish(st: ProxyState, asked: Asked, served: Served, observe: bool = True) -> None:
    """Count, log, and hand the finished request to the observers."""
    m = st.metrics
    served.total_s = time.perf_counter() - asked.t0
    s = "true" if asked.stream else "false"
    route = asked.route
    m.child(m.requests, asked.profile_name, route, f"{served.status // 100}xx", s, m.model_label(asked.model)).inc()
    m.child(m.duration, asked.profile_name, route, s).observe(served.total_s)
    if served.upstream_s is not None:
        m.child(m.upstream_duration, route, s).observe(served.upstream_s)
        m.child(m.overhead, route, s).observe(max(served.total_s - served.upstream_s, 0.0))
    logs.info(log, "request", _event(st, asked, served))
    if observe:
        if asked.observed and asked.request is not None:
            _hand(st.observers, asked, served)
        _hand(st.case_observers, asked, served)  # every request: those nobody read come undecoded
    if served.trace is not None:  # after the observers: a scorer holds the span open for its verdict
        served.trace.finish(asked, served)


def _hand(observers: list[Observer], asked: Asked, served: Served) -> None:
    for observer in observers:
        try:
            observer(asked, served)
        except Exception as exc:  # fail-open: scoring never breaks serving
            log.warning("observer_failed", error_type=type(exc).__name__, error=str(exc)[:200])


def _event(st: ProxyState, asked: Asked, served: Served) -> dict[str, Any]:
    """The request's log line."""
    outcome = served.outcome
    event: dict[str, Any] = dict(request_id=asked.request_id, route=asked.route, profile=asked.profile_name,
                                 stream=asked.stream, status=served.status,
                                 perturbers=[a.name for a in outcome.perturbations] if outcome else [],
                                 total_ms=round(served.total_s * 1000, 3))
    if outcome is not None and outcome.failed:
        event["perturbers_failed"] = outcome.failed
    if outcome is not None and outcome.remedies:
        event["remedies"] = [a.name for a in outcome.remedies]
    if outcome is not None and outcome.remedies_failed:
        event["remedies_failed"] = outcome.remedies_failed
    if served.injected_calls:
        event["injected_calls"] = list(served.injected_calls)
    if served.uninspected is not None:
        event["uninspected"] = served.uninspected
    if served.upstream_s is not None:
        event["upstream_ms"] = round(served.upstream_s * 1000, 3)
    if st.config.server.log_contents and asked.request is not None:
        event["messages"] = asked.request.get("messages")
        event["answer"] = served.response
    return event
