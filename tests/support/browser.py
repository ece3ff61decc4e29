"""Headless Chromium on a report page: where the browser is (the test is skipped where there is none), one run of it
on a URL with the network requests the page itself started (from Chromium's net log), and its console lines."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--disable-default-apps", "--enable-logging=stderr", "--v=0",
                  "--virtual-time-budget=3000"]


def chromium() -> str:
    """The Chromium binary; the test is skipped where there is none."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install -y chromium; `make tools`)")
    return browser


def open_page(browser: str, tmp_path: Path, url: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run headless Chromium on `url`; returns the run and every network request the page itself started
    (read from Chromium's net log: requests in the page's file:// network partition, other than file: and data:)."""
    netlog = tmp_path / f"net-{len(list(tmp_path.glob('net-*')))}.json"
    r = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                        f"--log-net-log={netlog}", *args, url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads(netlog.read_text())
    started = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requests = [e["params"]["url"] for e in log["events"] if e["type"] == started
                and "file://" in e["params"].get("network_isolation_key", "")
                and not e["params"]["url"].startswith(("file:", "data:"))]
    return r, requests


def console(stderr: str) -> list[str]:
    """The page's console lines in Chromium's log."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]
