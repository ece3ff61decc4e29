"""Prometheus metrics. Names are prefixed `toolquake_`; labels stay low-cardinality.

With several workers (`multiprocess=True`) every value lives in prometheus-client's per-process files
and `/metrics` on any worker reports all of them: counters and histograms summed, gauges by their
`multiprocess_mode` (`livesum`: the sum over the workers alive now; `max` where every worker holds
the same number). Gauges read from the process (upstream pool, event-loop tasks, the scoring queue)
are set by `refresh()`: at each scrape, and with several workers every `REFRESH_S` in each worker.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from toolquake.proxy.server.pipeline import Outcome

# seconds: from 100 µs (proxy overhead) to 10 min (long generations)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
# tokens a perturber added to a request (budgets of the lengthening perturbers go to 120K)
#: seconds between refreshes of the process gauges in each worker (several workers only)
REFRESH_S = 0.25
log = structlog.get_logger("toolquake.proxy")
TOKEN_BUCKETS = (0, 10, 100, 1000, 5000, 10000, 20000, 40000, 80000, 120000, 250000)
#: seconds between the timers of the event-loop lag probe (`watch_loop_lag`)
LOOP_LAG_INTERVAL_S = 0.25
# seconds a timer ran late: from 1 ms (a busy loop) to 30 s (a loop held by one request)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """All of the proxy's metrics, in a registry of their own (one per app)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_allowlist: list[str] | None = None, *, multiprocess: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess
        self._refreshers: list[Callable[[], None]] = []
        self._children: dict[tuple, Any] = {}
        self.models = frozenset(model_allowlist or [])
        r = self.registry  # registered in this order, which is the order of the exposition
        self._request_metrics(r)
        self._step_metrics(r)
        self._conformance_metrics(r)
        self._process_metrics(r)
        self.tokens_added = Histogram("toolquake_tokens_added", "Tokens a perturber added to a request "
                                      "(non-negative reports only), by the token counter that measured them.",
                                      ["perturber", "counter"], buckets=TOKEN_BUCKETS, registry=r)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Each answered request: counts, durations, time to first byte, the proxy's overhead."""
        self.requests = Counter("toolquake_requests",
                                "Requests answered, by profile, route, status class, stream and model.",
                                ["profile", "route", "status_class", "stream", "model"], registry=r)
        self.duration = Histogram("toolquake_request_duration_seconds", "Total time from request to last byte sent.",
                                  ["profile", "route", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_duration = Histogram("toolquake_upstream_duration_seconds",
                                           "Time spent waiting on the upstream (request sent to last byte received).",
                                           ["route", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("toolquake_time_to_first_byte_seconds",
                              "Time from request to first body byte sent to the client.",
                              ["profile", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("toolquake_proxy_overhead_seconds", "Total duration minus upstream duration.",
                                  ["route", "stream"], buckets=OVERHEAD_BUCKETS, registry=r)
        self.request_decodes = Counter(
            "toolquake_request_decodes", "Model request bodies decoded, by kind: `typed` (the fields the proxy "
            "validates; every request once), `whole` (the whole body, for a profile that perturbs it or an observer "
            "that reads it: live scoring reads only requests tied to a case or of a shadow profile).", ["kind"],
            registry=r)

    def _step_metrics(self, r: CollectorRegistry) -> None:
        """What the profiles' steps did to requests, and what failed on the way (perturbers, restores,
        the upstream); calls to tools the proxy added."""
        self.perturbations = Counter("toolquake_perturbations", "Perturbations applied, by perturber.",
                                     ["perturber"], registry=r)
        self.perturbation_failures = Counter("toolquake_perturbation_failures",
                                             "Perturbers that raised; the request was served unperturbed.",
                                             ["perturber"], registry=r)
        self.restore_failures = Counter("toolquake_restore_failures",
                                        "Response restores that raised; the upstream answer was served as is.",
                                        ["perturber"], registry=r)
        self.upstream_errors = Counter("toolquake_upstream_errors",
                                       "Upstream failures answered by the proxy (unreachable, timeout, protocol).",
                                       ["kind"], registry=r)
        self.answers_uninspected = Counter(
            "toolquake_answers_uninspected", "Upstream answers relayed to the client without inspection (no "
            "conformance check, assembly, trace summary or observer), by reason: `too_large` (past [server] "
            "max_answer_bytes; nothing more of it was kept).", ["reason"], registry=r)
        self.injected_calls = Counter("toolquake_injected_tool_calls",
                                      "Calls the model made to tools the proxy added (not the client's), by profile "
                                      "and the perturber that added the tool.", ["profile", "perturber"], registry=r)

    def _conformance_metrics(self, r: CollectorRegistry) -> None:
        """The backend's answers against the tool-call conformance rules (docs/conformance.md)."""
        self.conformance_violations = Counter(
            "toolquake_conformance_violations", "Tool-call conformance rules the backend's answers broke "
            "(docs/conformance.md), by model, route, stream and rule.", ["model", "route", "stream", "rule"],
            registry=r)
        self.conformance_checks = Counter(
            "toolquake_conformance_checks", "Answers checked against the tool-call conformance rules, by model, route "
            "and stream (the denominator of violation rates).", ["model", "route", "stream"], registry=r)
        self.conformance_repairs = Counter(
            "toolquake_conformance_repairs", "Calls left in an answer's text that a profile's `repair` step turned "
            "into tool_calls, by the rule repaired.", ["model", "route", "stream", "rule"], registry=r)
        self.conformance_failures = Counter(
            "toolquake_conformance_check_failures", "Conformance checks that raised; the answer was served as relayed.",
            ["route"], registry=r)

    def _process_metrics(self, r: CollectorRegistry) -> None:
        """Connections refused at the limits, requests in flight, the upstream pool, the event loop."""
        self.connections_rejected = Counter(
            "toolquake_connections_rejected", "Client connections and requests the proxy refused at its limits "
            "([server] header_timeout, max_header_bytes, max_url_bytes, max_client_connections, "
            "max_in_flight_requests), by reason.", ["reason"], registry=r)
        self.in_flight = Gauge("toolquake_in_flight_requests", "Requests being handled now.", registry=r,
                               multiprocess_mode="livesum")
        self.upstream_connections = Gauge("toolquake_upstream_connections", "Connections in the upstream pool, by "
                                          "state (active = serving a request).", ["state"], registry=r,
                                          multiprocess_mode="livesum")
        self.loop_tasks = Gauge("toolquake_event_loop_tasks", "asyncio tasks alive in the proxy's event loop(s).",
                                registry=r, multiprocess_mode="livesum")
        self.loop_lag = Histogram("toolquake_event_loop_lag_seconds", "How late the event loop ran a timer set "
                                  f"every {LOOP_LAG_INTERVAL_S} s, in each worker: work holding the loop (CPU-bound "
                                  "code on it) delays every request of that worker by as much.",
                                  buckets=LOOP_LAG_BUCKETS, registry=r)

    def watch_runtime(self, pool_states: Callable[[], dict[str, int]], tasks: Callable[[], int]) -> None:
        """Gauges read from the process: upstream pool connections by state, and event-loop tasks."""

        def refresh() -> None:
            for state, n in pool_states().items():
                self.upstream_connections.labels(state).set(n)
            self.loop_tasks.set(tasks())

        self.add_refresher(refresh)

    async def watch_loop_lag(self, interval: float = LOOP_LAG_INTERVAL_S) -> None:
        """Until cancelled: sleep `interval` on the running loop and observe how much later than asked it woke."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: the per-request counters skip prometheus-client's label checks."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def add_refresher(self, fn: Callable[[], None]) -> None:
        """`fn` sets gauges from the process's state; called by `refresh()`."""
        self._refreshers.append(fn)

    def refresh(self) -> None:
        for fn in self._refreshers:
            try:
                fn()
            except Exception as exc:  # a gauge left stale never breaks a scrape
                log.warning("metrics_refresh_failed", error_type=type(exc).__name__)

    def count_outcome(self, outcome: Outcome, counter: str) -> None:
        """The one place perturbation metrics are counted: steps applied (with the tokens each added, as
        measured by the token counter named `counter`) and steps that failed."""
        for a in outcome.applied:
            self.perturbations.labels(a.name).inc()
            added = a.report.get("tokens_added")
            if isinstance(added, int) and added >= 0:
                self.tokens_added.labels(a.name, counter).observe(added)
        for name in outcome.failed:
            self.perturbation_failures.labels(name).inc()

    def count_restore_failures(self, failed: list[str]) -> None:
        for name in failed:
            self.restore_failures.labels(name).inc()

    def model_label(self, model: str | None) -> str:
        if not model:
            return "none"
        return model if model in self.models else "other"

    def exposition(self) -> bytes:
        self.refresh()
        if not self.multiprocess:
            return generate_latest(self.registry)
        every_worker = CollectorRegistry()
        MultiProcessCollector(every_worker)
        return generate_latest(every_worker)

