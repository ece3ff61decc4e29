"""Shared fixtures: real processes on loopback (the fake upstream, the proxy), started and stopped here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    popen: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_process(args: list[str], port: int, ready_path: str = "/healthz", env: dict[str, str] | None = None,
                  timeout: float = 30.0, cwd: Path = ROOT, scheme: str = "http") -> Proc:
    """Start `args` (a python module command line) in `cwd` and wait until GET ready_path answers (over `scheme`;
    https: any certificate)."""
    log = Path(tempfile.mkstemp(prefix="toolquake-proc-", suffix=".log")[1])
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    popen = subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, stdout=log.open("wb"),
                             stderr=subprocess.STDOUT)
    url = f"{scheme}://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{args} exited with {popen.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + ready_path, timeout=1.0, verify=scheme == "http").status_code < 500:
                return Proc(popen, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    popen.kill()
    raise RuntimeError(f"{args} did not become ready on {url}:\n{log.read_text(errors='replace')}")


def start_fake_upstream(*extra: str) -> Proc:
    port = free_port()
    return start_process(["-m", "tests.fake_upstream", "--port", str(port), *extra], port, "/v1/models",
                         scheme="https" if "--tls" in extra else "http")


def start_proxy(upstream_url: str, config_text: str | None = None, env: dict[str, str] | None = None,
                *extra: str) -> Proc:
    """Start `toolquake serve` against `upstream_url` (the fake's root URL; /v1 is appended); one worker
    process unless `extra` says `--workers N`."""
    port = free_port()
    args = ["-m", "toolquake", "serve", "--upstream", f"{upstream_url}/v1", "--port", str(port)]
    if "--workers" not in extra:
        args += ["--workers", "1"]
    if config_text is not None:
        cfg = Path(tempfile.mkstemp(prefix="toolquake-", suffix=".toml")[1])
        cfg.write_text(config_text)
        args += ["--config", str(cfg)]
    return start_process([*args, *extra], port, "/healthz", env=env)


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


def recorded(fake: Proc, tag: str) -> list[dict]:
    """What the fake upstream received for requests sent with `X-Test-Tag: tag`."""
    return httpx.get(f"{fake.url}/_fake/requests", params={"tag": tag}, verify=False).json()


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


# -- no orphans: every process the suite starts inherits this marker; at the end none may be alive ---------

ORPHAN_MARK = "TOOLQUAKE_TEST_SESSION"
os.environ.setdefault(ORPHAN_MARK, f"{os.getpid()}-{time.time_ns()}")
_SESSION_MARK = f"{ORPHAN_MARK}={os.environ[ORPHAN_MARK]}".encode()
#: children of pytest that exit with it by design (multiprocessing's helpers)
_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"from multiprocessing.")


def _suite_processes() -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment carries this session's marker."""
    return marked_processes(_SESSION_MARK)


def marked_processes(mark: bytes) -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment holds `mark` (`NAME=value`), with their
    command lines; pytest's own helpers left out."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if stat[0] == "Z" or (int(stat[1]) == me and any(h in cmdline for h in _HELPERS)):
            continue
        found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """Fail the run if a process the suite started is still alive after it (then stop those processes).

    A wrapper, checking after every other `pytest_sessionfinish`: under pytest-xdist (`make test` runs the suite
    in worker processes) the controller's own hook stops the workers there, and the workers' sessions do not
    check (the marker names the controller), so what a worker's tests left running is found here too."""
    yield
    if not sys.platform.startswith("linux") or os.environ.get(ORPHAN_MARK, "").split("-")[0] != str(os.getpid()):
        return  # only the session that set the marker checks (not pytest runs nested inside tests, nor workers)
    deadline = time.monotonic() + 10.0
    left = _suite_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _suite_processes()
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
