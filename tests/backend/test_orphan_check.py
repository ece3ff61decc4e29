"""The suite's own checks (tests/conftest.py): the orphan check (pytest_sessionfinish) fails a run that leaks a
process; the `processes` marker check fails a test that starts a process without that marker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import ORPHAN_MARK, ROOT, wait_for

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check reads /proc")]

LEAKY = """
import subprocess, sys
import pytest
pytestmark = pytest.mark.processes  # else tests/conftest.py fails it for starting a process unmarked

def test_leaks():
    # its own standard streams: one inheriting a pytest-xdist worker's held the controller ~30 s past the run
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("PID", p.pid)
    with open(__file__ + ".pid", "w") as f:  # an xdist worker's output is not shown
        f.write(str(p.pid))
"""
# started with no environment, it takes on the session's (the orphan marker with it) a moment later: as a process
# still inside its exec looks when the check runs (its environment not yet set up), then what it is once it runs
LEAKY_LATE = """
import os, subprocess, sys
import pytest
pytestmark = pytest.mark.processes

def test_leaks_late():
    later = ("import os, sys, time; time.sleep(0.5); "
             f"os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)'], {dict(os.environ)!r})")
    p = subprocess.Popen([sys.executable, "-c", later], env={}, start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(__file__ + ".pid", "w") as f:
        f.write(str(p.pid))
"""
TIDY = """
import subprocess, sys
import pytest
pytestmark = pytest.mark.processes

def test_tidy():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    p.kill()
    p.wait()
"""


def nested(tmp_path, source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    test = tmp_path / "test_nested.py"
    test.write_text(source)
    # the nested run is a session of its own (and not a worker of this one, when this one runs under xdist)
    env = {**{k: v for k, v in os.environ.items()
              if k not in (ORPHAN_MARK, "TOOLQUAKE_TEST_SPAWN_SURVEY") and not k.startswith("PYTEST_XDIST")},
           **(env or {})}
    # only the plugins it needs: loading every installed one costs seconds of CPU in each of its processes
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env.setdefault("TOOLQUAKE_TEST_ORPHAN_GRACE_S", "1")  # the leaked process sleeps 120 s: no need to wait 10
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.conftest", "-p", "xdist.plugin",
                           "-p", "no:cacheprovider", *args, "--rootdir", str(tmp_path), str(test)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-workers"])
def test_a_run_that_leaks_a_process_fails_and_the_process_is_stopped(tmp_path, workers):
    """Also when the tests run in pytest-xdist's workers, as `make test` runs them: the controller checks, after
    its workers are gone (a worker's own session does not), and finds what a worker's test left running."""
    r = nested(tmp_path, LEAKY, *workers)
    out = r.stdout + r.stderr
    pid = int((tmp_path / "test_nested.py.pid").read_text())
    assert r.returncode == 1, out
    assert "outlived it" in out and str(pid) in out
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 5, "the leaked process to be stopped")


def test_a_process_whose_environment_is_not_yet_readable_is_looked_at_again(tmp_path):
    """The check does not take a process it cannot read the environment of yet for one that is not the suite's: it
    looks again within its grace time, finds the marker and fails the run."""
    r = nested(tmp_path, LEAKY_LATE)
    out = r.stdout + r.stderr
    pid = int((tmp_path / "test_nested.py.pid").read_text())
    assert r.returncode == 1, out
    assert "outlived it" in out and str(pid) in out
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 5, "the leaked process to be stopped")


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-workers"])
def test_a_tidy_run_passes(tmp_path, workers):
    """The workers themselves (and their helpers) are not counted as left running."""
    r = nested(tmp_path, TIDY, *workers)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outlived" not in r.stdout + r.stderr


UNMARKED = """
import subprocess, sys
def test_starts_a_process_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
def test_in_process():
    assert sum(range(4)) == 6
"""


@pytest.mark.parametrize("survey", [False, True], ids=["fails", "surveyed"])
def test_a_test_that_starts_a_process_without_the_processes_marker_fails(tmp_path, survey):
    """tests/conftest.py's other check: `make test-fast` leaves out the tests marked `processes`, so one that
    starts a process unmarked fails (its teardown), naming what it started; the in-process test beside it passes.
    With TOOLQUAKE_TEST_SPAWN_SURVEY set, the run lists such tests in that file instead of failing them."""
    survey_file = tmp_path / "survey.tsv"
    r = nested(tmp_path, UNMARKED, env={"TOOLQUAKE_TEST_SPAWN_SURVEY": str(survey_file)} if survey else None)
    out = r.stdout + r.stderr
    if survey:
        assert r.returncode == 0, out
        lines = survey_file.read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith("test_nested.py::test_starts_a_process_unmarked\t"), lines
        assert lines[0].endswith(f"{sys.executable} -c pass"), lines
    else:
        assert r.returncode == 1, out
        assert "2 passed, 1 error" in out, out  # the unmarked test's call passed, its teardown report failed
        assert "started a process without the `processes` marker" in out and f"{sys.executable} -c pass" in out
