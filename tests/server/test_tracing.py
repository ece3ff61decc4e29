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


def test_our_otlp_encoding_is_the_sdks_byte_for_byte_meaning():
    """proxy/server/otlp.py's ExportTraceServiceRequest, decoded by the official protobuf classes, equals the
    SDK's own encoding of the same spans (remote and local parents, trace state, every attribute type, status)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context

    from toolquake.proxy.server import otlp
    from toolquake.proxy.server.tracing import _GETTER, PROPAGATOR

    finished: list = []

    class Keep(SpanExporter):
        def export(self, spans):
            finished.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": "t", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("toolquake", "0.1.0")
    parent = PROPAGATOR.extract([("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01"), ("tracestate", "v=1")],
                                getter=_GETTER)
    attrs = {"s": "é ✓", "i": 7, "neg": -5, "big": 2**62, "f": 1.5, "t": True, "no": False, "strs": ["a", "b"],
             "ints": [1, -2], "empty": []}
    for kind in (SpanKind.SERVER, SpanKind.INTERNAL):
        root = tracer.start_span("chat m", context=parent if kind == SpanKind.SERVER else None, kind=kind,
                                 attributes=attrs)
        child = tracer.start_span("POST /v1/x", context=set_span_in_context(root), kind=SpanKind.CLIENT)
        child.set_status(StatusCode.ERROR, "boom")
        child.end()
        root.set_status(StatusCode.OK)
        root.end()
    tracer.start_span("bare").end()
    ours = ExportTraceServiceRequest.FromString(otlp.encode(finished))
    assert ours == encode_spans(finished)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == 5
