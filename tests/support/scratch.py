"""Scratch files of a test process (servers' logs, their configs, a fake's scripted answers): made in one folder per
process. Under pytest it is `scratch` in the session's temporary folder (tests/conftest.py says so at session
start), which pytest keeps for the last three runs, so a failed run's server logs can be read; elsewhere (a script
using these helpers) a folder removed when the process exits. Made with `tempfile.mkstemp` directly they stayed
behind in /tmp, thousands a day."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_folder: Path | None = None


def use(folder: Path) -> None:
    """Make this process's scratch files in `folder` (created if missing; not removed at exit)."""
    global _folder
    folder.mkdir(parents=True, exist_ok=True)
    _folder = folder


def _scratch() -> Path:
    global _folder
    if _folder is None or not _folder.is_dir():
        _folder = Path(tempfile.mkdtemp(prefix=f"toolquake-tests-{os.getpid()}-"))
        atexit.register(shutil.rmtree, _folder, True)
    return _folder


def scratch_file(prefix: str, suffix: str = "") -> Path:
    """A new empty file in this process's scratch folder."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=_scratch())
    os.close(fd)
    return Path(name)


def scratch_dir(prefix: str) -> Path:
    """A new empty folder in this process's scratch folder."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_scratch()))
