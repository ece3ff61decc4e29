"""`[tracing] contents = true` under large requests: the proxy's memory stays flat whether the collector takes the
spans or hangs (the export queue is bounded in bytes, each content attribute is cut to
OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT characters and says how many it lost, a finished request's `Served` is freed by
reference counting alone), and spans past the byte bound are dropped and counted. Real processes on loopback:
the proxy, the fake upstream, an OTLP sink (tests/bench/otlp_sink.py) or a collector that never answers."""

from __future__ import annotations

import asyncio
import gc
import secrets
import socket
import time

import httpx
import pytest

from tests.support import scraped, wait_for
from tests.support import tracing as tracing_support
from toolquake.proxy.server.config import ConfigError, load_config

MIB = 1 << 20


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _body(chars: int) -> dict:
    """A chat request whose one message is `chars` characters of ordinary text (no secret shape)."""
    text = ("the quick brown fox jumps over the lazy dog " * (chars // 44 + 1))[:chars]
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}]}


def _failures(url: str, stage: str) -> float:
    return scraped(url, "toolquake_tracing_failures_total", stage=stage)


sink = tracing_support.sink  # an OTLP collector that decodes and keeps the spans (a fixture)


@pytest.fixture
def hanging_collector():
    """A collector that accepts connections and never answers (nor reads past what the kernel buffers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _request_spans(sink, trace_ids: set[str]) -> list[dict]:
    """The request spans (kind server) of these traces, once the sink has one for each."""
    def each() -> list[dict] | None:
        spans = [s for s in sink.spans() if s["trace_id"] in trace_ids and s["kind"] == 2]
        return spans if len(spans) >= len(trace_ids) else None

    return wait_for(each, 120, f"the request spans of {len(trace_ids)} traces at the collector", interval=0.3)


def _send(client: httpx.Client, url: str, body: dict) -> str:
    trace_id = secrets.token_hex(16)
    r = client.post(url + "/v1/chat/completions", json=body,
                    headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    assert r.status_code == 200, r.text[:300]
    return trace_id


def test_contents_of_large_requests_with_a_healthy_collector_keep_rss_flat_and_are_cut(proxy_factory, sink):
    """24 requests of 4 MiB each, contents on, the default limits: every request span reaches the collector with
    its prompt cut to 65,536 characters and marked with how many were cut, and the proxy's RSS after them is
    within the export queue's byte bound (32 MiB) plus 32 MiB of the RSS before them (it grew by about 7 MiB a
    request: 150 MiB over 20)."""
    tq = proxy_factory(None, {"TOOLQUAKE_TRACING": "1", "TOOLQUAKE_TRACING_CONTENTS": "1",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    chars = 4 * MIB
    body = _body(chars)
    with httpx.Client(timeout=60) as client:
        warm = {_send(client, tq.url, body) for _ in range(4)}
        assert len(_request_spans(sink, warm)) == 4
        before = _rss_mib(tq.popen.pid)
        sent = {_send(client, tq.url, body) for _ in range(24)}
    spans = _request_spans(sink, sent)
    after = _rss_mib(tq.popen.pid)
    assert len(spans) == 24
    # a request that found 32 MiB of text waiting to be redacted goes without contents, and says so: how many do
    # depends on how fast this machine redacts (6 of 24 on a loaded 2-core machine), so only the accounting and
    # the contents of the others are checked
    skipped = [s for s in spans if s["values"].get("toolquake.contents.skipped") == "backlog"]
    assert len(skipped) < len(spans) and _failures(tq.url, "contents") == len(skipped)
    for span in spans:
        if span in skipped:
            continue
        prompt = span["values"]["gen_ai.input.messages"]
        head, marker, tail = prompt.rpartition("…[")
        assert len(head) == 65536 and marker and tail.endswith(" characters cut]"), prompt[-80:]
        assert int(tail.split()[0]) > chars - 65536  # the JSON around the text is cut with it
        assert head.startswith('[{"role":"user","parts":[{"type":"text","content":"the quick brown fox')
    assert after - before < 32 + 32, f"RSS {before:.0f} -> {after:.0f} MiB"
    assert _failures(tq.url, "export") == 0


def test_contents_with_a_hanging_collector_stay_within_the_byte_bound_and_drops_are_counted(proxy_factory,
                                                                                             hanging_collector):
    """A collector that never answers, contents not cut (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT past the prompt),
    `TOOLQUAKE_TRACING_MAX_QUEUE_BYTES` 16 MiB, requests of 3 MiB: the spans past 16 MiB (the batch being sent
    included) are dropped and counted under stage="export", or sent without their contents (the text waiting to be
    redacted is bounded by as much) and counted under stage="contents"; once both bounds are full (24 requests), 12
    more leave the proxy's RSS where it was (before the bounds, every span was queued: 3 MiB a request)."""
    tq = proxy_factory(None, {"TOOLQUAKE_TRACING": "1", "TOOLQUAKE_TRACING_CONTENTS": "1",
                              "TOOLQUAKE_TRACING_MAX_QUEUE_BYTES": str(16 * MIB),
                              "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": str(4 * MIB),
                              "OTEL_EXPORTER_OTLP_ENDPOINT": hanging_collector, "OTEL_EXPORTER_OTLP_TIMEOUT": "120",
                              "OTEL_BSP_EXPORT_TIMEOUT": "120000", "OTEL_BSP_SCHEDULE_DELAY": "100"})
    body = _body(3 * MIB)
    with httpx.Client(timeout=60) as client:
        for _ in range(12):
            _send(client, tq.url, body)
        # a request span of about 3 MiB each: five fit, the batch the sender holds included; past them a span is
        # dropped (stage="export"), or went without its contents because 16 MiB of text waited to be redacted
        # (stage="contents") and is small. Which of the two: how fast this machine redacts (0 dropped and 7 without
        # contents on one run, 5 and 1 on another), so the two are counted together
        def accounted() -> float:
            return _failures(tq.url, "export") + _failures(tq.url, "contents")

        first = wait_for(lambda: (n := accounted()) >= 4 and n, 60, "4 spans dropped or sent without contents",
                         interval=0.3)
        # 12 more fill both bounds whichever way this machine goes (36 MiB of spans past 16 + 16 MiB); 12 after
        # them must find nothing more to keep
        rss = []
        for _ in range(2):
            for _ in range(12):
                _send(client, tq.url, body)
            rss.append(_rss_mib(tq.popen.pid))
        wait_for(lambda: accounted() >= first + 16, 60, "16 more spans dropped or sent without contents",
                 interval=0.3)
        assert client.get(tq.url + "/healthz").status_code == 200
    # flat once the bounds are full: before them every span was kept, 3 MiB a request, 36 MiB for these 12
    assert rss[1] - rss[0] < 16, f"RSS {rss[0]:.0f} -> {rss[1]:.0f} MiB"


def test_the_queue_is_bounded_in_bytes_the_batch_being_sent_included(hanging_collector):
    """`Exporter`: spans whose bytes pass `max_bytes` are dropped and counted (as past OTEL_BSP_MAX_QUEUE_SIZE);
    a batch the sender took and is sending to a collector that never answers still counts, so nothing more is
    queued until it is done."""
    from prometheus_client import CollectorRegistry, Counter

    from toolquake.proxy.tracing.spans import SERVER, Exporter, Span

    failures = Counter("t_failures", "t", registry=CollectorRegistry())
    exporter = Exporter(hanging_collector + "/v1/traces",
                        {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
                         "OTEL_BSP_EXPORT_TIMEOUT": "3000"}, {"service.name": "t"}, "0", failures,
                        max_bytes=100_000)
    trace_id = int(secrets.token_hex(16), 16)

    def put(i: int) -> None:
        Span(exporter, trace_id, 0, False, f"s{i}", SERVER, time.time_ns(), {"pad": "x" * 30_000}, None).finish()

    for i in range(5):
        put(i)
    assert len(exporter.queue) == 3 and failures._value.get() == 2  # 3 spans of ~30 KB fit in 100,000 bytes
    held = exporter.held
    assert held == sum(map(len, exporter.queue)) and held <= 100_000
    a_pair = (b"\x0a" * 5_000, b"\x0a" * 20_000)  # the first fits in what is left, the second does not
    exporter.put_pair(*a_pair)
    assert len(exporter.queue) == 4 and failures._value.get() == 3
    exporter.start()
    try:
        # the sender took the batch: it hangs sending it
        wait_for(lambda: not exporter.queue, 30, "the sender to take the batch", interval=0.02)
        assert exporter.held == held + 5_000  # still held while it is being sent
        put(9)
        assert not exporter.queue and failures._value.get() == 4
    finally:
        exporter.shutdown()
    assert exporter.held == 0  # the batch failed (counted) and is no longer held
    assert failures._value.get() == 4 + 4


def test_a_finished_requests_served_and_trace_are_freed_without_the_cycle_collector():
    """With the cycle collector off: a request whose span was held by something that never released it (a
    verdict that never came) is freed by reference counting once nothing else holds it, and its span is still
    exported (ended when the trace is freed); a request with contents is freed once its span is exported. Before,
    the trace held its `Served` (which holds the trace) until the span ended: a cycle only the collector frees."""
    from toolquake.proxy.live.redact import Redactor
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import RequestTrace, Tracing

    def alive() -> tuple[int, int]:
        objects = gc.get_objects()
        return sum(type(o) is Served for o in objects), sum(type(o) is RequestTrace for o in objects)

    async def run() -> None:
        tracing = Tracing(TracingConfig(enabled=True, contents=True,
                                        otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                          Metrics(), "http://127.0.0.1:8000/v1")
        tracing.started = True
        tracing.redact = Redactor([], 5.0)
        profile = build_profile("off", ProfileSpec(mode="off"))
        queue = tracing.exporter.queue
        baseline = alive()
        for contents in (False, True):
            t0 = time.perf_counter()
            request = {"model": "m", "messages": [{"role": "user", "content": "x" * MIB}]} if contents else None
            asked = Asked(secrets.token_hex(8), t0, CHAT_API, profile, False, "m", request=request)
            served = Served(status=200, t_upstream=t0, upstream_s=0.001, total_s=0.002, sent_raw=b"y" * MIB,
                            response={"choices": [{"message": {"role": "assistant", "content": "ok"}}]})
            served.trace = trace = tracing.begin([], t0)
            trace.sending(asked, served, [])
            if not contents:
                trace.hold()  # a verdict that never comes
            trace.finish(asked, served)
            assert alive() == (baseline[0] + 1, baseline[1] + 1)
            deadline = time.monotonic() + 30
            while contents and not queue and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the contents are redacted off the loop, then the span is exported
            assert bool(queue) is contents
            del served, trace, asked, request
            assert alive() == baseline, "a Served or a RequestTrace outlived its request"
            assert len(queue) == 2  # the request's span and its upstream call's
            queue.clear()

    enabled = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(run())
    finally:
        if enabled:
            gc.enable()


def test_content_limits_come_from_the_otel_variables_and_the_queue_bound_from_its_own(tmp_path):
    """OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT over OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT (the SDK's order), 65,536 by
    default; `[tracing] max_queue_bytes` from the file or TOOLQUAKE_TRACING_MAX_QUEUE_BYTES; bad values stop the
    load with what is wrong. A value cut says how many characters it lost."""
    from toolquake.proxy.tracing.tracer import content_attributes

    assert load_config(None, env={}).tracing.content_chars == 65536
    assert load_config(None, env={}).tracing.max_queue_bytes == 32 * MIB
    env = {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "1000", "TOOLQUAKE_TRACING_MAX_QUEUE_BYTES": str(MIB)}
    assert load_config(None, env=env).tracing.content_chars == 1000
    assert load_config(None, env=env).tracing.max_queue_bytes == MIB
    assert load_config(None, env={**env, "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "500"}).tracing.content_chars == 500
    cfg = tmp_path / "t.toml"
    cfg.write_text('[tracing]\nmax_queue_bytes = 4194304\nOTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT = "2048"\n')
    from_file = load_config(cfg, env={})
    assert (from_file.tracing.max_queue_bytes, from_file.tracing.content_chars) == (4 * MIB, 2048)
    for bad in ({"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "lots"}, {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "10"},
                {"TOOLQUAKE_TRACING_MAX_QUEUE_BYTES": "1000"}, {"TOOLQUAKE_TRACING_MAX_QUEUE_BYTES": "x"}):
        with pytest.raises(ConfigError):
            load_config(None, env=bad)
    got = content_attributes(lambda v: v, {"messages": [{"role": "user", "content": "a" * 500}],
                                           "tools": [{"type": "function"}]}, None, 100)
    whole = '[{"role":"user","parts":[{"type":"text","content":"' + "a" * 500 + '"}]}]'
    assert got["gen_ai.input.messages"] == whole[:100] + f"…[{len(whole) - 100} characters cut]"
    assert got["gen_ai.tool.definitions"] == '[{"type":"function"}]'  # short: as it is


def test_contents_past_the_redaction_backlog_are_skipped_and_counted():
    """The text waiting to be redacted is bounded by `max_queue_bytes` (characters): a request whose contents would
    pass it gets a span without them, marked `toolquake.contents.skipped = "backlog"` and counted under
    stage="contents"; one that fits gets them, and once its span is out nothing is left waiting."""
    from toolquake.proxy.live.redact import Redactor
    from toolquake.proxy.server.apis import CHAT as CHAT_API
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import Tracing

    async def run() -> None:
        tracing = Tracing(TracingConfig(enabled=True, contents=True, max_queue_bytes=1 << 16,
                                        otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                          Metrics(), "http://127.0.0.1:8000/v1")
        tracing.started = True
        tracing.redact = Redactor([], 5.0)
        profile = build_profile("off", ProfileSpec(mode="off"))
        got = {}
        for chars in (100_000, 1_000):
            t0 = time.perf_counter()
            asked = Asked(secrets.token_hex(8), t0, CHAT_API, profile, False, "m",
                          request={"model": "m", "messages": [{"role": "user", "content": "x" * chars}]})
            served = Served(status=200, t_upstream=t0, upstream_s=0.001, total_s=0.002, response=None)
            served.trace = trace = tracing.begin([], t0)
            trace.sending(asked, served, [])
            trace.finish(asked, served)
            span = trace.span
            deadline = time.monotonic() + 30
            while not trace.ended and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            got[chars] = dict(span.attributes)
            assert tracing.contents_waiting == 0
        assert got[100_000].get("toolquake.contents.skipped") == "backlog"
        assert "gen_ai.input.messages" not in got[100_000]
        assert "x" * 1_000 in got[1_000]["gen_ai.input.messages"]
        assert tracing.contents_skipped._value.get() == 1

    asyncio.run(run())
