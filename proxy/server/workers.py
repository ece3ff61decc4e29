"""Several worker processes on one port (`toolquake serve --workers N`).

The supervisor binds the listening socket once, forks N workers that each run the whole app on it
(the kernel hands each new connection to one of them), forwards SIGTERM/SIGINT to them, waits for
their graceful shutdown (in-flight requests and streams finish), and starts a worker again if one
dies after it had been serving. Workers ask the kernel for SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG), so none outlives it.

What workers share lives in one temporary directory (`Runtime`): prometheus-client's multiprocess
files (`/metrics` on any worker reports the sum over all of them) and the profiles changed through the
admin API (`profiles.SharedProfiles`).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

log = structlog.get_logger("toolquake.proxy")
_PR_SET_PDEATHSIG = 1
#: a worker that dies sooner than this after it started is not started again (a crash at start-up)
MIN_UPTIME_S = 5.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


def default_workers() -> int:
    """The CPUs this process may use: its CPU affinity, capped by the cgroup's CPU quota (containers)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


@dataclass
class Runtime:
    """The directory the workers of one server share; removed when the supervisor exits."""

    root: Path

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def profiles(self) -> Path:
        return self.root / "profiles"

    @classmethod
    def create(cls) -> Runtime:
        rt = cls(Path(tempfile.mkdtemp(prefix="toolquake-workers-")))
        rt.metrics.mkdir()
        rt.profiles.mkdir()
        return rt

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every worker accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before the request above
        os._exit(1)


def use_multiprocess_metrics(directory: Path) -> None:
    """Metric values go to per-process files in `directory` (prometheus-client's multiprocess mode)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue()


def _spawn(run_worker: Callable[[], None], parent: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(parent)
        run_worker()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a worker's last words go to the log, then it exits
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never run the supervisor's atexit handlers or finally blocks in a worker


def supervise(n: int, sock: socket.socket, run_worker: Callable[[], None], runtime: Runtime,
              grace_s: float) -> int:
    """Fork `n` workers running `run_worker()` and supervise them until SIGTERM/SIGINT; the exit status."""
    from prometheus_client import multiprocess

    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # taken with sigtimedwait below; workers unblock them
    children: dict[int, float] = {}
    for _ in range(n):
        children[_spawn(run_worker, parent)] = time.monotonic()
    log.info("workers_started", workers=n, pids=sorted(children))
    status = 0
    try:
        while True:
            info = signal.sigtimedwait(_SIGNALS, 1.0)
            if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                break
            for pid, code in _reap(children):
                multiprocess.mark_process_dead(pid, str(runtime.metrics))
                uptime = time.monotonic() - children.pop(pid)
                if uptime < MIN_UPTIME_S:
                    log.error("worker_failed_at_start", pid=pid, exit_status=code)
                    status = 1
                    break
                log.warning("worker_died", pid=pid, exit_status=code, uptime_s=round(uptime, 1))
                children[_spawn(run_worker, parent)] = time.monotonic()
            if status:
                break
    finally:
        sock.close()  # new connections are refused now, not queued for workers that are leaving
        _stop(children, grace_s)
        runtime.remove()
    return status


def _reap(children: dict[int, float]) -> list[tuple[int, int]]:
    dead = []
    while children:
        try:
            pid, wstatus = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in children:
            dead.append((pid, os.waitstatus_to_exitcode(wstatus)))
    return dead


def _stop(children: dict[int, float], grace_s: float) -> None:
    """SIGTERM to every worker (each finishes what it is serving), SIGKILL to any still alive after grace_s."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        for pid, _ in _reap(children):
            children.pop(pid, None)
        time.sleep(0.05)
    for pid in children:
        log.warning("worker_killed", pid=pid)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
