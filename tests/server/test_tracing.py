"""Tracing without a collector to read from (tests/server/test_tracing_phoenix.py reads spans back from Phoenix):
off, the lean path serves what the backend sent byte for byte and forwards the client's trace context untouched;
on, the answers are the same bytes, the backend gets the proxy span's context in the client's trace, and a
collector that is down costs no request (its failed exports are counted); bad settings stop `serve` with a
message that says what to do."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import ROOT, metric_samples, metric_value, metrics_text, recorded, scraped, start_proxy, wait_for
from tests.support import tracing as tracing_support
from tests.support.ports import refusing_url
from tests.support.tracing import LINEAR_GROWTH, SIZES, per_byte_growth, sink_spans
from toolquake.proxy.server.config import ConfigError, load_config
from toolquake.proxy.tracing import otlp
from toolquake.proxy.tracing.spans import Span

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


def test_tracing_off_lean_path_is_byte_identical(proxy, fake_upstream):
    """The default (tracing off; the session's proxy): the lean path's answers are the backend's bytes, and the
    backend gets the client's traceparent and tracestate as they were sent; no tracing metric exists."""
    tq = proxy
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


@pytest.fixture
def refused():
    """A collector's URL on a port bound but never listened on: every export to it is refused."""
    with refusing_url() as url:
        yield url


def test_tracing_on_same_bytes_new_context_and_a_collector_down_costs_nothing(refused, proxy_factory, fake_upstream):
    """Tracing on, exporting to a port nobody listens on: every answer is still the backend's bytes, the backend
    gets a traceparent in the client's trace whose parent is the proxy's span (the client's tracestate kept),
    and the exports that failed are counted."""
    tq = proxy_factory(None, {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": refused,
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
    # a request span and its upstream call's span each
    wait_for(lambda: scraped(tq, "toolquake_tracing_failures_total", stage="export") >= 2 * len(CASES), 60,
             "the failed exports to be counted")
    assert scraped(tq, "toolquake_tracing_failures_total", stage="span") == 0
    assert "sk-not-logged" not in tq.output()


BAD_SETTINGS = [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "between 0 and 1"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=a%0D%0Ax-injected: 1"}, "no line break"),  # header injection
    ({"OTEL_EXPORTER_OTLP_HEADERS": "x%20tenant=a"}, "a name is a token"),
]


@pytest.mark.parametrize("env, says", BAD_SETTINGS)
def test_bad_tracing_settings_stop_serve_with_what_to_do(env, says):
    """`serve` checks the tracing settings before it serves (`extensions_of`): each bad one ends it with a message
    that says what to do (the command itself: test_serve_stops_on_a_bad_tracing_setting)."""
    from toolquake.proxy.cli.serve import extensions_of

    with pytest.raises(SystemExit) as stopped:
        extensions_of(load_config(None, env={"TOOLQUAKE_TRACING": "1", **env}))
    assert isinstance(stopped.value.code, str) and stopped.value.code.startswith("toolquake: ")
    assert says in stopped.value.code


def test_serve_stops_on_a_bad_tracing_setting(fake_upstream):
    """`toolquake serve` itself, given a bad setting: it exits non-zero with the message on stderr, before it
    listens (it never says `listening`)."""
    env, says = BAD_SETTINGS[-2]
    full = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_TRACING": "1", **env}
    done = subprocess.run([sys.executable, "-m", "toolquake", "serve", "--upstream", f"{fake_upstream.url}/v1",
                           "--port", "0", "--workers", "1"], env=full, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode != 0 and says in done.stderr
    assert '"listening"' not in done.stdout + done.stderr


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


def _ours(sdk_span, fixed: int = 0) -> Span:
    """The same span as toolquake's own record (its ids, times, attributes and status copied); its first `fixed`
    attributes given already encoded (`Span.fixed`), as the proxy gives a route's and profile's."""
    ctx, parent = sdk_span.context, sdk_span.parent
    attrs = list(sdk_span.attributes.items())
    ours = Span(None, ctx.trace_id, parent.span_id if parent else 0, bool(parent and parent.is_remote), sdk_span.name,
                sdk_span.kind.value + 1, sdk_span.start_time, dict(attrs[fixed:]),
                ctx.trace_state.to_header() if ctx.trace_state else None,
                fixed=otlp.attributes(b"\x4a", dict(attrs[:fixed])))
    ours.span_id, ours.end = ctx.span_id, sdk_span.end_time
    ours.status, ours.description = sdk_span.status.status_code.value, sdk_span.status.description or ""
    return ours


def test_our_otlp_encoding_is_the_sdks_byte_for_byte_meaning():
    """proxy/tracing/otlp.py's ExportTraceServiceRequest of toolquake's span records, decoded by the official
    protobuf classes, equals the OpenTelemetry SDK's own encoding of the same spans made by the SDK (remote and
    local parents, trace state, every attribute type, status), three times (the second from the encoder's caches, the
    third with some attributes encoded beforehand, as `Span.fixed`)."""
    pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK (dev extra) is the reference encoding")
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    finished: list = []

    class Keep(SpanExporter):
        def export(self, spans):
            finished.extend(spans)
            return SpanExportResult.SUCCESS

    resource = Resource.create({"service.name": "t", "n": 3})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("toolquake", "0.1.0")
    parent = TraceContextTextMapPropagator().extract({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01",
                                                      "tracestate": "v=1"})
    attrs = {"s": "é ✓", "i": 7, "neg": -5, "big": 2**62, "f": 1.5, "t": True, "no": False, "strs": ["a", "b"],
             "ints": [1, -2], "empty": [], "long": "x" * 300, "toolquake.request_id": "abc"}
    for kind in (SpanKind.SERVER, SpanKind.INTERNAL):
        root = tracer.start_span("chat m", context=parent if kind == SpanKind.SERVER else None, kind=kind,
                                 attributes=attrs if kind == SpanKind.SERVER else  # equal values, other types
                                 {**attrs, "t": 1, "no": 0, "i": True, "f": 1, "strs": ["a", "c"]})
        child = tracer.start_span("POST /v1/x", context=set_span_in_context(root), kind=SpanKind.CLIENT)
        child.set_status(StatusCode.ERROR, "boom")
        child.end()
        root.set_status(StatusCode.OK)
        root.end()
    tracer.start_span("bare").end()
    for fixed in (0, 0, 5):  # the second time from the encoder's caches; then with attributes encoded beforehand
        ours = ExportTraceServiceRequest.FromString(otlp.encode(
            [_ours(s, fixed) for s in finished], otlp.resource(dict(resource.attributes)),
            otlp.scope("toolquake", "0.1.0")))
        assert ours == encode_spans(finished)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == 5


sink = tracing_support.sink  # the module's OTLP collector (a fixture)

#: a profile that repairs answers, beside the default route's (the lean path: routes are chosen per request)
TRACED_CONFIG = '[profiles.fixed]\nmode = "off"\nrepair = true\n'


@pytest.fixture(scope="module")
def traced(fake_upstream, sink):
    """One proxy with tracing on, exporting to the module's collector every 100 ms, for the tests that only send
    to it and read their own traces back (each under trace ids of its own)."""
    proc = start_proxy(fake_upstream.url, TRACED_CONFIG, {"TOOLQUAKE_TRACING": "1",
                                                           "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                                                           "OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield proc
    proc.stop()


GOOD_TRACE, GOOD_PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HOSTILE_TRACEPARENTS = [
    ("garbage", ["not-a-traceparent"]),
    ("uppercase hex", [f"00-{GOOD_TRACE.upper()}-{GOOD_PARENT}-01"]),
    ("zero trace id", [f"00-{'0' * 32}-{GOOD_PARENT}-01"]),
    ("zero parent id", [f"00-{GOOD_TRACE}-{'0' * 16}-01"]),
    ("version ff", [f"ff-{GOOD_TRACE}-{GOOD_PARENT}-01"]),
    ("version 00 with more", [f"00-{GOOD_TRACE}-{GOOD_PARENT}-01-extra"]),
    ("a later version glued", [f"cc-{GOOD_TRACE}-{GOOD_PARENT}-01extra"]),
    ("short", [f"00-{GOOD_TRACE[:-1]}-{GOOD_PARENT}-01"]),
    ("sign and underscore (int() would take them)", [f"00-+{GOOD_TRACE[1:-1]}_-{GOOD_PARENT}-01"]),
    ("oversized", [f"01-{GOOD_TRACE}-{GOOD_PARENT}-01-" + "a" * 6000]),
    ("repeated", [f"00-{GOOD_TRACE}-{GOOD_PARENT}-01", f"00-{GOOD_TRACE}-{'1' * 16}-01"]),
    ("latin-1 bytes", [f"00-{GOOD_TRACE[:-2]}\xe9\xe9-{GOOD_PARENT}-01"]),
]


def test_trace_context_parser_refuses_what_is_not_w3c():
    """The parser alone: the W3C format checked by position and character set, a later version's extra fields
    skipped, an invalid or oversized tracestate dropped as a whole, in linear time on large input."""
    from toolquake.proxy.tracing.spans import extract, parse_traceparent, parse_tracestate

    assert parse_traceparent(f"00-{GOOD_TRACE}-{GOOD_PARENT}-01") == (int(GOOD_TRACE, 16), int(GOOD_PARENT, 16), True)
    assert parse_traceparent(f"00-{GOOD_TRACE}-{GOOD_PARENT}-02") == (int(GOOD_TRACE, 16), int(GOOD_PARENT, 16), False)
    assert parse_traceparent(f"cc-{GOOD_TRACE}-{GOOD_PARENT}-01-what-comes-later")[2] is True
    for label, values in HOSTILE_TRACEPARENTS:
        assert extract([("traceparent", v) for v in values]) is None, label
    assert parse_tracestate(["a=1,b@c=2", " d=3 ,,"]) == "a=1,b@c=2,d=3"
    for bad in (["a=1,a=2"], ["A=1"], ["a"], ["a=x=y"], ["a=1" + ",b=2" * 40], ["k=" + "v" * 300], ["1a=2"],
                ["a@b@c=1"], ["a=\x01"]):
        assert parse_tracestate(bad) is None, bad
    ctx = extract([("TraceParent", f"00-{GOOD_TRACE}-{GOOD_PARENT}-01"), ("tracestate", "a=1"),
                   ("tracestate", "b=2")])
    assert (ctx.trace_id, ctx.span_id, ctx.sampled, ctx.tracestate) == (int(GOOD_TRACE, 16), int(GOOD_PARENT, 16),
                                                                       True, "a=1,b=2")

    def hostile(chars: int):
        tracestate, traceparent = ["a=1," * (chars // 4)], "-" * chars

        def read() -> None:
            assert parse_tracestate(tracestate) is None and parse_traceparent(traceparent) is None
            assert extract([("traceparent", traceparent)] * 1000) is None
        return read

    growth = per_byte_growth(hostile, *SIZES)
    assert growth < LINEAR_GROWTH, f"a byte of a {SIZES[1]}-byte header costs {growth:.1f} times one of {SIZES[0]}"


def test_hostile_trace_headers_are_served_with_a_fresh_trace(traced, fake_upstream, sink):
    """Malformed, oversized, repeated and wrongly versioned traceparents (and a hostile tracestate): each request
    is served the backend's bytes, the backend gets a fresh trace (a new trace id, not the client's, sampled) and
    the collector gets that trace's request span, a root, with its upstream call under it."""
    tq = traced
    fresh: dict[str, str] = {}
    for i, (label, values) in enumerate(HOSTILE_TRACEPARENTS):
        tag = secrets.token_hex(6)
        hostile = [("traceparent", v.encode("latin-1")) for v in values]
        hostile += [("tracestate", b"a=1," * 2000), ("tracestate", b"\xff=\xfe")]
        common = [("x-test-tag", tag.encode()), ("x-fake-seq", str(3000 + i).encode())]
        direct = httpx.post(fake_upstream.url + "/v1/chat/completions", json=CHAT, timeout=30,
                            headers=[("x-test-tag", (tag + "-direct").encode()), common[1]])
        got = httpx.post(tq.url + "/v1/chat/completions", json=CHAT, headers=common + hostile, timeout=30)
        assert got.status_code == 200 and got.content == direct.content, label
        (sent,) = recorded(fake_upstream, tag)
        version, tid, parent, flags = sent["headers"]["traceparent"].split("-")
        assert (version, flags) == ("00", "01") and tid not in (GOOD_TRACE, GOOD_TRACE.upper()), label
        assert "tracestate" not in sent["headers"], label
        fresh[tid] = parent
    spans = sink_spans(sink, set(fresh), 2 * len(fresh))
    for tid, upstream_id in fresh.items():
        mine = {s["span_id"]: s for s in spans if s["trace_id"] == tid}
        request = [s for s in mine.values() if s["name"] == "chat fake-model"]
        assert len(request) == 1 and request[0]["parent_id"] == "", tid
        assert mine[upstream_id]["parent_id"] == request[0]["span_id"]
        assert mine[upstream_id]["name"] == "POST /v1/chat/completions"
    metrics = httpx.get(f"{tq.url}/metrics").text
    assert metric_value(metrics, "toolquake_tracing_failures_total", stage="span") == 0


def test_sampled_out_requests_export_nothing_and_forward_an_unsampled_context(traced, fake_upstream, sink):
    """The default sampler (parent-based): a client whose trace is not sampled (flag 00) gets its answer, the
    backend gets the client's trace with a new parent id and flag 00, and no span of that trace is ever
    exported; a sampled request of the same proxy, sent after them, is exported (the collector does read)."""
    tq = traced
    unsampled = set()
    for i, (path, body, stream) in enumerate(CASES):
        tag = secrets.token_hex(6)
        trace_id, headers = _trace_headers(tag, 4000 + i)
        client_parent = secrets.token_hex(8)
        headers["traceparent"] = f"00-{trace_id}-{client_parent}-00"
        direct = _send(fake_upstream.url, path, body, stream, {**headers, "x-test-tag": tag + "-direct"})
        assert _send(tq.url, path, body, stream, headers) == direct
        (sent,) = recorded(fake_upstream, tag)
        version, tid, parent, flags = sent["headers"]["traceparent"].split("-")
        assert (version, tid, flags) == ("00", trace_id, "00") and parent != client_parent
        assert sent["headers"]["tracestate"] == "vendor=abc"
        unsampled.add(trace_id)
    tag = secrets.token_hex(6)
    sampled_id, headers = _trace_headers(tag, 4100)
    _send(tq.url, "/v1/chat/completions", CHAT, False, headers)
    spans = sink_spans(sink, unsampled | {sampled_id}, 2)
    assert {s["trace_id"] for s in spans} == {sampled_id}
    assert len(spans) == 2


def test_a_full_span_queue_drops_and_counts(sink):
    """The exporter's queue is bounded (OTEL_BSP_MAX_QUEUE_SIZE): spans past it are dropped and counted, never
    queued, and a span that cannot be encoded (an id out of range) is left out as it ends and counted; once its
    thread runs, what was queued reaches the collector."""
    from prometheus_client import CollectorRegistry, Counter

    from toolquake.proxy.tracing.spans import SERVER, Exporter

    failures = Counter("t_failures", "t", registry=CollectorRegistry())
    exporter = Exporter(sink.url + "/v1/traces", {"OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_BSP_SCHEDULE_DELAY": "50"},
                        {"service.name": "t"}, "0", failures)
    trace_id = int(secrets.token_hex(16), 16)
    Span(exporter, 1 << 130, 0, False, "bad", SERVER, time.time_ns(), {}, None).finish()
    for i in range(5):
        Span(exporter, trace_id, 0, False, f"s{i}", SERVER, time.time_ns(), {"i": i}, None).finish()
    assert len(exporter.queue) == 4 and failures._value.get() == 2
    exporter.start()
    try:
        spans = sink_spans(sink, {f"{trace_id:032x}"}, 4)
    finally:
        exporter.shutdown()
    assert sorted(s["name"] for s in spans) == ["s0", "s1", "s2", "s3"]
    assert failures._value.get() == 2


def test_a_pair_of_spans_takes_the_room_left_and_the_rest_is_counted_dropped():
    """`Exporter.put_pair` (a passed-through request's two spans): both queued where both fit, in order; with one
    place left the first is queued and the second dropped and counted; with none, both."""
    from prometheus_client import CollectorRegistry, Counter

    from toolquake.proxy.tracing.spans import Exporter

    failures = Counter("t_pair_failures", "t", registry=CollectorRegistry())
    exporter = Exporter("http://127.0.0.1:9/v1/traces", {"OTEL_BSP_MAX_QUEUE_SIZE": "5"}, {"service.name": "t"},
                        "0", failures)
    for i in range(4):
        exporter.put_pair(b"a%d" % i, b"b%d" % i)
    assert list(exporter.queue) == [b"a0", b"b0", b"a1", b"b1", b"a2"]
    assert failures._value.get() == 3 and exporter.dropped == 3


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _chunk(choices: list, **extra) -> dict:
    return {"id": "c-1", "object": "chat.completion.chunk", "model": "m", "choices": choices, **extra}


SUMMARIZED_STREAMS = {
    "two calls, a name in two pieces, usage last": _sse(
        _chunk([{"index": 0, "delta": {"role": "assistant"}}]),
        _chunk([{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "get_"}}]}}]),
        _chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "find"}}]}}]),
        _chunk([{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"name": "time", "arguments": "1"}}]}}]),
        _chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
        _chunk([], usage={"prompt_tokens": 9, "completion_tokens": 4}), b"[DONE]"),
    "two choices out of order, calls without an index": _sse(
        _chunk([{"index": 1, "delta": {"content": "hi"}}, {"index": 0, "delta": {"tool_calls": [
            {"function": {"name": "a"}}, {"function": {"name": "b"}}]}}]),
        _chunk([{"index": 1, "delta": {}, "finish_reason": "stop"}, {"index": 0, "finish_reason": "length"}]),
        b"[DONE]"),
    "id and model only in a later chunk, text only": _sse(
        {"choices": [{"delta": {"content": "x"}}]}, _chunk([{"delta": {}, "finish_reason": "stop"}])),
}
#: streams the summary leaves to the assembler (it returns None): an event it would read differently
ASSEMBLED_STREAMS = {
    "not JSON": _sse(b"{oops", _chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])),
    "an index that is null": _sse(_chunk([{"index": None, "delta": {"content": "x"}}])),
    "a call that is a string": _sse(_chunk([{"index": 0, "delta": {"tool_calls": ["x"]}}])),
    "a function that is a list": _sse(_chunk([{"index": 0, "delta": {"tool_calls": [{"function": ["f"]}]}}])),
}


def test_a_streams_summary_gives_the_attributes_the_assembled_answer_gives():
    """`summarize_sse` (what a relayed stream's span reads when nobody else reads the answer) gives the same
    gen_ai attributes as the stream assembled whole, on the fake upstream's own streams and on odd ones; an event
    it would read differently makes it give up (None), and the stream is assembled as before."""
    from tests.fake_upstream import completion, stream_frames
    from toolquake.proxy.server.streaming import assemble_sse, summarize_sse
    from toolquake.proxy.tracing.tracer import answer_attributes

    fake = [b"".join(stream_frames(completion(answer, "fake-model"), piece))
            for answer in ({"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                      {"name": "get_time", "arguments": "{}"}]}, {"text": "It is sunny in Oslo."})
            for piece in (1, 8)]
    for i, data in enumerate(fake + list(SUMMARIZED_STREAMS.values())):
        summary = summarize_sse(data)
        assert summary is not None, i
        assert answer_attributes(summary) == answer_attributes(assemble_sse(data)), i
    assert answer_attributes(summarize_sse(fake[0]))["toolquake.answer.tool_calls"] == ["get_weather", "get_time"]
    for label, data in ASSEMBLED_STREAMS.items():
        assert summarize_sse(data) is None, label


def test_a_relayed_streams_span_has_the_answers_attributes(traced, fake_upstream, sink):
    """Tracing on, nobody else reading the answer (the stream is summarized, not assembled): the request span's
    response attributes, read back from the collector, are those of the answer the client got (assembled here from
    its bytes); the same for a whole answer."""
    from toolquake.proxy.server.streaming import assemble_sse
    from toolquake.proxy.tracing.tracer import answer_attributes

    tq = traced
    answer = json.dumps({"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                   {"name": "get_time", "arguments": {}}]})
    expected = {}
    for stream in (True, False):
        trace_id = secrets.token_hex(16)
        got = httpx.post(tq.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30,
                         headers={"x-fake-answer": answer, "traceparent": f"00-{trace_id}-{'ab' * 8}-01"})
        assert got.status_code == 200
        expected[trace_id] = answer_attributes(assemble_sse(got.content) if stream else got.json())
        assert expected[trace_id]["toolquake.answer.tool_calls"] == ["get_weather", "get_time"]
    spans = sink_spans(sink, set(expected), 2 * len(expected))
    for trace_id, attrs in expected.items():
        (request,) = [s for s in spans if s["trace_id"] == trace_id and s["name"] == "chat fake-model"]
        assert {k: request["values"].get(k) for k in attrs} == attrs, trace_id


#: whole answers the proxy's check refuses or lets through (fault, the `raw` fault's body)
ODD_ANSWERS = {
    "not JSON": ("invalid-json", None),
    "nested past the decoder's limit": ("deep-json", None),
    "an array": ("raw", "[1, 2]"),
    "a string": ("raw", '"chatcmpl"'),
    "an empty object": ("raw", "{}"),
    "values of other types": ("raw", json.dumps({
        "id": 7, "model": ["m"], "usage": {"prompt_tokens": "3", "completion_tokens": 2},
        "choices": [{"finish_reason": "stop", "message": {"tool_calls": [{"function": {"name": 5}}, 3]}}]})),
    "a chat completion": ("raw", json.dumps({
        "id": "chatcmpl-7", "model": "m", "usage": {"prompt_tokens": 31, "completion_tokens": 4000},
        "choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [{"function": {"name": "f"}}]}}]})),
}


def test_a_whole_answer_is_checked_as_with_tracing_off_and_read_in_that_check(proxy, traced, fake_upstream, sink):
    """Tracing on, a passed-through whole answer is read for its span in the proxy's check that it is a JSON
    object (one decode for both): what the check lets through, or refuses and how, is what it does with tracing
    off, for answers of every kind; the span of one let through has what `answer_attributes` reads of it."""
    from toolquake.proxy.tracing.tracer import answer_attributes

    off, on = proxy, traced
    expected = {}
    for name, (fault, body) in ODD_ANSWERS.items():
        headers = {"x-fake-fault": fault, **({"x-fake-body": body} if body is not None else {})}
        got = {}
        for which, tq in (("off", off), ("on", on)):
            trace_id = secrets.token_hex(16)
            r = httpx.post(tq.url + "/v1/chat/completions", json=CHAT, timeout=30,
                           headers={**headers, "traceparent": f"00-{trace_id}-{'ef' * 8}-01"})
            got[which] = (r.status_code, r.content if r.status_code == 200 else r.json()["error"])
        assert got["on"] == got["off"], name
        if got["on"][0] == 200:
            expected[trace_id] = answer_attributes(json.loads(body))
    assert len(expected) == 3  # the empty object, the odd types and the chat completion were let through
    spans = sink_spans(sink, set(expected), 2 * len(expected))
    for trace_id, attrs in expected.items():
        (request,) = [s for s in spans if s["trace_id"] == trace_id and s["kind"] == 2]
        assert {k: request["values"].get(k) for k in attrs} == attrs, attrs
        if "gen_ai.usage.output_tokens" not in attrs:
            assert "gen_ai.usage.output_tokens" not in request["values"]


def test_a_repaired_answers_span_reads_the_answer_the_client_got_and_says_the_repair(traced, fake_upstream, sink):
    """A profile that repairs answers (`repair = true`) decodes a passed-through request's whole answer (a `WHOLE`
    step), so the trace step reads it as the client gets it (an `ANSWER` step, not in the check): an answer left
    alone and one repaired (a call left in the text) both have the response attributes of the answer the client
    got, the repaired one the rule its repair fixed too (before, the span read the backend's bytes: no call)."""
    from toolquake.proxy.tracing.tracer import answer_attributes

    tq = traced  # its profile `fixed` repairs
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    answers = {"left alone": json.dumps({"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}),
               "repaired": json.dumps({"text": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                               '\n</tool_call>'})}
    got = {}
    for name, answer in answers.items():
        trace_id = secrets.token_hex(16)
        r = httpx.post(tq.url + "/p/fixed/v1/chat/completions", json={**CHAT, "tools": tools}, timeout=30,
                       headers={"x-fake-answer": answer, "traceparent": f"00-{trace_id}-{'a1' * 8}-01"})
        assert r.status_code == 200
        got[trace_id] = (name, r.json())
    spans = sink_spans(sink, set(got), 2 * len(got))
    for trace_id, (name, answer) in got.items():
        (request,) = [s for s in spans if s["trace_id"] == trace_id and s["kind"] == 2]
        values = request["values"]
        attrs = answer_attributes(answer)
        assert attrs["toolquake.answer.tool_calls"] == ["get_weather"], name
        assert {k: values.get(k) for k in attrs} == attrs, name
        assert values.get("toolquake.conformance.repaired") == (None if name == "left alone"
                                                                else "call_in_content_hermes")


_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**70),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_JSON = st.recursive(_JSON_LEAF, lambda children: st.lists(children, max_size=3)
                     | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=12)
_FUNCTION = st.one_of(_JSON, st.fixed_dictionaries({}, optional={"name": _JSON, "arguments": _JSON}))
_CALL = st.one_of(_JSON, st.fixed_dictionaries({}, optional={"id": _JSON, "function": _FUNCTION}))
_MESSAGE = st.one_of(_JSON, st.fixed_dictionaries({}, optional={
    "content": _JSON, "tool_calls": st.one_of(_JSON, st.lists(_CALL, max_size=3))}))
_CHOICE = st.one_of(_JSON, st.fixed_dictionaries({}, optional={"index": _JSON, "finish_reason": _JSON,
                                                               "message": _MESSAGE}))
_ANSWER = st.fixed_dictionaries({}, optional={
    "id": _JSON, "model": _JSON, "object": _JSON, "choices": st.one_of(_JSON, st.lists(_CHOICE, max_size=3)),
    "usage": st.one_of(_JSON, st.fixed_dictionaries({}, optional={"prompt_tokens": _JSON,
                                                                   "completion_tokens": _JSON}))})


@settings(max_examples=400, deadline=None)
@given(_ANSWER)
def test_a_relayed_answers_summary_is_the_decoded_answers(answer):
    """What a passed-through request's span reads of its answer's bytes (`relayed_summary`, `checked_summary`: a
    few fields read, the rest skipped) is what `answer_summary` reads of the same answer decoded whole, whatever
    its shape; and the proxy's check that reads them so lets the object through (hands it a dict)."""
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.tracing.tracer import answer_summary, checked_summary, relayed_summary

    data = json.dumps(answer).encode()
    assert relayed_summary(CHAT_API, False, data) == answer_summary(json.loads(data))
    summary, checked = checked_summary(CHAT_API, data)
    assert summary == answer_summary(json.loads(data)) and isinstance(checked, dict)


_ID = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(trace_id=st.integers(1, (1 << 128) - 1), span_id=st.integers(1, (1 << 64) - 1),
       parent=st.one_of(st.just(0), st.integers(1, (1 << 64) - 1)), remote=st.booleans(),
       up_id=st.integers(1, (1 << 64) - 1), times=st.lists(st.integers(0, (1 << 64) - 1), min_size=4, max_size=4),
       request_id=_ID, response_id=st.one_of(st.none(), _ID), durations=st.tuples(st.floats(0, 1e6), st.floats(0, 1e6)),
       name=st.binary(max_size=300), shared=st.binary(max_size=3000), up_name=st.binary(max_size=200),
       up_shared=st.binary(max_size=300),
       tokens=st.lists(st.one_of(st.none(), st.integers(0, 200), st.integers(-(1 << 63), (1 << 64) - 1)),
                       min_size=2, max_size=2))
def test_a_laid_out_unperturbed_span_is_the_bytes_unperturbed_writes(trace_id, span_id, parent, remote, up_id, times,
                                                                    request_id, response_id, durations, name, shared,
                                                                    up_name, up_shared, tokens):
    """`otlp.UnperturbedLayout` (two `struct` packs of a shape's constant parts and a request's values, the hot path
    of an unperturbed request's spans) writes, byte for byte, what `otlp.unperturbed` writes from the same
    request: ids of any length and characters, a parent or none, a response id or none, token counts of any size
    (their varints one to ten bytes) or none, spans of any length."""
    from toolquake.proxy.tracing.tracer import _OVERHEAD_MS, _UPSTREAM_MS

    start, end, up_start, up_end = times
    rid, resp = request_id.encode(), (response_id or "").encode()
    up_ms, over_ms = durations
    keys = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens")
    own = (otlp.str_attribute("toolquake.request_id", request_id)
           + (otlp.str_attribute("gen_ai.response.id", response_id) if response_id is not None else b"")
           + b"".join(otlp.int_attribute(k, n) for k, n in zip(keys, tokens) if n is not None)
           + _UPSTREAM_MS + struct.pack("<d", up_ms) + _OVERHEAD_MS + struct.pack("<d", over_ms))
    expected = otlp.unperturbed(trace_id, span_id, parent, remote, None, name, start, end, shared, own, up_id,
                                up_name, up_shared, up_start, up_end)
    counts = [b"" if n is None else otlp.uvarint(n) for n in tokens]
    prefixes = [b"" if n is None else otlp.int_prefix(k, len(c)) for k, n, c in zip(keys, tokens, counts)]
    layout = otlp.UnperturbedLayout(
        name, shared, (otlp.string_prefix("toolquake.request_id", len(rid)),
                       b"" if response_id is None else otlp.string_prefix("gen_ai.response.id", len(resp)),
                       *prefixes, _UPSTREAM_MS, _OVERHEAD_MS), (len(rid), len(resp), *map(len, counts)),
        bool(parent), bool(parent) and remote, up_name, up_shared)
    assert layout.spans(trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"),
                        parent.to_bytes(8, "big") if parent else b"", start, end, rid, resp, *counts, up_ms, over_ms,
                        up_id.to_bytes(8, "big"), up_start, up_end) == expected


def _decoded(spans: list[bytes]) -> list:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(otlp.request(spans, otlp.resource({"service.name": "t"}),
                                                                otlp.scope("toolquake", "0")))
    return list(request.resource_spans[0].scope_spans[0].spans)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["fake-model", None])
@pytest.mark.parametrize("answer_id", ["chatcmpl-1", None, "é"])
@pytest.mark.parametrize("status,upstream_s,rules,remote,sent", [
    (200, 0.0123456, [], False, True), (200, 0.5, ["tool_name_unknown", "arguments_not_json"], True, True),
    (404, None, None, False, True), (429, 0.002, None, True, True), (413, None, None, True, False),
    (200, 0.01, None, "tracestate", True)])
def test_an_unperturbed_span_is_the_span_its_attributes_gathered_in_a_dict_give(stream, model, answer_id, status,
                                                                                upstream_s, rules, remote, sent):
    """A request passed through has its span written straight to the wire format, what it shares with other
    requests from a cache (`Tracing.plain_span`: laid out by `otlp.UnperturbedLayout` when it went upstream with no
    trace state); decoded, it is the span the general path writes from the same request's attributes gathered in a
    dict (`RequestTrace.fill`): ids, parent, name, kind, times, flags, status and every attribute with its type.
    Each case four times, with token counts that differ: the second's of the first's varint lengths, from the
    caches (no layout added), the third's longer, the fourth's none. A whole answer is read in the proxy's check
    (`checked`), a stream's bytes after the client had them (`relayed`)."""
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import Tracing

    tracing = Tracing(TracingConfig(enabled=True, otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                      Metrics(), "http://127.0.0.1:8000/v1")
    tracing.started = True  # spans queue up; nothing sends them
    profile = build_profile("off", ProfileSpec(mode="off"))
    headers = [("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")] if remote else []
    if remote == "tracestate":  # a client's trace state: the spans carry it (written without a layout)
        headers.append(("tracestate", "vendor=abc"))
    for round_, (tokens_in, tokens_out) in enumerate([(10, 5), (12, 7), (40_000, 300), (None, None)]):
        answer = json.dumps({**({"id": answer_id} if answer_id is not None else {}), "model": "fake-model",
                             "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out},
                             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"tool_calls": [
                                 {"function": {"name": "get_weather", "arguments": "{}"}}]}}]}).encode()
        layouts = len(tracing.layouts)
        spans = {}
        for path in ("plain", "dict"):
            t0 = time.perf_counter()
            asked = Asked(secrets.token_hex(8), t0, CHAT_API, profile, stream, model)
            served = Served(status=status, t_upstream=t0 + 0.001, upstream_s=upstream_s, total_s=0.75)
            served.trace = trace = tracing.begin(headers, t0)
            trace.hold()  # as the answer path holds it for the checks after the last byte
            if sent:  # else refused before it went upstream
                trace.sending(asked, served, [])
            if stream:
                trace.relayed(asked, answer)
            else:
                assert trace.checked(asked, answer) == {}  # what the proxy's check takes for a JSON object
            trace.finish(asked, served)
            if rules is not None:
                trace.conformance(rules)
            with pytest.MonkeyPatch.context() as mp:
                if path == "dict":
                    mp.setattr(Tracing, "plain_span", lambda self, trace: False)  # the general path
                trace.release()
            spans[path] = _decoded(list(tracing.exporter.queue))
            tracing.exporter.queue.clear()
        plain, general = spans["plain"], spans["dict"]
        assert len(plain) == len(general) == (2 if sent else 1)
        for a, b in zip(plain, general):
            assert a.span_id != b.span_id and (a.trace_id == b.trace_id) == bool(remote)
            for field in ("name", "kind", "flags", "status", "trace_state"):
                assert getattr(a, field) == getattr(b, field), field
            assert (a.end_time_unix_nano - a.start_time_unix_nano) == (b.end_time_unix_nano - b.start_time_unix_nano)
            assert bool(a.parent_span_id) == bool(b.parent_span_id)
            values = [{kv.key: (kv.value.WhichOneof("value"), str(kv.value)) for kv in s.attributes} for s in (a, b)]
            values[0].pop("toolquake.request_id", None), values[1].pop("toolquake.request_id", None)
            assert values[0] == values[1]
        if a.kind == 2 and stream is False:  # a.kind: the last pair's second span is the request's
            assert ("gen_ai.usage.input_tokens" in values[0]) == (tokens_in is not None)
        if round_ == 1:
            assert len(tracing.layouts) == layouts  # other counts of the same lengths: the first round's layout


@pytest.mark.parametrize("noted", ["note", "client_got", "child", None])
def test_what_is_noted_on_an_unperturbed_requests_span_is_exported_with_it(noted):
    """A passed-through request's span is its trace's fields until something is noted on it (a verdict's
    attributes, the id the client got, a child span): then it is written by the general path with what was noted,
    its ids and times the same; with nothing noted, by the layout. Either way one request span, under its
    client's parent, and its upstream call's span under it."""
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import Tracing

    tracing = Tracing(TracingConfig(enabled=True, otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                      Metrics(), "http://127.0.0.1:8000/v1")
    tracing.started = True
    profile = build_profile("off", ProfileSpec(mode="off"))
    answer = json.dumps({"id": "chatcmpl-9", "model": "fake-model", "usage": {"prompt_tokens": 3,
                         "completion_tokens": 2}, "choices": [{"finish_reason": "stop", "message": {}}]}).encode()
    parent_trace, parent_span = secrets.token_hex(16), secrets.token_hex(8)
    t0 = time.perf_counter()
    asked = Asked(secrets.token_hex(8), t0, CHAT_API, profile, False, "fake-model")
    served = Served(status=200, t_upstream=t0 + 0.001, upstream_s=0.002, total_s=0.004)
    served.trace = trace = tracing.begin([("traceparent", f"00-{parent_trace}-{parent_span}-01")], t0)
    trace.hold()
    upstream_headers = trace.sending(asked, served, [])
    trace.relayed(asked, answer)
    trace.finish(asked, served)
    if noted == "note":
        trace.note({"toolquake.verdict.valid": False, "toolquake.nothing": None})
    elif noted == "client_got":
        trace.client_got({"id": "resp-client"})
    elif noted == "child":
        trace.child("twin").finish()
    trace.release()
    spans = _decoded(list(tracing.exporter.queue))
    requests = [s for s in spans if s.name == "chat fake-model"]
    assert len(requests) == 1 and len(spans) == (3 if noted == "child" else 2)
    (request,) = requests
    (upstream,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert request.trace_id.hex() == parent_trace and request.parent_span_id.hex() == parent_span
    assert upstream.parent_span_id == request.span_id
    assert upstream_headers == [("traceparent", f"00-{parent_trace}-{upstream.span_id.hex()}-01")]
    assert request.end_time_unix_nano - request.start_time_unix_nano == 4_000_000
    values = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in request.attributes}
    assert values["gen_ai.usage.input_tokens"] == 3 and values["gen_ai.response.finish_reasons"].values[0] \
        .string_value == "stop"
    assert values["gen_ai.response.id"] == ("resp-client" if noted == "client_got" else "chatcmpl-9")
    assert ("toolquake.verdict.valid" in values) == (noted == "note") and "toolquake.nothing" not in values
    if noted == "note":
        assert values["toolquake.verdict.valid"] is False
    if noted == "child":
        (twin,) = [s for s in spans if s.name == "twin"]
        assert twin.parent_span_id == request.span_id and twin.trace_id == request.trace_id


def test_a_requests_span_is_made_once_whoever_asks_first():
    """The request's `Span` is made the first time something is noted on it, from the event loop or a verdict's
    thread: threads asking at once (the interpreter switching threads every microsecond) all get the same span,
    so nothing noted is lost on a span nobody exports."""
    import sys

    from toolquake.proxy.server.config import TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.tracing.tracer import Tracing

    tracing = Tracing(TracingConfig(enabled=True, otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                      Metrics(), "http://127.0.0.1:8000/v1")
    tracing.started = True
    traces = [tracing.begin([], time.perf_counter()) for _ in range(3000)]
    seen: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def ask(i: int) -> None:
        start.wait()
        seen[i] = [id(trace.span) for trace in traces]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen[0] == seen[1] == seen[2] == seen[3] == [id(trace.made) for trace in traces]


@pytest.mark.parametrize("tokens", [True, 2.0, "3", None])
def test_a_token_count_that_is_not_an_integer_is_left_out_on_both_paths(tokens):
    """`gen_ai.usage.*_tokens` are integers: a count sent as a boolean, a float or a string is left out, whether
    the answer's bytes were read (an unperturbed request) or the answer was decoded whole."""
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.tracing.tracer import answer_summary, relayed_summary

    answer = {"model": "m", "usage": {"prompt_tokens": tokens, "completion_tokens": 7}}
    relayed = relayed_summary(CHAT_API, False, json.dumps(answer).encode())
    assert relayed == answer_summary(answer)
    assert relayed.input_tokens is None and relayed.output_tokens == 7


def _hostile_collector(kind: str) -> tuple[str, threading.Event]:
    """An OTLP endpoint that misbehaves: `silent` reads and never answers, `endless_head` sends header bytes and
    never ends them, `huge_body` announces 100 MB and sends them (slowly), `garbage` answers what is not HTTP."""
    stop = threading.Event()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)

    def serve(conn: socket.socket) -> None:
        conn.settimeout(0.2)
        try:
            while not stop.is_set():
                try:
                    if not conn.recv(65536):
                        return
                except socket.timeout:
                    pass
                if kind == "endless_head":
                    conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 60000 + b"\r\n")
                elif kind == "huge_body":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n" + b"b" * 65536)
                elif kind == "garbage":
                    conn.sendall(b"\x00\xffnot http at all\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
        server.close()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", stop


#: the export timeout of the hostile-collector test: an export that held the event loop would hold it about as
#: long (a silent collector: the whole timeout), which the loop-lag histogram would show
EXPORT_TIMEOUT_S = 5


@pytest.mark.parametrize("kind", ["silent", "endless_head", "huge_body", "garbage"])
def test_a_hostile_collector_costs_no_request_and_is_counted(proxy_factory, kind):
    """The exporter sends from the server's event loop: a collector that never answers, answers an endless head or
    an endless body, or answers what is not HTTP, holds no request up and takes no unbounded memory (an answer's
    head is read up to 64 KiB, its body up to 1 MiB, all within the export timeout); its failed exports are
    counted, and the proxy goes on serving. Not held up: every request is answered, and the event loop never ran
    a timer as late as half the export timeout (an export holding the loop would hold it that long; the loop-lag
    probe runs every 0.25 s)."""
    url, stop = _hostile_collector(kind)
    try:
        tq = proxy_factory(None, {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": url,
                                  "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
                                  "OTEL_EXPORTER_OTLP_TIMEOUT": str(EXPORT_TIMEOUT_S)})
        pid = tq.popen.pid
        rss = [int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")][0]

        def failed_after_requests() -> float:
            with httpx.Client(timeout=30) as client:
                for _ in range(8):
                    assert client.post(tq.url + "/v1/chat/completions", json=CHAT).status_code == 200
            return scraped(tq, "toolquake_tracing_failures_total", stage="export")

        assert wait_for(failed_after_requests, 60, f"a failed export to the {kind} collector", interval=0.3) >= 1
        assert httpx.get(tq.url + "/healthz", timeout=30).status_code == 200
        lag = metric_samples(metrics_text(tq))
        late = [v for (name, labels), v in lag.items() if name == "toolquake_event_loop_lag_seconds_bucket"
                and float(dict(labels)["le"]) >= EXPORT_TIMEOUT_S / 2]
        runs = lag[("toolquake_event_loop_lag_seconds_count", ())]
        assert runs > 0 and all(v == runs for v in late), f"{kind}: the event loop was held {lag}"
        grown = [int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")][0] - rss
        assert grown < 64 * 1024, f"{kind}: RSS grew {grown} KiB"
    finally:
        stop.set()


@pytest.mark.parametrize("fault", ["status:429", "status:400"])
def test_an_error_answers_span_is_exported_at_once(traced, sink, fault):
    """An answer the backend refused (no check runs after its last byte) ends its span with the request: it
    reaches the collector on the next export, with its status, even on a proxy that then sits idle (nothing else
    is sent to it until the span is there: a span held until the next request would never come)."""
    tq = traced
    trace_id = secrets.token_hex(16)
    got = httpx.post(tq.url + "/v1/chat/completions", json=CHAT, timeout=30,
                     headers={"x-fake-fault": fault, "traceparent": f"00-{trace_id}-{'cd' * 8}-01"})
    assert got.status_code == int(fault.split(":")[1])
    spans = sink_spans(sink, {trace_id}, 2)
    (request,) = [s for s in spans if s["kind"] == 2]
    assert request["values"]["http.response.status_code"] == got.status_code


def _held(value: object) -> int:
    """The characters and bytes of the strings in `value` (tuples of them, nested)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return sum(_held(v) for v in value) if isinstance(value, tuple) else 0


def test_a_hostile_answer_is_read_in_linear_time_and_not_kept():
    """What a span reads of a 2 MiB answer the model controls (a huge id, thousands of calls or choices, a huge
    model name) takes linear time (a byte of it costs about what a byte of a 64 KiB one does, in CPU time), and a
    shape that large is not kept in the unperturbed span caches."""
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import Tracing, relayed_summary

    def answer(name: str, size: int) -> dict:
        calls = [{"function": {"name": "f" * 8}}] * (size // 32)
        return {
            "id": lambda: {"id": "x" * size},
            "calls": lambda: {"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": calls}}]},
            "choices": lambda: {"choices": [{"finish_reason": "stop" * 4}] * (size // 40)},
            "model": lambda: {"model": "m" * size, "choices": [{"finish_reason": "r" * size}]},
        }[name]()

    tracing = Tracing(TracingConfig(enabled=True, max_queue_bytes=1 << 30,  # every span written is queued
                                    otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                          "OTEL_BSP_MAX_QUEUE_SIZE": "100"}),
                      Metrics(), "http://127.0.0.1:8000/v1")
    tracing.started = True
    profile = build_profile("off", ProfileSpec(mode="off"))
    for name in ("id", "calls", "choices", "model"):
        def read(size: int, name: str = name):
            data = json.dumps(answer(name, size)).encode()
            model = "m" * size if name == "model" else "m"

            def run() -> None:
                assert relayed_summary(CHAT_API, False, data) is not None
                t0_span = time.perf_counter()
                asked = Asked(secrets.token_hex(8), t0_span, CHAT_API, profile, False, model)
                served = Served(status=200, t_upstream=t0_span, upstream_s=0.001, total_s=0.002)
                served.trace = trace = tracing.begin([], t0_span)
                trace.hold()
                trace.sending(asked, served, [])
                trace.finish(asked, served)
                trace.relayed(asked, data)
                trace.release()
            return run

        growth = per_byte_growth(read, *SIZES)
        assert growth < LINEAR_GROWTH, f"{name}: a byte of a {SIZES[1]}-byte answer costs {growth:.1f} times one " \
                                       f"of {SIZES[0]}"
        assert sum(len(v[1]) for v in tracing.shapes.values()) <= 4096, name  # nothing that large kept
        assert sum(_held(k) + _held(v.parts) for k, v in tracing.layouts.items()) <= 8192, name  # nor laid out
        assert len(tracing.exporter.queue) >= 1, name  # the span was written all the same
        tracing.exporter.queue.clear()
