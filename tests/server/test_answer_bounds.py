"""A runaway upstream answer cannot grow the proxy or hold its event loop (#45, item 3).

What the proxy keeps of one answer is bounded by `[server] max_answer_bytes`: past it a relayed answer goes on
to the client uninspected (counted in `toolquake_answers_uninspected_total{reason="too_large"}`), and one that a
profile must read whole to change it is answered with an OpenAI-shaped 502 `upstream_answer_too_large`. A stream's
text and arguments are joined once (checking or assembling it is linear in its deltas), and a large one is
checked off the event loop. The fake upstream's `huge:N[:PIECE]` fault sends the runaway answers (N = 0: no end);
the proxy's RSS is read from /proc.
"""

from __future__ import annotations

import json
import secrets
import signal
import time

import httpx
import pytest

from tests.support import scraped, start_proxy, wait_for
from tests.support.live import rss
from tests.support.tracing import sink  # noqa: F401 (a fixture)
from tests.support.tracing import sink_spans as _spans
from toolquake.proxy.server import conformance
from toolquake.proxy.server.conformance import Offered
from toolquake.proxy.server.streaming import assemble_sse, summarize_sse

MIB = 1024 * 1024
#: the bound set in these tests
LIMIT = 4 * MIB
#: what the proxy may grow by while relaying a runaway answer 12 times the bound (the old code kept it all: 48 MiB
#: and more)
RSS_GROWTH = 24 * MIB
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
BOUNDED = f"[server]\nmax_answer_bytes = {LIMIT}\n"
#: a profile whose answer must be read whole before the client gets it (the repair step rewrites it)
REPAIRING = BOUNDED + '[profiles.fixed]\nmode = "off"\nrepair = true\n'
#: a profile that streams the text through and restores the whole answer at its end
FORMAT_PYTHON = ('[profiles.fmt]\nmode = "perturb"\nperturbers = [{ name = "format_rewrite", params = { '
                 'return_format = "python", function_doc_format = "json" } }]\n')


@pytest.fixture(scope="module")
def bounded(fake_upstream):
    """One proxy for the tests that only relay or refuse answers: the bound, the repairing profile `fixed` and the
    format-rewrite profile `fmt` (unperturbed requests go through `off`). Each test reads what its own answers
    moved; a relayed answer leaves nothing behind, so the RSS each measures grows from where the last left it."""
    proc = start_proxy(fake_upstream.url, REPAIRING + FORMAT_PYTHON)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def unbounded(fake_upstream):
    proc = start_proxy(fake_upstream.url, "[server]\nmax_answer_bytes = 100_000_000\n")
    yield proc
    proc.stop()


def body(api: str, stream: bool) -> dict:
    if api == "chat":
        return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return {"model": "fake-model", "input": "hi", "stream": stream}


def relay_and_sample(proxy, api: str, fault: str, stream: bool, read: int, path: str | None = None) -> tuple[int, int]:
    """Read `read` bytes of the answer to `fault` (then hang up), sampling the proxy's RSS every 4 MiB: the bytes
    read and the largest RSS seen."""
    got, peak, mark = 0, 0, 0
    url = proxy.url + (path or PATHS[api])
    method, payload = ("GET", None) if path else ("POST", body(api, stream))
    with httpx.stream(method, url, json=payload, headers={"X-Fake-Fault": fault}, timeout=60) as r:
        assert r.status_code == 200, r.read()[:300]
        for chunk in r.iter_raw():
            got += len(chunk)
            if got >= mark:
                peak, mark = max(peak, rss(proxy.popen.pid)), mark + 4 * MIB
            if got >= read:
                break
    return got, max(peak, rss(proxy.popen.pid))


def warm(proxy, api: str) -> int:
    """One answer past the bound, so the allocator's high-water mark for one such answer is not counted as growth;
    the proxy's RSS after it."""
    relay_and_sample(proxy, api, "huge:0", True, 2 * LIMIT)
    wait_for(lambda: scraped(proxy, "toolquake_in_flight_requests") == 0, what="the warm-up answer to end")
    return rss(proxy.popen.pid)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_endless_stream_is_relayed_uninspected_past_the_bound_and_rss_stays_flat(bounded, api):
    proxy = bounded
    before = warm(proxy, api)
    counted = scraped(proxy, "toolquake_answers_uninspected_total", reason="too_large")
    got, peak = relay_and_sample(proxy, api, "huge:0", True, 12 * LIMIT)
    assert got >= 12 * LIMIT  # the client kept receiving bytes past the bound
    assert peak - before < RSS_GROWTH, f"RSS grew by {(peak - before) / MIB:.1f} MiB over {got / MIB:.0f} MiB relayed"
    wait_for(lambda: scraped(proxy, "toolquake_answers_uninspected_total", reason="too_large") == counted + 1,
             what="the runaway stream to be counted as uninspected")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_client_hanging_up_on_a_runaway_stream_leaves_the_proxy_serving_and_stoppable(proxy_factory, api):
    proxy = proxy_factory(BOUNDED)
    got, _ = relay_and_sample(proxy, api, "huge:0", True, 4 * LIMIT)  # then the client hangs up
    assert got >= 4 * LIMIT
    wait_for(lambda: scraped(proxy, "toolquake_in_flight_requests") == 0, timeout=30,
             what="the hung-up stream to end")
    assert httpx.get(f"{proxy.url}/healthz", timeout=30).status_code == 200
    proxy.popen.send_signal(signal.SIGTERM)
    assert proxy.popen.wait(30) is not None  # SIGTERM ends it (the old loop, busy checking the buffer, ignored it)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_many_small_deltas_are_checked_without_holding_the_loop(unbounded, api):
    """30,000 deltas of 1,000 characters, under the bound: the conformance check reads them all (in time linear in
    the deltas, off the loop); /healthz answers meanwhile (the old check, quadratic, held the loop for minutes)."""
    proxy = unbounded
    checks = scraped(proxy, "toolquake_conformance_checks_total")
    uninspected = scraped(proxy, "toolquake_answers_uninspected_total")
    with httpx.stream("POST", proxy.url + PATHS[api], json=body(api, True), timeout=60,
                      headers={"X-Fake-Fault": "huge:30000000:1000"}) as r:
        assert r.status_code == 200
        got, tail = 0, b""
        for chunk in r.iter_raw():
            got, tail = got + len(chunk), (tail + chunk)[-200:]
    assert got > 30_000_000 and tail.endswith(b"\n\n")  # the whole stream came
    assert tail.endswith(b"data: [DONE]\n\n") if api == "chat" else tail.endswith(b'"annotations":[]}]}]}}\n\n')
    assert httpx.get(f"{proxy.url}/healthz", timeout=10).status_code == 200
    wait_for(lambda: scraped(proxy, "toolquake_conformance_checks_total") == checks + 1, timeout=120,
             what="the stream's conformance check")
    assert scraped(proxy, "toolquake_answers_uninspected_total") == uninspected


@pytest.mark.parametrize("api", ["chat", "responses", "models"])
def test_a_huge_plain_answer_is_relayed_as_it_comes(bounded, api):
    """48 MB in one JSON answer (not streamed), 12 times the bound: relayed whole to the client, never held whole
    by the proxy; a model route counts it as uninspected."""
    proxy = bounded
    before = warm(proxy, "chat")
    counted = scraped(proxy, "toolquake_answers_uninspected_total", reason="too_large")
    size = 12 * LIMIT
    fault = f"huge:{size}:65536"
    path = "/v1/models" if api == "models" else None
    got, peak = relay_and_sample(proxy, "chat" if api == "models" else api, fault, False, 1 << 40, path)
    assert got > size  # all of it, to its end
    assert peak - before < RSS_GROWTH, f"RSS grew by {(peak - before) / MIB:.1f} MiB over {got / MIB:.0f} MiB relayed"
    if api != "models":
        wait_for(lambda: scraped(proxy, "toolquake_answers_uninspected_total", reason="too_large") == counted + 1,
                 what="the plain answer to be counted as uninspected")
        r = httpx.post(proxy.url + PATHS[api], json=body(api, False), headers={"X-Fake-Fault": fault}, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        answer = r.json()
        text = answer["choices"][0]["message"]["content"] if api == "chat" else \
            answer["output"][0]["content"][0]["text"]
        assert len(text) >= size and set(text) == {"x"}
        assert '"uninspected":"too_large"' in proxy.output()  # on the request's log line


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_huge_answer_a_profile_must_rewrite_gets_an_openai_error(bounded, api, stream):
    proxy = bounded
    refused = scraped(proxy, "toolquake_upstream_errors_total", kind="too_large")
    r = httpx.post(f"{proxy.url}/p/fixed{PATHS[api]}", json=body(api, stream), timeout=60,
                   headers={"X-Fake-Fault": f"huge:{12 * LIMIT}:65536"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_answer_too_large"
    assert r.json()["error"]["type"] == "upstream_error"
    assert scraped(proxy, "toolquake_upstream_errors_total", kind="too_large") == refused + 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_huge_text_through_stream_ends_with_an_in_band_error(bounded, api):
    """A format-rewrite profile streams the text through and must restore the whole answer at its end: past the
    bound the stream ends with an OpenAI-shaped error event."""
    proxy = bounded
    refused = scraped(proxy, "toolquake_upstream_errors_total", kind="too_large")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    if api == "responses":
        tools = [{"type": "function", **tools[0]["function"]}]
    with httpx.stream("POST", f"{proxy.url}/p/fmt{PATHS[api]}", json={**body(api, True), "tools": tools}, timeout=60,
                      headers={"X-Fake-Fault": f"huge:{12 * LIMIT}:65536"}) as r:
        assert r.status_code == 200
        data = b"".join(r.iter_raw())
    last = data.rstrip().rsplit(b"data: ", 1)[1]
    assert json.loads(last)["error"]["code"] == "upstream_answer_too_large"
    assert len(data) < 2 * LIMIT  # released as it came, up to the bound; nothing after it
    wait_for(lambda: scraped(proxy, "toolquake_upstream_errors_total", kind="too_large") == refused + 1,
             what="the refused stream to be counted")


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_every_upstream_client_stops_reading_a_whole_answer_at_the_bound(proxy_factory, client):
    """The aiohttp and httpx clients read a whole answer up to the bound too: past it the answer is relayed on,
    or refused where the profile must rewrite it."""
    proxy = proxy_factory(REPAIRING.replace("[server]\n", f'[server]\nupstream_client = "{client}"\n'))
    fault = {"X-Fake-Fault": f"huge:{3 * LIMIT}:65536"}
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body("chat", False), headers=fault, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) >= 3 * LIMIT
    wait_for(lambda: scraped(proxy, "toolquake_answers_uninspected_total", reason="too_large") == 1,
             what="the answer to be counted as uninspected")
    r = httpx.post(f"{proxy.url}/p/fixed/v1/chat/completions", json=body("chat", False), headers=fault, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_answer_too_large"


def test_the_span_of_an_answer_past_the_bound_is_exported(proxy_factory, sink):  # noqa: F811
    """The request span waits for the checks after a stream's last byte: an answer past the bound has none (a
    stream relayed uninspected, one refused before or after its headers), and its span still ends, exported."""
    proxy = proxy_factory(REPAIRING + FORMAT_PYTHON, {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                                                      "OTEL_BSP_SCHEDULE_DELAY": "100"})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    statuses = {}
    for profile in ("off", "fixed", "fmt"):
        trace_id = secrets.token_hex(16)
        headers = {"X-Fake-Fault": f"huge:{3 * LIMIT}:65536", "traceparent": f"00-{trace_id}-{'a1' * 8}-01"}
        with httpx.stream("POST", f"{proxy.url}/p/{profile}/v1/chat/completions", headers=headers, timeout=60,
                          json={**body("chat", True), "tools": tools}) as r:
            statuses[trace_id] = (profile, r.status_code, len(b"".join(r.iter_raw())))
    assert [s[:2] for s in statuses.values()] == [("off", 200), ("fixed", 502), ("fmt", 200)], statuses
    spans = _spans(sink, set(statuses), 2 * len(statuses))
    ended = {s["trace_id"] for s in spans if s["kind"] == 2}
    assert ended == set(statuses), [statuses[t] for t in set(statuses) - ended]


def test_max_answer_bytes_is_a_server_limit_with_an_env_var(tmp_path):
    from toolquake.proxy.server.config import ConfigError, load_config

    assert load_config(None, env={}).server.max_answer_bytes == 32 * MIB
    assert load_config(None, env={"TOOLQUAKE_MAX_ANSWER_BYTES": "4096"}).server.max_answer_bytes == 4096
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nmax_answer_bytes = 0\n")
    with pytest.raises(ConfigError, match="max_answer_bytes"):
        load_config(cfg, env={})


def _chat_sse(n: int, piece: int) -> bytes:
    """A chat stream of `n` text deltas and `n` deltas of one call (its name and arguments in pieces), `piece`
    characters each."""
    base = '{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
    text = f'data: {base}{{"content":"{"x" * piece}"}},"finish_reason":null}}]}}\n\n'
    args = (f'data: {base}{{"tool_calls":[{{"index":0,"function":{{"name":"{"z" * piece}",'
            f'"arguments":"{"y" * piece}"}}}}]}},"finish_reason":null}}]}}\n\n')
    head = (f'data: {base}{{"tool_calls":[{{"index":0,"id":"call_1","type":"function","function":'
            '{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}\n\n')
    end = f'data: {base}{{}},"finish_reason":"tool_calls"}}]}}\n\ndata: [DONE]\n\n'
    return (text * n + head + args * n + end).encode()


def _responses_sse(n: int, piece: int) -> bytes:
    def ev(**fields) -> str:
        return f"event: {fields['type']}\ndata: {json.dumps(fields)}\n\n"

    return (ev(type="response.output_text.delta", delta="x" * piece) * n
            + ev(type="response.output_item.added", output_index=1,
                 item={"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                       "arguments": ""})
            + ev(type="response.function_call_arguments.delta", output_index=1, item_id="fc_1", delta="y" * piece) * n
            + ev(type="response.completed", response={"id": "r", "output": []})).encode()


OFFERED = Offered({"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}})
#: each reader of a whole stream, on chat or Responses SSE
READERS = {
    "check_chat": ("chat", lambda data: conformance.check("chat_completions", True, data, OFFERED)),
    "check_responses": ("responses", lambda data: conformance.check("responses", True, data, OFFERED)),
    "assemble_chat": ("chat", assemble_sse),
    "summarize_chat": ("chat", summarize_sse),
}
#: deltas of the smaller input (the larger has 4 times as many)
DELTAS = 2_000
#: how much longer 4 times the deltas may take: 4 when linear, 16 when quadratic; wide for a loaded machine
GROWTH = 8.0


def _seconds(fn, data: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn(data)
        best = min(best, time.process_time() - t0)
    return best


@pytest.mark.parametrize("name", READERS)
def test_stream_checks_and_assembly_are_linear_in_the_deltas(name):
    """Text and arguments in deltas of 1,000 characters: 4 times the deltas take about 4 times as long (the old
    readers concatenated a string per delta: 16 times)."""
    kind, fn = READERS[name]
    make = _chat_sse if kind == "chat" else _responses_sse
    small, large = make(DELTAS, 1000), make(4 * DELTAS, 1000)
    fn(small)  # warm up
    ratio = _seconds(fn, large) / max(_seconds(fn, small), 1e-4)
    assert ratio < GROWTH, f"{name}: 4x the deltas took {ratio:.1f}x as long"
