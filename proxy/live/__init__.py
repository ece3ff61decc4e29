"""Live scoring attached to a running server: case resolution, grading queue, shadow twins, results store.

`attach` is a server extension: `create_app(config, extensions=[attach])`. It sets the case
resolver (which perturbers such as tool_removal need even when scoring is off) and, when
`[scoring] enabled`, the scoring observer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from toolquake.proxy.live.anytime import Monitor
from toolquake.proxy.live.resolver import CaseResolver, use_corpus_dir
from toolquake.proxy.live.results import ConformanceRow, ResultsStore, StoreError, default_path, not_perturbed
from toolquake.proxy.live.scorer import LiveScorer
from toolquake.proxy.live.usercases import UserCases, load_files
from toolquake.proxy.server.config import ScoringConfig

if TYPE_CHECKING:
    from litestar import Litestar

    from toolquake.proxy.server.state import Asked, ConformanceSink, ProxyState, Served

log = structlog.get_logger("toolquake.scoring")


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
    resolver = CaseResolver(settings.match_content, _user_cases(settings.cases))
    st.case_resolver = resolver
    if st.tracing.contents:  # contents in spans (a tracer attached before this): redacted as the recording is
        from toolquake.proxy.live.redact import Redactor

        st.tracing.use_redactor(Redactor(st.config.record.redact, st.config.record.redact_timeout))
    scorer = None
    monitor: Monitor | None = None
    tasks: list[asyncio.Task] = []
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
        # it reads only requests tied to a case or of a shadow or perturbing profile: the rest are served undecoded
        st.case_observers.append(scorer.observe)
        if store is not None:
            st.conformance_sinks.append(_store_violations(store, scorer))
            # the anytime-valid gauges (toolquake_live_*), read back from the store every worker writes
            monitor = Monitor(store.path, scorer.metrics, not_perturbed)

    async def startup() -> None:
        if scorer is not None:
            scorer._start()
        if monitor is not None:
            tasks.append(asyncio.get_running_loop().create_task(monitor.run(), name="toolquake-anytime"))
        if settings.match_content:
            asyncio.get_running_loop().create_task(_load_index(resolver, scorer))

    async def shutdown() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if monitor is not None:
            monitor.close()
        if scorer is not None:
            await scorer.aclose()

    app.on_startup.append(startup)
    app.on_shutdown.insert(0, shutdown)  # before the upstream client closes: twins still use it
    return scorer


def _store_violations(store: ResultsStore, scorer: LiveScorer) -> ConformanceSink:
    """A conformance sink: the violations of one answer written to the results store, off the event loop."""

    def write(rows: list[ConformanceRow]) -> None:
        try:
            store.append_violations(rows)
        except Exception as exc:  # a store that cannot write is counted, never raised into serving
            scorer.metrics.store_errors.inc()
            log.warning("conformance_store_failed", error_type=type(exc).__name__, error=str(exc)[:200])

    def sink(asked: Asked, served: Served, violations: list[Any]) -> None:
        rows = [ConformanceRow(asked.request_id, asked.profile_name, asked.model, asked.route, asked.stream, v.rule,
                               v.detail, v.call, v.excerpt) for v in violations]
        asyncio.get_running_loop().run_in_executor(None, write, rows)

    return sink


def _user_cases(paths: list[str]) -> UserCases | None:
    """The cases of `[scoring] cases` / `--cases`; bad lines are logged and left out, a missing file stops."""
    if not paths:
        return None
    loaded = load_files(paths)
    for problem in loaded.problems:
        if problem.line == 0:
            raise SystemExit(f"toolquake: [scoring] cases: {problem}")
        log.warning("bad_case_line", problem=str(problem)[:300])
    log.info("user_cases_loaded", cases=len(loaded.cases), bad_lines=len(loaded.problems))
    return UserCases(loaded.cases)


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
