"""Tracing without a collector to read from (tests/server/test_tracing_phoenix.py reads spans back from Phoenix):
off, the lean path serves what the backend sent byte for byte and forwards the client's trace context untouched;
on, the answers are the same bytes, the backend gets the proxy span's context in the client's trace, and a
collector that is down costs no request (its failed exports are counted); bad settings stop `serve` with a
message that says what to do."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, free_port, recorded
from tests.server.test_proxy_core import metric_value
from toolquake.proxy.server.config import ConfigError, load_config

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}
RESPONSES = {"model": "fake-model", "input": "Weather in Oslo?",
             "tools": [{"type": "function", "name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]}
CASES = [(path, body, stream) for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSES))
         for stream in (False, True)]


def _send(base: str, path: str, body: dict, stream: bool, headers: dict[str, str]) -> bytes:
    r = httpx.post(base + path, json={**body, "stream": stream}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def _trace_headers(tag: str, seq: int) -> tuple[str, dict[str, str]]:
    trace_id = secrets.token_hex(16)
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01", "tracestate": "vendor=abc",
                      "x-test-tag": tag, "x-fake-seq": str(seq), "authorization": "Bearer sk-not-logged"}


def test_tracing_off_lean_path_is_byte_identical(proxy_factory, fake_upstream):
    """The default (tracing off): the lean path's answers are the backend's bytes, and the backend gets the
    client's traceparent and tracestate as they were sent; no tracing metric exists."""
    tq = proxy_factory()
    assert '"served_in":"protocol"' in tq.output().replace(" ", "")
    for i, (path, body, stream) in enumerate(CASES):
        tag = secrets.token_hex(6)
        _, headers = _trace_headers(tag, 1000 + i)
        direct = _send(fake_upstream.url, path, body, stream, {**headers, "x-test-tag": tag + "-direct"})
        assert _send(tq.url, path, body, stream, headers) == direct
        (sent,) = recorded(fake_upstream, tag)
        assert sent["headers"]["traceparent"] == headers["traceparent"]
        assert sent["headers"]["tracestate"] == headers["tracestate"]
    assert "toolquake_tracing" not in httpx.get(f"{tq.url}/metrics").text


def test_tracing_on_same_bytes_new_context_and_a_collector_down_costs_nothing(proxy_factory, fake_upstream):
    """Tracing on, exporting to a port nobody listens on: every answer is still the backend's bytes, the backend
    gets a traceparent in the client's trace whose parent is the proxy's span (the client's tracestate kept),
    and the exports that failed are counted."""
    dead = f"http://127.0.0.1:{free_port()}"
    tq = proxy_factory(None, {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": dead,
                              "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"})
    for i, (path, body, stream) in enumerate(CASES):
        tag = secrets.token_hex(6)
        trace_id, headers = _trace_headers(tag, 2000 + i)
        direct = _send(fake_upstream.url, path, body, stream, {**headers, "x-test-tag": tag + "-direct"})
        assert _send(tq.url, path, body, stream, headers) == direct
        (sent,) = recorded(fake_upstream, tag)
        version, tid, parent, flags = sent["headers"]["traceparent"].split("-")
        assert (version, tid, flags) == ("00", trace_id, "01")
        assert parent != headers["traceparent"].split("-")[2]
        assert sent["headers"]["tracestate"] == "vendor=abc"
    deadline = time.monotonic() + 30
    failed = 0.0
    while time.monotonic() < deadline:
        failed = metric_value(httpx.get(f"{tq.url}/metrics").text, "toolquake_tracing_failures_total", stage="export")
        if failed >= 2 * len(CASES):  # a request span and its upstream call's span each
            break
        time.sleep(0.3)
    assert failed >= 2 * len(CASES)
    assert metric_value(httpx.get(f"{tq.url}/metrics").text, "toolquake_tracing_failures_total", stage="span") == 0
    assert "sk-not-logged" not in tq.output()


@pytest.mark.parametrize("env, says", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "between 0 and 1"),
])
def test_bad_tracing_settings_stop_serve_with_what_to_do(fake_upstream, env, says):
    port = free_port()
    full = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_TRACING": "1", **env}
    done = subprocess.run([sys.executable, "-m", "toolquake", "serve", "--upstream", f"{fake_upstream.url}/v1",
                           "--port", str(port), "--workers", "1"], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode != 0 and says in done.stderr


def test_tracing_settings_from_file_and_environment(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[tracing]\nenabled = true\nOTEL_SERVICE_NAME = "from-file"\n'
                   'OTEL_EXPORTER_OTLP_ENDPOINT = "http://collector:4318"\n')
    from_file = load_config(cfg, env={})
    assert from_file.tracing.enabled and from_file.tracing.otel == {
        "OTEL_SERVICE_NAME": "from-file", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    env = load_config(cfg, env={"OTEL_SERVICE_NAME": "from-env", "TOOLQUAKE_TRACING": "0"})
    assert not env.tracing.enabled and env.tracing.otel["OTEL_SERVICE_NAME"] == "from-env"
    assert not load_config(None, env={}).tracing.enabled  # off by default
    assert load_config(None, env={"TOOLQUAKE_TRACING": "1"}).tracing.enabled
    cfg.write_text('[tracing]\nOTEL_NOT_A_KEY = "x"\n')
    with pytest.raises(ConfigError, match="OTEL_NOT_A_KEY"):
        load_config(cfg, env={})
