"""Finding processes by a marker in their environment: every process the suite starts inherits
`TOOLQUAKE_TEST_SESSION`, and at the end none may be alive (tests/conftest.py's `pytest_sessionfinish`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

ORPHAN_MARK = "TOOLQUAKE_TEST_SESSION"
#: children of pytest that exit with it by design (multiprocessing's helpers)
HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"from multiprocessing.")


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives a process's start time in."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _other_processes(keep: Callable[[bytes], bool]) -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of each process other than this one whose
    environment (its raw bytes) `keep` accepts; processes gone meanwhile or not ours to read are left out."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if not keep(f.read()):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone, a kernel thread, or not ours to read
            continue
        yield int(entry), stat


def unsettled_processes(since: int) -> set[int]:
    """Processes started at or after `since` (boot_ticks()) whose environment reads empty: in the middle of an
    exec (the kernel sets a new program's environment after the old one's close-on-exec files are closed, i.e.
    after `subprocess.Popen` returns) or of an exit. Such a process may carry a marker a moment later."""
    return {pid for pid, stat in _other_processes(lambda env: not env) if stat[0] != "Z" and int(stat[19]) >= since}


def marked_processes(mark: bytes) -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment holds `mark` (`NAME=value`), with their
    command lines; pytest's own helpers left out."""
    found: dict[int, str] = {}
    me = os.getpid()
    for pid, stat in _other_processes(lambda env: mark in env.split(b"\0")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        if stat[0] == "Z" or (int(stat[1]) == me and any(h in cmdline for h in HELPERS)):
            continue
        found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    return found
