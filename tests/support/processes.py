"""Real processes on loopback: start one, learn the port it bound, wait until it answers, stop it.

Every server of the project binds port 0 when told `--port 0` and says the port it got: `toolquake serve` logs a
`listening` event (JSON, with `url`), the fake upstream and the embedded backend print `listening on URL`. No port
is picked here and bound later by a child (under pytest-xdist two workers could pick the same one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.scratch import scratch_file
from toolquake.proxy.backend.local import listening_url

ROOT = Path(__file__).resolve().parent.parent.parent

#: how long a server may take to start on a loaded 2-core machine (a bound on a hang, not a speed check)
START_TIMEOUT_S = 60.0


@dataclass
class Proc:
    popen: subprocess.Popen
    url: str
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

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


def _read_url(popen: subprocess.Popen, log: Path, args: list[str], deadline: float) -> str:
    seen = 0
    pending = b""
    while time.monotonic() < deadline:
        with log.open("rb") as f:
            f.seek(seen)
            chunk = f.read()
        seen += len(chunk)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            url = listening_url(raw.decode(errors="replace"))
            if url:
                return url.replace("://0.0.0.0:", "://127.0.0.1:")
        if popen.poll() is not None:
            raise RuntimeError(f"{args} exited with {popen.returncode}:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    popen.kill()
    popen.wait(5)
    raise RuntimeError(f"{args} never said where it listens:\n{log.read_text(errors='replace')}")


def start_process(args: list[str], port: int | None = None, ready_path: str = "/healthz",
                  env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S, cwd: Path = ROOT,
                  scheme: str = "http") -> Proc:
    """Start `args` (a python module command line) in `cwd` and wait until GET ready_path answers (over `scheme`;
    https: any certificate). `port` None: the command binds port 0 (its `--port 0`) and its output says the URL;
    a number: a server that cannot say, told to listen there (a `tests.support.ports.held_port`)."""
    log = scratch_file("proc-", ".log")
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, stdout=out,
                                 stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    if port is None:
        url = _read_url(popen, log, args, deadline)
    else:
        url = f"{scheme}://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{args} exited with {popen.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + ready_path, timeout=2.0, verify=False).status_code < 500:
                return Proc(popen, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    popen.kill()
    popen.wait(5)
    raise RuntimeError(f"{args} did not become ready on {url}:\n{log.read_text(errors='replace')}")


def start_fake_upstream(*extra: str) -> Proc:
    """tests/fake_upstream.py as its own process on a port of its own choosing."""
    return start_process(["-m", "tests.fake_upstream", "--port", "0", *extra], None, "/v1/models")


def start_proxy(upstream_url: str, config_text: str | None = None, env: dict[str, str] | None = None,
                *extra: str) -> Proc:
    """Start `toolquake serve` against `upstream_url` (the fake's root URL; /v1 is appended) on a port of its own
    choosing; one worker process unless `extra` says `--workers N`."""
    args = ["-m", "toolquake", "serve", "--upstream", f"{upstream_url}/v1"]
    if "--port" not in extra:
        args += ["--port", "0"]
    if "--workers" not in extra:
        args += ["--workers", "1"]
    if config_text is not None:
        cfg = scratch_file("config-", ".toml")
        cfg.write_text(config_text)
        args += ["--config", str(cfg)]
    return start_process([*args, *extra], None, "/healthz", env=env)


def recorded(fake: Proc, tag: str) -> list[dict]:
    """What the fake upstream received for requests sent with `X-Test-Tag: tag`."""
    return httpx.get(f"{fake.url}/_fake/requests", params={"tag": tag}, verify=False).json()
