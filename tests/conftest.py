"""Shared fixtures: real processes on loopback (the fake upstream, the proxy), started and stopped here; the
helpers they use live in tests/support/."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, Iterator

import pytest

from tests.support import ORPHAN_MARK, Proc, marked_processes, scratch, start_fake_upstream, start_proxy
from tests.support.orphans import boot_ticks, unsettled_processes
from tests.support.replay import N_CASES, WRONG_EVERY, oracle_script


def pytest_configure(config: pytest.Config) -> None:
    """Once, in the controlling process (before any worker runs a test): the caches the tests share and that the
    product builds on first use by starting a process. The record bank of response_lengthening (~1 s; it runs BFCL's
    multi-turn ground truth in the simulators' sandboxed worker) was built by whichever test first padded a tool
    response — on a fresh cache an in-process test then started a process (seen: the corpus bank test, flagged by
    the `processes` check below). Without the corpus or its simulators the bank stays unbuilt (its tests skip)."""
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    try:
        from toolquake.perturbers.helpers.lengthening.record_bank import CorpusBank
    except ImportError:  # the project is not installed: collection says so
        return
    CorpusBank.load()


@pytest.fixture(scope="session", autouse=True)
def _scratch_in_the_sessions_temporary_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Helpers' scratch files (servers' logs, configs) in the session's temporary folder, which pytest keeps for
    the last three runs: a failed test's server log can be read afterwards (tests.support.scratch)."""
    scratch.use(tmp_path_factory.getbasetemp() / "scratch")


@pytest.fixture(scope="session")
def fake_upstream() -> Iterator[Proc]:
    proc = start_fake_upstream()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def proxy(fake_upstream: Proc) -> Iterator[Proc]:
    """The proxy with the packaged example profiles, in front of the session's fake upstream."""
    proc = start_proxy(fake_upstream.url)
    yield proc
    proc.stop()


@pytest.fixture
def proxy_factory(fake_upstream: Proc) -> Iterator[Callable[..., Proc]]:
    """Start extra proxies (own config/env) for one test; all are stopped afterwards."""
    started: list[Proc] = []

    def make(config_text: str | None = None, env: dict[str, str] | None = None, upstream: str | None = None,
             *extra: str) -> Proc:
        proc = start_proxy(upstream or fake_upstream.url, config_text, env, *extra)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def backends() -> Iterator[Any]:
    """BFCL's multi-turn API simulators in their sandboxed worker (installed from the cached wheel if needed)."""
    from toolquake.bfcl.simulators import Backends, ensure_installed

    try:
        ensure_installed()
    except FileNotFoundError as exc:
        pytest.skip(f"no corpus / simulators: {exc}")
    with Backends() as worker:
        yield worker


@pytest.fixture(scope="module")
def oracle() -> Iterator[tuple[Proc, list, set[str]]]:
    """A fake upstream answering the first N_CASES BFCL `multiple` cases with their ground truth, but a wrong
    function for every WRONG_EVERY-th case: (the fake, the cases, the ids answered wrong)."""
    from toolquake.bfcl.corpus import load_category

    cases = load_category("multiple")[:N_CASES]
    messages = [c.turns[0][-1]["content"] for c in cases]
    assert len(set(messages)) == len(messages), "the oracle needs distinct user messages"
    wrong = {c.id for i, c in enumerate(cases) if i % WRONG_EVERY == 0}
    script = oracle_script(cases, wrong)
    fake = start_fake_upstream("--script", str(script))
    yield fake, cases, wrong
    fake.stop()


# -- the long files first ----------------------------------------------------------------------------------------

#: the families whose files take minutes (the embedded model, containers, Phoenix, the slow ones)
LONG_FAMILIES = ("model", "container", "phoenix", "slow")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files holding a test of a long family run first, the rest after, each in its collected order: under
    pytest-xdist's `--dist loadfile` (`make test`) a worker takes the next file as it finishes one, so a long file
    taken last would run alone while the other worker idles (seen: the agent demo on the embedded model, ~5 min,
    was the last file of a run). `make test` passes `--no-loadscope-reorder`, else pytest-xdist hands out the
    files with the most tests first, whatever this order."""
    for item in items:  # the shared servers above are processes, and so are the long families' tests
        if (PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or any(item.get_closest_marker(name) for name in PROCESS_MARKERS)):
            item.add_marker("processes")
    long_files = {item.nodeid.split("::")[0] for item in items
                  if any(item.get_closest_marker(name) for name in LONG_FAMILIES)}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in long_files)


# -- the `processes` marker: a test that starts a process says so (`make test-fast` leaves those tests out) ---

#: markers that say a test starts processes: `processes` itself, and the families that always do
PROCESS_MARKERS = ("processes", "container", "model", "phoenix")
#: this file's fixtures that start processes: the tests using them are marked `processes` at collection
PROCESS_FIXTURES = frozenset({"fake_upstream", "proxy", "proxy_factory", "backends", "oracle"})
#: the audit events (PEP 578) raised when this interpreter starts a process (asyncio's subprocesses and
#: multiprocessing's go through them too)
_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.fork", "os.exec"})
_spawned: list[str] = []  # what the running test (its setup, call and teardown) started
_testing = False


def _audit(event: str, args: tuple) -> None:
    if event in _SPAWN_EVENTS and _testing and len(_spawned) < 8:
        try:  # the command line (the first list among the event's arguments), else the program, else the event
            argv = next((a for a in args if isinstance(a, (list, tuple))), None)
            program = next((a for a in args if isinstance(a, (str, bytes, os.PathLike))), event)
            _spawned.append((" ".join(map(str, argv)) if argv else str(program))[:200].replace("\n", " "))
        except Exception:  # an audit hook must never raise into the code it watches
            _spawned.append(event)


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _testing
    _spawned.clear()
    _testing = True
    try:
        yield
    finally:
        _testing = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test that started a process without a marker saying so fails (in its teardown report): `make test-fast`
    selects tests by that marker, so a missing one would put a process-starting test into the edit loop. A
    process started by a fixture shared at module scope is seen in the setup of the first test that uses it."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown" or not _spawned or report.failed:
        return
    if any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
        return
    if survey := os.environ.get("TOOLQUAKE_TEST_SPAWN_SURVEY"):  # list them all in one run instead of failing
        with open(survey, "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{'; '.join(_spawned)}\n")
        return
    report.outcome = "failed"
    report.longrepr = ("this test started a process without the `processes` marker (tests/conftest.py; add "
                       "`pytest.mark.processes` to it or to its module's pytestmark): " + "; ".join(_spawned))


# -- no orphans: every process the suite starts inherits this marker; at the end none may be alive ---------

os.environ.setdefault(ORPHAN_MARK, f"{os.getpid()}-{time.time_ns()}")
_SESSION_MARK = f"{ORPHAN_MARK}={os.environ[ORPHAN_MARK]}".encode()
_SESSION_START = boot_ticks() if sys.platform.startswith("linux") else 0


def _suite_processes() -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment carries this session's marker."""
    return marked_processes(_SESSION_MARK)


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """Fail the run if a process the suite started is still alive after it (then stop those processes); a process
    still exiting gets TOOLQUAKE_TEST_ORPHAN_GRACE_S seconds (10; tests/backend/test_orphan_check.py's nested runs: 1).

    A wrapper, checking after every other `pytest_sessionfinish`: under pytest-xdist (`make test` runs the suite
    in worker processes) the controller's own hook stops the workers there, and the workers' sessions do not
    check (the marker names the controller), so what a worker's tests left running is found here too."""
    yield
    if not sys.platform.startswith("linux") or os.environ.get(ORPHAN_MARK, "").split("-")[0] != str(os.getpid()):
        return  # only the session that set the marker checks (not pytest runs nested inside tests, nor workers)
    deadline = time.monotonic() + float(os.environ.get("TOOLQUAKE_TEST_ORPHAN_GRACE_S", "10"))
    # a process a test started last may still be in its exec, its environment not yet readable (seen once on a
    # loaded machine: the check found nothing, the leaked process ran on): those are looked at again
    left, unsettled = _suite_processes(), unsettled_processes(_SESSION_START)
    while (left or unsettled) and time.monotonic() < deadline:
        time.sleep(0.2)
        left, unsettled = _suite_processes(), unsettled_processes(_SESSION_START)
    if not left:
        return
    lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
    sys.stderr.write(f"\nERROR: {len(left)} process(es) started by the test suite outlived it:\n{lines}\n")
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    session.exitstatus = 1
