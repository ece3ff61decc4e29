"""Live scoring: tie requests to BFCL cases, score answers off the hot path, count and store the verdicts.

The app hands every finished exchange to `LiveScorer.observe`, which only enqueues (a bounded
queue; full → dropped and counted) and returns. Worker tasks take jobs off the queue, score them in
a thread (BFCL mode, plus `fair` and — when the BFCL verdict is invalid — `semantic`), update the
Prometheus counters and append a row to the results store. Shadow profiles launch a perturbed twin
(proxy/shadow.py) whose answer is compared with the original (scorers/consistency.py).

Which answers are scored against ground truth: those of requests tied to a single-turn BFCL case
(header `X-Toolquake-Case`, or the content hash of the first user message with the same tool names)
whose messages are the case's own turn — a follow-up request of the same conversation (with the
assistant's calls and tool results appended) is not the case any more and is skipped.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from prometheus_client import Counter, Gauge, Histogram

from proxy.config import Config, ScoringConfig
from proxy.results import ResultsStore, Row, StoreError, default_path
from proxy.shadow import ShadowRunner, Twin
from scorers import consistency

if TYPE_CHECKING:
    from litestar import Litestar
    from prometheus_client import CollectorRegistry

    from perturbers import ChatRequest
    from proxy.app import Exchange, ProxyState
    from proxy.pipeline import Applied

log = structlog.get_logger("toolquake.scoring")

SCORING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# reports of perturbers may carry text; without store_contents only identifier-like strings are kept
_IDENTIFIER = re.compile(r"^[\w.:/\-]{1,128}$")


class ScoringMetrics:
    """The scoring metrics, registered in the app's registry. Names and labels are a contract."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.scored = Counter("toolquake_scored", "Answers scored against BFCL ground truth (BFCL-compatible "
                              "verdict).", ["profile", "model", "category", "verdict"], registry=r)
        self.errors = Counter("toolquake_errors", "Invalid answers by error type (taxonomy: wrong_function, "
                              "wrong_count, wrong_param_value, ...).", ["profile", "model", "error_type"], registry=r)
        self.semantic_flips = Counter("toolquake_semantic_flips", "Invalid BFCL verdicts that the semantic "
                                      "mode accepts.", ["profile", "model"], registry=r)
        self.consistency = Counter("toolquake_consistency", "Shadow twins compared with the original answer: "
                                   "agree = true (same calls), semantic (equivalent arguments), false.",
                                   ["profile", "model", "agree"], registry=r)
        self.queue_depth = Gauge("toolquake_scoring_queue_depth", "Jobs waiting in the scoring queue.", registry=r)
        self.dropped = Counter("toolquake_scoring_dropped", "Jobs dropped because the scoring queue was full.",
                               ["profile"], registry=r)
        self.skipped = Counter("toolquake_scoring_skipped", "Answers not scored, by reason (unlabeled, followup, "
                               "no_answer, unsupported_category, scorer_error).", ["profile", "reason"], registry=r)
        self.duration = Histogram("toolquake_scoring_duration_seconds", "Time to score one answer (in a worker).",
                                  buckets=SCORING_BUCKETS, registry=r)
        self.shadow = Counter("toolquake_shadow_requests", "Shadow twins by outcome (answered, failed, busy, "
                              "sampled_out).", ["profile", "outcome"], registry=r)
        self.store_errors = Counter("toolquake_results_store_errors", "Rows the results store could not write.",
                                    registry=r)
        self.corpus_cases = Gauge("toolquake_corpus_cases", "BFCL cases available for content matching "
                                  "(0 until the index is loaded).", registry=r)


# ---------------------------------------------------------------------------------------------
# tying requests to cases


def scorable_categories() -> tuple[str, ...]:
    from scorers.corpus import AST_CATEGORIES, RELEVANCE_CATEGORIES

    return AST_CATEGORIES + RELEVANCE_CATEGORIES


def use_corpus_dir(path: str) -> None:
    """Point the corpus loader at `path`: a toolquake cache dir, or the data dir `corpus path` prints."""
    # only the corpus moves: the cache dir (tool pool, results store, generator caches) stays where it is
    os.environ["TOOLQUAKE_CORPUS"] = str(Path(path).expanduser().resolve())


class CaseResolver:
    """(X-Toolquake-Case header, request) → the BFCL case, or None ("unlabeled"). Runs on the hot path."""

    def __init__(self, match_content: bool = True) -> None:
        self.match_content = match_content
        self.index: Any = None
        self._names: dict[str, frozenset[str]] = {}

    @functools.lru_cache(maxsize=8192)  # noqa: B019 — one resolver per app; cases are immutable
    def _by_id(self, case_id: str) -> Any:
        from scorers.corpus import load_case

        return load_case(case_id)

    def load_index(self) -> int:
        """Build the content-hash index of the scorable categories (slow: call it in a thread)."""
        from scorers.corpus import CaseIndex, load_cases

        cases = load_cases(scorable_categories())
        self.index = CaseIndex(cases)
        return len(cases)

    def tool_names(self, case: Any) -> frozenset[str]:
        names = self._names.get(case.id)
        if names is None:
            from scorers.convert import to_openai_tools

            tools, _ = to_openai_tools(case.functions)
            names = self._names[case.id] = frozenset(t["function"]["name"] for t in tools)
        return names

    def __call__(self, header: str | None, request: ChatRequest) -> Any:
        from scorers.corpus import load_case

        if header:
            try:
                return self._by_id(header.strip())
            except (LookupError, FileNotFoundError) as exc:
                log.warning("unknown_case", case=header[:100], error=str(exc)[:200])
                return None
        if not self.match_content or self.index is None:
            return None
        ids = self.index.lookup(request.messages)
        if not ids:
            return None
        sent = frozenset(str((t.get("function") or {}).get("name")) for t in request.tools if isinstance(t, dict))
        for case_id in ids:
            case = load_case(case_id)
            if self.tool_names(case) == sent:
                return case
        return None


# ---------------------------------------------------------------------------------------------
# scoring one answer


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

    @classmethod
    def of(cls, ex: Exchange) -> Origin:
        return cls(ex.request_id, ex.mode, ex.model, ex.stream, ex.request, ex.case, ex.case_header)


@dataclass
class Job:
    """One answer to score, and the label it counts under."""

    ex: Origin
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


@dataclass
class Grade:
    expected: str
    valid: bool
    error_type: str | None
    taxonomy: str | None
    errors: list[str]
    fair_valid: bool | None
    semantic_valid: bool | None


def _role_count(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") in ("assistant", "tool", "function"))


def is_followup(case: Any, request: dict[str, Any]) -> bool:
    """True when the request carries more assistant/tool turns than the case's own first turn."""
    turn = case.turns[0] if case.turns else []
    return _role_count(request.get("messages") or []) > _role_count(turn)


def _gt_names(case: Any) -> set[str]:
    names: set[str] = set()
    for call in case.ground_truth or []:
        if isinstance(call, dict):
            names.update(call)
    return names


def removes_expected(case: Any, applied: list[Applied]) -> bool:
    """A `tool_removal` step took away a tool the ground truth calls → the right answer is no call."""
    from scorers.convert import openai_name

    gt = _gt_names(case)
    gt_openai = {openai_name(n) for n in gt}
    for a in applied:
        if a.name != "tool_removal":
            continue
        removed = a.report.get("removed")
        if not isinstance(removed, list):
            return True  # the step does not say what it removed: assume the expected tool (its default)
        if any(str(n) in gt or str(n) in gt_openai for n in removed):
            return True
    return False


class Grader:
    """BFCL verdicts for answers to known cases (runs in worker threads)."""

    def __init__(self, semantic: bool = True) -> None:
        self.semantic = semantic
        self._maps: dict[str, dict[str, str]] = {}

    def name_map(self, case: Any) -> dict[str, str]:
        m = self._maps.get(case.id)
        if m is None:
            from scorers.convert import to_openai_tools

            m = self._maps[case.id] = to_openai_tools(case.functions)[1]
        return m

    def grade(self, case: Any, answer: dict[str, Any], applied: list[Applied],
              restorers: list[tuple[Any, Any]] | None = None) -> Grade:
        from scorers.ast_checker import check, check_calls
        from scorers.decode import calls_from_message

        expected = "ground_truth"
        if "irrelevance" in case.category:
            expected = "irrelevance"
        elif case.category == "live_relevance":
            expected = "relevance"
        elif removes_expected(case, applied):
            expected = "irrelevance"
        message = consistency.answer_message(answer) or {}
        calls = calls_from_message(message, self.name_map(case))
        strict_lenient = rewritten_decodes(restorers or [])
        lenient_calls = calls
        if strict_lenient is not None:
            # the answer came back as text: BFCL's verdict is on the strict decode, `fair` on the lenient one
            strict, lenient = strict_lenient
            calls, lenient_calls = as_calls(strict), as_calls(lenient)
        if expected == "irrelevance" and "irrelevance" not in case.category:
            # the expected tool was taken away: scored as BFCL scores irrelevance (valid iff no call)
            v = check_calls(case.functions, None, "irrelevance", calls)
            return Grade(expected, v.valid, v.error_type, v.taxonomy, list(v.errors), v.valid, None)
        v = check(case, calls, mode="bfcl")
        fair = check(case, lenient_calls, mode="fair").valid
        sem = None
        if self.semantic and not v.valid and expected == "ground_truth":
            sem = check(case, calls, mode="semantic").valid
        return Grade(expected, v.valid, v.error_type, v.taxonomy, list(v.errors), fair, sem)


def rewritten_decodes(restorers: list[tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """format_rewrite's (strict, lenient) decodes of the first choice, when it parsed the answer text."""
    for perturber, ctx in restorers:
        for record in ctx.state.get("decoded") or []:
            if record.get("index", 0) == 0 and "strict" in record:
                return record["strict"], record.get("lenient", record["strict"])
    return None


def as_calls(decoded: Any) -> Any:
    """A format_rewrite decode (ok, calls, error) as the scorer's input: calls or a DecodeFailure."""
    from scorers.decode import DECODER_FAILED, DecodeFailure

    if decoded.ok:
        return list(decoded.calls)
    error = decoded.error or DECODER_FAILED
    return DecodeFailure(decoded.detail or error, error if ":" in error else f"ast_decoder:{error}")


def _semantic_strings() -> consistency.StringEquivalence | None:
    try:
        from scorers.semantic import default_equivalence
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


# ---------------------------------------------------------------------------------------------
# the queue and its workers


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
        self.metrics.queue_depth.set_function(self.queue.qsize)
        self.shadow = ShadowRunner(st, self.metrics.shadow, self._twin_done)
        self.workers: list[asyncio.Task] = []

    # -- called on the event loop by the app, after the client was answered: enqueue and go
    def observe(self, ex: Exchange) -> None:
        if ex.mode == "shadow":
            if ex.case is not None:
                # the client's answer is an unperturbed answer: it counts toward the `off` baseline
                self._enqueue(Job(Origin.of(ex), "off", "original", ex.response, self._kept(ex.request), [], [],
                                  ex.status, ex.upstream_s, ex.total_s))
            self._start()
            self.shadow.launch(ex)
            return
        if ex.case is None:
            self.metrics.skipped.labels(ex.profile, "unlabeled").inc()
            return
        applied = list(ex.outcome.applied) if ex.outcome else []
        restorers = list(ex.outcome.restorers) if ex.outcome else []
        self._enqueue(Job(Origin.of(ex), ex.profile, "live", ex.response, self._kept(ex.sent), applied, restorers,
                          ex.status, ex.upstream_s, ex.total_s))

    def _twin_done(self, ex: Exchange, twin: Twin) -> None:
        if twin.error is not None:
            log.info("shadow_twin_failed", request_id=ex.request_id, profile=ex.profile, error=twin.error)
            return
        applied = list(twin.outcome.applied) if twin.outcome else []
        restorers = list(twin.outcome.restorers) if twin.outcome else []
        self._enqueue(Job(Origin.of(ex), ex.profile, "twin", twin.answer, self._kept(twin.sent), applied,
                          restorers, twin.status, twin.upstream_s, None, original=ex.response))

    def _kept(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request body travels with its job only when the store keeps contents."""
        return body if self.settings.store_contents else None

    def _enqueue(self, job: Job) -> None:
        self._start()
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.metrics.dropped.labels(job.profile).inc()

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
                log.warning("scoring_failed", request_id=job.ex.request_id, error_type=type(exc).__name__,
                            error=str(exc)[:300])
            finally:
                self.queue.task_done()

    async def _process(self, job: Job) -> None:
        await asyncio.to_thread(self._score_and_store, job)

    def _score_and_store(self, job: Job) -> None:
        """In a worker thread: grade, count, then append the row (blocking while another writer holds the file)."""
        t0 = time.perf_counter()
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
        ex, m = job.ex, self.metrics
        model = self.st.metrics.model_label(ex.model)
        agreement = None
        if job.arm == "twin":
            agreement = consistency.compare_answers(job.original, job.answer, tools=ex.request.get("tools"),
                                                    strings=self.strings)
            m.consistency.labels(job.profile, model, agreement.agree).inc()
        grade, skip = None, None
        case = ex.case
        if case is not None:
            if case.category not in scorable_categories():
                skip = "unsupported_category"
            elif is_followup(case, ex.request):
                skip = "followup"
            elif job.status != 200 or not isinstance(job.answer, dict):
                skip = "no_answer"
            else:
                try:
                    grade = self.grader.grade(case, job.answer, job.applied, job.restorers)
                except Exception as exc:  # fail-open: a scorer bug costs this verdict only
                    skip = "scorer_error"
                    log.warning("scoring_failed", request_id=ex.request_id, case=case.id,
                                error_type=type(exc).__name__, error=str(exc)[:300])
        if skip is not None:
            m.skipped.labels(job.profile, skip).inc()
        if grade is not None:
            m.scored.labels(job.profile, model, case.category, "valid" if grade.valid else "invalid").inc()
            if not grade.valid:
                m.errors.labels(job.profile, model, grade.taxonomy or grade.error_type or "unknown").inc()
                if grade.semantic_valid:
                    m.semantic_flips.labels(job.profile, model).inc()
        if grade is None and agreement is None:
            return None
        usage = (job.answer or {}).get("usage") or {}
        added = [a.report.get("tokens_added") for a in job.applied]
        keep_text = self.settings.store_contents
        row = Row(
            request_id=ex.request_id, profile=job.profile, mode=ex.mode, arm=job.arm, model=ex.model,
            stream=ex.stream and job.arm != "twin", status=job.status,
            case_id=case.id if case is not None else None,
            category=case.category if case is not None else None,
            resolved_by=None if case is None else ("header" if ex.case_header else "content"),
            perturbers=[{"name": a.name, "params": a.params,
                         "report": a.report if keep_text else _safe_report(a.report)} for a in job.applied],
            total_ms=None if job.total_s is None else job.total_s * 1000, upstream_ms=job.upstream_s * 1000,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            tokens_added=sum(x for x in added if isinstance(x, int)) if any(isinstance(x, int) for x in added)
            else None,
            request_body=job.sent if keep_text else None, response_body=job.answer if keep_text else None,
            agree=agreement.agree if agreement else None,
            shadow_of=ex.request_id if job.arm == "twin" else None,
        )
        if grade is not None:
            row.expected, row.valid, row.error_type, row.taxonomy = (grade.expected, grade.valid, grade.error_type,
                                                                     grade.taxonomy)
            row.errors, row.fair_valid, row.semantic_valid = grade.errors, grade.fair_valid, grade.semantic_valid
        row.scoring_ms = (time.perf_counter() - t0) * 1000
        return row

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


# ---------------------------------------------------------------------------------------------
# wiring


def store_path(settings: ScoringConfig) -> Path | None:
    if settings.store.strip().lower() in ("off", "none", "false"):
        return None
    return Path(settings.store).expanduser() if settings.store else default_path()


def attach(app: Litestar, st: ProxyState) -> LiveScorer | None:
    """Set the case resolver, and when `[scoring] enabled`, the scoring observer, on a new app."""
    settings = st.config.scoring
    path = store_path(settings)
    if settings.corpus:
        use_corpus_dir(settings.corpus)
    resolver = CaseResolver(settings.match_content)
    st.case_resolver = resolver
    scorer = None
    if settings.enabled:
        store = None
        if path is not None:
            try:
                store = ResultsStore(path, store_contents=settings.store_contents)
            except (StoreError, OSError) as exc:
                if settings.store:  # a path the user chose: say so and stop
                    raise SystemExit(f"toolquake: [scoring] store: {exc}") from None
                # the default location is not usable here (read-only cache dir...): serve and count anyway
                log.warning("results_store_unavailable", path=str(path), error=str(exc)[:300])
        scorer = LiveScorer(st, settings, store)
        st.observers.append(scorer.observe)

    async def startup() -> None:
        if scorer is not None:
            scorer._start()
        if settings.match_content:
            asyncio.get_running_loop().create_task(_load_index(resolver, scorer))

    async def shutdown() -> None:
        if scorer is not None:
            await scorer.aclose()

    app.on_startup.append(startup)
    app.on_shutdown.insert(0, shutdown)  # before the upstream client closes: twins still use it
    return scorer


async def _load_index(resolver: CaseResolver, scorer: LiveScorer | None) -> None:
    try:
        n = await asyncio.to_thread(resolver.load_index)
    except FileNotFoundError as exc:
        log.info("content_matching_off", reason=str(exc)[:300])
        return
    except Exception as exc:  # a damaged corpus disables matching by content, nothing else
        log.warning("case_index_failed", error_type=type(exc).__name__, error=str(exc)[:300])
        return
    if scorer is not None:
        scorer.metrics.corpus_cases.set(n)
    log.info("case_index_loaded", cases=n)


def apply_cli(config: Config, *, corpus: str | None = None, no_scoring: bool = False, results_db: str | None = None,
              store_contents: bool = False, no_content_match: bool = False) -> Config:
    """`toolquake serve` flags over the `[scoring]` section."""
    s = config.scoring
    changes: dict[str, Any] = {}
    if corpus:
        changes["corpus"] = corpus
    if no_scoring:
        changes["enabled"] = False
    if results_db:
        changes["store"] = results_db
    if store_contents:
        changes["store_contents"] = True
    if no_content_match:
        changes["match_content"] = False
    return msgspec.structs.replace(config, scoring=msgspec.structs.replace(s, **changes)) if changes else config
