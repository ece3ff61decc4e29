"""The live scorer: a bounded queue of answers to score and the workers that grade, count and store them.

The server hands every finished request to `LiveScorer.observe` (decoded only when it is tied to a case or
its profile shadows or perturbs it), which only enqueues (full → dropped and counted) and returns. Workers
grade in a thread (proxy/live/grader.py), update the Prometheus counters and append a row to the results
store. Shadow profiles launch a perturbed twin (proxy/live/shadow.py) whose answer is compared with the original
(scorers/consistency.py).

Which answers are scored against ground truth: those of requests tied to a single-turn BFCL case or a
user case (`--cases`) whose messages are the case's own turn — a follow-up request of the same
conversation (with the assistant's calls and tool results appended) is not the case any more and is
skipped.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from toolquake.proxy.live import recovery
from toolquake.proxy.live.grader import Grader, is_followup
from toolquake.proxy.live.metrics import ScoringMetrics
from toolquake.proxy.live.resolver import scorable_categories
from toolquake.proxy.live.results import ResultsStore, Row
from toolquake.proxy.live.shadow import ShadowRunner, Twin
from toolquake.proxy.live.usercases import is_user_case
from toolquake.proxy.server.config import NOISE_PROFILE, ScoringConfig
from toolquake.scorers import consistency

if TYPE_CHECKING:
    from toolquake.proxy.server.pipeline import Applied
    from toolquake.proxy.server.state import Asked, ProxyState, Served

log = structlog.get_logger("toolquake.scoring")

# reports of perturbers may carry text; without store_contents only identifier-like strings are kept
_IDENTIFIER = re.compile(r"^[\w.:/\-]{1,128}$")


@dataclass(frozen=True)
class Origin:
    """What a job needs of its exchange (not the exchange itself: a queued job must not pin large bodies)."""

    request_id: str
    mode: str
    model: str | None
    stream: bool
    #: the client's request (its messages decide follow-ups; its tools give parameter defaults)
    request: dict[str, Any]
    case: Any
    case_header: str | None
    route: str = "-"
    injected_calls: tuple[str, ...] = ()
    #: the request's trace (hooks.TraceHooks) when traced: the verdict is added to it
    trace: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, asked: Asked, served: Served) -> Origin:
        # the header only says how the case was found; a header naming no case (it may be long) is not kept
        header = asked.case_header if asked.case is not None else None
        return cls(asked.request_id, asked.mode, asked.model, asked.stream, asked.request or {}, asked.case, header,
                   asked.route, served.injected_calls, served.trace)


@dataclass
class Job:
    """One answer to score, and the label it counts under."""

    origin: Origin
    profile: str
    arm: str  # "live" (served to the client), "original" (a shadow profile's client answer), "twin"
    answer: dict[str, Any] | None
    sent: dict[str, Any] | None
    applied: list[Applied] = field(default_factory=list)
    #: (perturber, context) of steps that rewrote the answer (format_rewrite keeps its decodes there)
    restorers: list[tuple[Any, Any]] = field(default_factory=list)
    status: int = 200
    upstream_s: float = 0.0
    total_s: float | None = None
    #: for twins: the original answer they are compared with
    original: dict[str, Any] | None = None
    #: (message index, kind) of the tool results a step replaced with failures, and the request as sent
    failures: list[tuple[int, str]] = field(default_factory=list)
    failed_request: dict[str, Any] | None = None


def _semantic_strings() -> consistency.StringEquivalence | None:
    try:
        from toolquake.scorers.semantic import default_equivalence
    except ImportError:
        return None
    return default_equivalence()


def _safe_report(report: dict[str, Any]) -> dict[str, Any]:
    def keep(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, str):
            return v if _IDENTIFIER.match(v) else "<text>"
        if isinstance(v, (list, tuple)):
            return [keep(x) for x in v]
        if isinstance(v, dict):
            return {str(k): keep(x) for k, x in v.items()}
        return type(v).__name__

    return {k: keep(v) for k, v in report.items()}


def _verdict_attributes(job: Job, grade: Any, agreement: Any) -> dict[str, Any]:
    """A job's verdict as span attributes: the client's answer under toolquake.verdict.*, a shadow twin's under
    toolquake.shadow.*, a noise twin's under toolquake.noise.* (docs/tracing.md)."""
    prefix = {"twin": "toolquake.shadow.", "noise": "toolquake.noise."}.get(job.arm, "toolquake.verdict.")
    case = job.origin.case
    out: dict[str, Any] = {"toolquake.score.arm": job.arm}
    if agreement is not None:  # agree: the calls are the same (exactly or semantically); agreement says which
        out[prefix + "agree"], out[prefix + "agreement"] = agreement.consistent, agreement.agree
    if grade is not None:
        out.update({prefix + "case_id": case.id, prefix + "category": case.category, prefix + "valid": grade.valid,
                    prefix + "error_type": grade.error_type, prefix + "taxonomy": grade.taxonomy,
                    prefix + "fair_valid": grade.fair_valid, prefix + "semantic_valid": grade.semantic_valid})
    return out


class LiveScorer:
    """The observer attached to `ProxyState.observers`; owns the queue, the workers and the store."""

    def __init__(self, st: ProxyState, settings: ScoringConfig, store: ResultsStore | None) -> None:
        self.st = st
        self.settings = settings
        self.store = store
        self.metrics = ScoringMetrics(st.metrics.registry)
        self.grader = Grader(settings.semantic)
        #: the semantic scorer's string equivalence (normal forms; embeddings when the extra is installed)
        self.strings = _semantic_strings() if settings.semantic else None
        self.queue: asyncio.Queue[Job] = asyncio.Queue(maxsize=settings.queue_size)
        st.metrics.add_refresher(lambda: self.metrics.queue_depth.set(self.queue.qsize()))
        self.shadow = ShadowRunner(st, self.metrics.shadow, self._twin_done)
        self.workers: list[asyncio.Task] = []

    # -- called on the event loop by the app, after the client was answered: enqueue and go. A case observer
    # (`ProxyState.case_observers`): it gets every request, decoded (`asked.request`) when tied to a case or of a
    # shadow or perturbing profile; any other is only counted as not scored
    def observe(self, asked: Asked, served: Served) -> None:
        if asked.mode == "shadow":
            if asked.case is not None:
                # the client's answer is an unperturbed answer: it counts toward the `off` baseline
                self._enqueue(Job(Origin.of(asked, served), "off", "original", served.response,
                                  self._kept(asked.request), [], [], served.status, served.upstream_s or 0.0,
                                  served.total_s))
            self._start()
            self.shadow.launch(asked, served)
            return
        applied = list(served.outcome.applied) if served.outcome else []
        failures = self._failures(asked, served, applied)
        if asked.case is None:
            # an X-Toolquake-Case naming no case we have (unknown, malformed, too long): served, never scored
            reason = "unknown_case" if asked.case_header else "unlabeled"
            self.st.metrics.child(self.metrics.skipped, asked.profile_name, reason).inc()
            if failures:  # an agent's conversation, not a BFCL case: its recovery still counts
                self._enqueue(Job(Origin.of(asked, served), asked.profile_name, "live", served.response, None, applied,
                                  [], served.status, served.upstream_s or 0.0, served.total_s, failures=failures,
                                  failed_request=served.sent))
            return
        restorers = list(served.outcome.restorers) if served.outcome else []
        self._enqueue(Job(Origin.of(asked, served), asked.profile_name, "live", served.response,
                          self._kept(served.sent), applied, restorers, served.status, served.upstream_s or 0.0,
                          served.total_s, failures=failures,
                          failed_request=served.sent if failures else None))

    def _failures(self, asked: Asked, served: Served, applied: list[Applied]) -> list[tuple[int, str]]:
        """The failures a step injected that this answer reacts to (fail-open: none when that cannot be told)."""
        if not applied:
            return []
        try:
            return recovery.injected(applied, (served.sent or {}).get("messages") or [])
        except Exception as exc:
            self.metrics.skipped.labels(asked.profile_name, "scorer_error").inc()
            log.warning("recovery_failed", request_id=asked.request_id, error_type=type(exc).__name__,
                        error=str(exc)[:300])
            return []

    def _twin_done(self, asked: Asked, served: Served, twin: Twin) -> None:
        if twin.error is not None:
            log.info("shadow_twin_failed", request_id=asked.request_id, profile=asked.profile_name, error=twin.error)
            return
        applied = list(twin.outcome.applied) if twin.outcome else []
        restorers = list(twin.outcome.restorers) if twin.outcome else []
        # a noise twin (unperturbed) is stored under its profile with arm "noise", counted under `<noise>`
        self._enqueue(Job(Origin.of(asked, served), asked.profile_name, twin.kind, twin.answer,
                          self._kept(twin.sent), applied, restorers, twin.status, twin.upstream_s, None,
                          original=served.response))

    def _kept(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request body travels with its job only when the store keeps contents."""
        return body if self.settings.store_contents else None

    def _enqueue(self, job: Job) -> None:
        self._start()
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.metrics.dropped.labels(job.profile).inc()
            return
        if job.origin.trace is not None:  # the request's span waits for this verdict (released in _work)
            job.origin.trace.hold()

    def _start(self) -> None:
        if not self.workers:
            loop = asyncio.get_running_loop()
            self.workers = [loop.create_task(self._work(), name=f"toolquake-scoring-{i}")
                            for i in range(self.settings.workers)]

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self._process(job)
            except Exception as exc:  # fail-open: one bad answer never stops the workers
                self.metrics.skipped.labels(job.profile, "scorer_error").inc()
                log.warning("scoring_failed", request_id=job.origin.request_id, error_type=type(exc).__name__,
                            error=str(exc)[:300])
            finally:
                self.queue.task_done()
                if job.origin.trace is not None:
                    job.origin.trace.release()

    async def _process(self, job: Job) -> None:
        await asyncio.to_thread(self._score_and_store, job)

    def _score_and_store(self, job: Job) -> None:
        """In a worker thread: grade, count, then append the row (blocking while another writer holds the file)."""
        t0 = time.perf_counter()
        if job.failures:
            self._count_recovery(job)
            if job.origin.case is None:
                return
        row = self._score(job)
        self.metrics.duration.observe(time.perf_counter() - t0)
        if row is None or self.store is None:
            return
        try:
            self.store.append(row)
        except Exception as exc:  # a locked or full disk loses the row, never the proxy
            self.metrics.store_errors.inc()
            log.warning("results_store_failed", error_type=type(exc).__name__, error=str(exc)[:200])

    def _score(self, job: Job) -> Row | None:
        """Grade and compare one job; count it; return the row to store (None: nothing was scored)."""
        t0 = time.perf_counter()
        origin, m = job.origin, self.metrics
        model = self.st.metrics.model_label(origin.model)
        agreement = None
        if job.arm in ("twin", "noise"):
            agreement = consistency.compare_answers(job.original, job.answer, tools=origin.request.get("tools"),
                                                    strings=self.strings)
            m.consistency.labels(NOISE_PROFILE if job.arm == "noise" else job.profile, model, agreement.agree).inc()
        grade = self._grade(job)
        case = origin.case
        if grade is not None:
            m.scored.labels(job.profile, model, case.category, "valid" if grade.valid else "invalid").inc()
            if not grade.valid:
                m.errors.labels(job.profile, model, grade.taxonomy or grade.error_type or "unknown").inc()
                if grade.semantic_valid:
                    m.semantic_flips.labels(job.profile, model).inc()
        if grade is None and agreement is None:
            return None
        if origin.trace is not None:
            origin.trace.scored(f"score {job.arm}", t0, time.perf_counter(), _verdict_attributes(job, grade, agreement))
        row = self._row(job, agreement)
        if grade is not None:
            row.expected, row.valid, row.error_type, row.taxonomy = (grade.expected, grade.valid, grade.error_type,
                                                                     grade.taxonomy)
            row.errors, row.fair_valid, row.semantic_valid = grade.errors, grade.fair_valid, grade.semantic_valid
        row.scoring_ms = (time.perf_counter() - t0) * 1000
        return row

    def _grade(self, job: Job) -> Any:
        """The verdict on a job tied to a case, or None (the reason it was skipped counted)."""
        origin, case = job.origin, job.origin.case
        # a noise twin is compared only: its verdict would count an unperturbed answer under the profile
        if case is None or job.arm == "noise":
            return None
        grade, skip = None, None
        if case.category not in scorable_categories() and not is_user_case(case):
            skip = "unsupported_category"
        elif is_followup(case, origin.request):
            skip = "followup"
        elif job.status != 200 or not isinstance(job.answer, dict):
            skip = "no_answer"
        else:
            try:
                grade = self.grader.grade(case, job.answer, job.applied, job.restorers)
            except Exception as exc:  # fail-open: a scorer bug costs this verdict only
                skip = "scorer_error"
                log.warning("scoring_failed", request_id=origin.request_id, case=case.id,
                            error_type=type(exc).__name__, error=str(exc)[:300])
        if skip is not None:
            self.metrics.skipped.labels(job.profile, skip).inc()
        return grade

    def _row(self, job: Job, agreement: Any) -> Row:
        """The job's row, before its verdict."""
        origin, case = job.origin, job.origin.case
        usage = (job.answer or {}).get("usage") or {}
        added = [a.report.get("tokens_added") for a in job.applied if not a.is_remedy]
        keep_text = self.settings.store_contents
        return Row(
            request_id=origin.request_id, profile=job.profile, mode=origin.mode, arm=job.arm, model=origin.model,
            stream=origin.stream and job.arm not in ("twin", "noise"), status=job.status,
            case_id=case.id if case is not None else None,
            category=case.category if case is not None else None,
            resolved_by=None if case is None else ("header" if origin.case_header else "content"),
            perturbers=[a.stored(None if keep_text else _safe_report(a.report)) for a in job.applied],
            total_ms=None if job.total_s is None else job.total_s * 1000, upstream_ms=job.upstream_s * 1000,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            tokens_added=sum(x for x in added if isinstance(x, int)) if any(isinstance(x, int) for x in added)
            else None,
            request_body=job.sent if keep_text else None, response_body=job.answer if keep_text else None,
            agree=agreement.agree if agreement else None,
            shadow_of=origin.request_id if job.arm in ("twin", "noise") else None, route=origin.route,
            injected_calls=list(origin.injected_calls) if origin.injected_calls and job.arm == "live" else None,
        )

    def _count_recovery(self, job: Job) -> None:
        """Count the verdict on the answer after each injected failure (fail-open: a scorer bug counts no verdict)."""
        if job.status != 200:
            return
        try:
            found = recovery.verdicts(job.failed_request, job.answer, job.failures)
        except Exception as exc:
            self.metrics.skipped.labels(job.profile, "scorer_error").inc()
            log.warning("recovery_failed", request_id=job.origin.request_id, error_type=type(exc).__name__,
                        error=str(exc)[:300])
            return
        for v in found:
            self.metrics.recovery.labels(job.profile, v.kind, v.verdict).inc()

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until every queued job was scored."""
        try:
            await asyncio.wait_for(self.queue.join(), timeout)
        except asyncio.TimeoutError:
            log.warning("scoring_queue_not_drained", left=self.queue.qsize())

    async def aclose(self) -> None:
        await self.shadow.aclose()
        await self.drain(3.0)
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        if self.store is not None:
            self.store.close()
