"""Prometheus metrics. Names are prefixed `toolquake_`; labels stay low-cardinality.

With several workers (`multiprocess=True`) every value lives in prometheus-client's per-process files
and `/metrics` on any worker reports all of them: counters and histograms summed, gauges by their
`multiprocess_mode` (`livesum`: the sum over the workers alive now; `max` where every worker holds
the same number). Gauges read from the process (upstream pool, event-loop tasks, the scoring queue)
are set by `refresh()`: at each scrape, and with several workers every `REFRESH_S` in each worker.

A deleted profile's series (every metric with a `profile` label) are removed (`forget_profiles`); with several
workers their values stay in the workers' files, so the exposition also leaves out every `profile` label that is
no profile now (`profiles_shown`). `/metrics` is rendered in a thread (`render`): the event loop serves other
requests meanwhile, and scrapes that come while one renders share its result.
"""

from __future__ import annotations

import asyncio
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from toolquake.proxy.server.pipeline import Outcome, PerturbationFailed

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
        #: the `profile` label values the exposition shows (the profiles now, and the labels that are no profile's);
        #: None: every one (set by the app)
        self.profiles_shown: Callable[[], Collection[str]] | None = None
        self._rendering: asyncio.Future[bytes] | None = None
        self._renderer: ThreadPoolExecutor | None = None  # made on the first scrape (in the worker, after a fork)
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
        self._remedy_metrics(r)
        self.injected_calls = Counter("toolquake_injected_tool_calls",
                                      "Calls the model made to tools the proxy added (not the client's), by profile "
                                      "and the perturber that added the tool.", ["profile", "perturber"], registry=r)

    def _remedy_metrics(self, r: CollectorRegistry) -> None:
        """What the profiles' remedies did (remedies/): applied, raised, and the needed tools they left out."""
        self.remedies = Counter("toolquake_remedies", "Remedies applied, by profile and remedy.",
                                ["profile", "remedy"], registry=r)
        self.remedy_failures = Counter("toolquake_remedy_failures", "Remedies that raised; the request went on as "
                                       "the perturbations left it.", ["profile", "remedy"], registry=r)
        self.remedy_dropped_needed = Counter(
            "toolquake_remedy_dropped_needed", "Tools the case's ground truth calls that a remedy left out of the "
            "request (counted only for requests tied to a known case), by profile and remedy.",
            ["profile", "remedy"], registry=r)

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
            "([server] header_timeout, body_timeout, max_header_bytes, max_url_bytes, max_client_connections, "
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

    def count_outcome(self, outcome: Outcome, counter: str, profile: str) -> None:
        """The one place perturbation and remedy metrics are counted: steps applied (with the tokens each added,
        as measured by the token counter named `counter`) and steps that failed; the remedies of `profile`
        applied, failed, and the needed tools they left out."""
        for a in outcome.applied:
            if a.is_remedy:
                self.child(self.remedies, profile, a.name).inc()
                needed = a.report.get("dropped_needed")
                if isinstance(needed, list) and needed:
                    self.child(self.remedy_dropped_needed, profile, a.name).inc(len(needed))
                continue
            self.perturbations.labels(a.name).inc()
            added = a.report.get("tokens_added")
            if isinstance(added, int) and added >= 0:
                self.tokens_added.labels(a.name, counter).observe(added)
        for name in outcome.failed:
            self.perturbation_failures.labels(name).inc()
        for name in outcome.remedies_failed:
            self.child(self.remedy_failures, profile, name).inc()

    def count_failure(self, exc: PerturbationFailed, profile: str) -> None:
        """A strict profile's step that failed the request: a perturber's, or a remedy's."""
        if exc.kind:
            self.child(self.remedy_failures, profile, exc.perturber).inc()
        else:
            self.perturbation_failures.labels(exc.perturber).inc()

    def count_restore_failures(self, failed: list[str]) -> None:
        for name in failed:
            self.restore_failures.labels(name).inc()

    def model_label(self, model: str | None) -> str:
        if not model:
            return "none"
        return model if model in self.models else "other"

    def forget_profiles(self, names: Iterable[str]) -> None:
        """Remove every series labelled with one of the profiles `names` (deleted), in each metric that has a
        `profile` label: the proxy's and live scoring's (registered in the same registry)."""
        gone = set(names)
        with self.registry._lock:
            metrics = list(self.registry._collector_to_names)
        with warnings.catch_warnings():  # multiprocess mode: the values stay in the files (see profiles_shown)
            warnings.simplefilter("ignore", UserWarning)
            for metric in metrics:
                labelnames = getattr(metric, "_labelnames", ())
                if "profile" not in labelnames:
                    continue
                at = labelnames.index("profile")
                with metric._lock:
                    series = [values for values in metric._metrics if values[at] in gone]
                for values in series:
                    metric.remove(*values)
        for key in [key for key in self._children if gone.intersection(key[1])]:
            del self._children[key]

    def exposition(self) -> bytes:
        self.refresh()
        return self._generate(self._shown())

    def _shown(self) -> frozenset[str] | None:
        return frozenset(self.profiles_shown()) if self.profiles_shown is not None and self.multiprocess else None

    def _generate(self, shown: frozenset[str] | None) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        every_worker = CollectorRegistry()
        files = MultiProcessCollector(None)
        every_worker.register(files if shown is None else _ProfilesShown(files, shown))
        return generate_latest(every_worker)

    async def render(self) -> bytes:
        """The exposition, rendered in a thread (the loop stays free; the process gauges are read on it first).
        A scrape that comes while one renders gets that one's result."""
        pending = self._rendering
        if pending is None:
            self.refresh()
            if self._renderer is None:
                self._renderer = ThreadPoolExecutor(1, thread_name_prefix="toolquake-metrics")
            pending = self._rendering = asyncio.get_running_loop().run_in_executor(self._renderer, self._generate,
                                                                                  self._shown())
            pending.add_done_callback(self._rendered)
        return await asyncio.shield(pending)

    def _rendered(self, _: asyncio.Future[bytes]) -> None:
        self._rendering = None


class _ProfilesShown:
    """`collector`'s metrics without the samples whose `profile` label is not in `shown` (several workers: a
    deleted profile's values stay in the workers' files)."""

    def __init__(self, collector: Any, shown: frozenset[str]) -> None:
        self.collector = collector
        self.shown = shown

    def collect(self) -> Iterable[Any]:
        shown = self.shown
        for metric in self.collector.collect():
            metric.samples = [s for s in metric.samples if (p := s.labels.get("profile")) is None or p in shown]
            yield metric

