"""Scratch files of a test process (servers' logs, their configs, a fake's scripted answers): made in one folder per
process, which is removed when the process exits. Made with `tempfile.mkstemp` directly they stayed behind in /tmp,
thousands a day (a test's `tmp_path` is for files a test owns; these belong to helpers that outlive no test but
have no test's folder at hand)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_folder: Path | None = None


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
