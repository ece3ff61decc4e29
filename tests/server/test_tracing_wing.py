"""The tracing wing (`toolquake.proxy.tracing`) attaches from the outside, as live scoring does: the server calls
`hooks.Tracer` / `hooks.TraceHooks` and never imports it (tests/test_architecture.py checks the import contract).
What `[tracing] enabled` does is decided by whoever builds the app: `toolquake serve` and the replay's in-process
proxy attach the wing only then; `create_app` alone never loads it. Each check runs in a fresh interpreter, whose
modules are its own (this process may have imported the wing for other tests)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from tests.support import ROOT, recorded

#: every module of the span machinery, where it lives now and where it lived inside the server
SPAN_MODULES = ("toolquake.proxy.tracing", "toolquake.proxy.server.tracing", "toolquake.proxy.server.spans",
                "toolquake.proxy.server.otlp")

SERVE_UNTRACED = """
import json, socket, sys, threading, time
import httpx, uvicorn
from toolquake.proxy.server.app import create_app
from toolquake.proxy.server.config import load_config

upstream, tag, parent = sys.argv[1:4]
config = load_config(None, env={"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
                     overrides={"upstream": upstream + "/v1"})
assert config.tracing.enabled
app = create_app(config)  # no extension: no tracer
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
thread.start()
deadline = time.monotonic() + 60
while not server.started and time.monotonic() < deadline:
    time.sleep(0.02)
url = "http://127.0.0.1:%d" % sock.getsockname()[1]
r = httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", "messages": [
    {"role": "user", "content": "Weather in Oslo?"}]}, headers={"x-test-tag": tag, "traceparent": parent}, timeout=30)
metrics = httpx.get(url + "/metrics", timeout=30).text
server.should_exit = True
thread.join(30)
print(json.dumps({"status": r.status_code, "modules": sorted(sys.modules), "metrics": metrics,
                  "tracer": type(app.state.proxy.tracing).__name__}))
"""

SERVE_EXTENSIONS = """
import json, sys
from toolquake.proxy.cli.serve import extensions_of
from toolquake.proxy.server.config import load_config

env = {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"} if sys.argv[1] == "on" else {}
names = [f"{e.__module__}.{e.__name__}" for e in extensions_of(load_config(None, env=env))]
print(json.dumps({"extensions": names, "modules": sorted(sys.modules)}))
"""


def _python(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _span_modules(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(SPAN_MODULES)]


def test_create_app_without_the_wing_serves_untraced_even_with_tracing_enabled(fake_upstream):
    """`[tracing] enabled` but the wing not attached: the request is served, the backend gets the client's
    traceparent as it was sent (no span of the proxy's in between), no tracing metric exists, and no module of
    the span machinery was imported: the server's tracer is the no-op `hooks.Tracer`."""
    tag = secrets.token_hex(6)
    parent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    out = _python(SERVE_UNTRACED, fake_upstream.url, tag, parent)
    assert out["status"] == 200
    (sent,) = recorded(fake_upstream, tag)
    assert sent["headers"]["traceparent"] == parent
    assert "toolquake_tracing" not in out["metrics"] and "toolquake_requests_total" in out["metrics"]
    assert _span_modules(out["modules"]) == [] and out["tracer"] == "Tracer"


@pytest.mark.processes
def test_serve_attaches_the_wing_first_and_only_when_tracing_is_enabled():
    """`toolquake serve`'s extensions: off, live scoring and the recorder, and nothing of the wing imported; on,
    the wing first (live scoring hands it the redactor when spans carry contents)."""
    off = _python(SERVE_EXTENSIONS, "off")
    assert off["extensions"] == ["toolquake.proxy.live.attach", "toolquake.proxy.live.recording.attach"]
    assert _span_modules(off["modules"]) == []
    on = _python(SERVE_EXTENSIONS, "on")
    assert on["extensions"] == ["toolquake.proxy.tracing.attach", *off["extensions"]]
