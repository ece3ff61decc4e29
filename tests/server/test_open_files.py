"""`toolquake serve` raises its soft open-files limit so `max_client_connections` is what refuses a client (a
503), not EMFILE at 1,024 descriptors; never past the hard limit, with a warning when the hard limit is short."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import start_process, wait_for
from tests.support.scratch import scratch_file

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the limits from /proc/<pid>/limits")

#: the serve command run after lowering this process's limits (the limits are inherited as a shell's ulimit would)
LAUNCH = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
          "sys.argv = ['toolquake', *sys.argv[1:]]; runpy.run_module('toolquake', run_name='__main__')")


def _soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line in /proc/<pid>/limits")


def _serve(fake_upstream, soft: int, hard: int, config: str):
    """`toolquake serve` on a port of its own choosing (it logs the one it got), under the given limits."""
    cfg = scratch_file("open-files-", ".toml")
    cfg.write_text(config)
    try:
        return start_process(["-c", LAUNCH.format(soft=soft, hard=hard), "serve", "--upstream",
                              f"{fake_upstream.url}/v1", "--port", "0", "--workers", "1", "--config", str(cfg)])
    finally:
        cfg.unlink()


def test_soft_limit_raised_to_what_the_limits_need(fake_upstream) -> None:
    proc = _serve(fake_upstream, 1024, 8192, "[server]\nmax_client_connections = 3000\nmax_connections = 100\n")
    try:
        assert _soft_limit(proc.popen.pid) == 3000 + 100 + 256
        assert httpx.post(f"{proc.url}/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
    finally:
        proc.stop()


def test_short_hard_limit_is_used_whole_and_said(fake_upstream) -> None:
    proc = _serve(fake_upstream, 512, 2000, "[server]\nmax_client_connections = 4000\n")
    try:
        assert _soft_limit(proc.popen.pid) == 2000
        wait_for(lambda: "open_files_limit_low" in proc.output(), timeout=10, what="the open_files_limit_low line")
        events = [json.loads(x) for x in proc.log.read_text().splitlines() if x.startswith("{")]
        low = [e for e in events if e.get("event") == "open_files_limit_low"]
        assert low and low[0]["soft"] == 2000 and low[0]["hard"] == 2000 and low[0]["wanted"] == 4000 + 2048 + 256
    finally:
        proc.stop()


def test_a_higher_soft_limit_is_never_lowered(fake_upstream) -> None:
    proc = _serve(fake_upstream, 20000, 20000, "[server]\nmax_client_connections = 10\n")
    try:
        assert _soft_limit(proc.popen.pid) == 20000
    finally:
        proc.stop()

