"""Finding processes by a marker in their environment: every process the suite starts inherits
`TOOLQUAKE_TEST_SESSION`, and at the end none may be alive (tests/conftest.py's `pytest_sessionfinish`)."""

from __future__ import annotations

import os

ORPHAN_MARK = "TOOLQUAKE_TEST_SESSION"
#: children of pytest that exit with it by design (multiprocessing's helpers)
HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"from multiprocessing.")


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat gives a process's start time in."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def unsettled_processes(since: int) -> set[int]:
    """Processes started at or after `since` (boot_ticks()) whose environment reads empty: in the middle of an
    exec (the kernel sets a new program's environment after the old one's close-on-exec files are closed, i.e.
    after `subprocess.Popen` returns) or of an exit. Such a process may carry a marker a moment later."""
    found: set[int] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f.read(1):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone, a kernel thread, or not ours to read
            continue
        if stat[0] != "Z" and int(stat[19]) >= since:
            found.add(int(entry))
    return found


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
        if stat[0] == "Z" or (int(stat[1]) == me and any(h in cmdline for h in HELPERS)):
            continue
        found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    return found
