"""Finding processes by a marker in their environment: every process the suite starts inherits
`TOOLQUAKE_TEST_SESSION`, and at the end none may be alive (tests/conftest.py's `pytest_sessionfinish`)."""

from __future__ import annotations

import os

ORPHAN_MARK = "TOOLQUAKE_TEST_SESSION"
#: children of pytest that exit with it by design (multiprocessing's helpers)
HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"from multiprocessing.")


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
