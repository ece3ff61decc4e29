"""The lean path (proxy/server/lean.py) with the native upstream client (`upstream_client = "native"`)
answers exactly as the framework route with aiohttp does: the same statuses, bodies, headers to the
client and to the upstream, metrics and log lines — for answers, streams, the Responses API, every error
a client can cause, and upstream faults (timeouts, byte-by-byte and chunked bodies, a connection cut
mid-body). Then the native client's own keep-alive pool: connections reused, and dropped after a fault."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support import metric_samples, metric_value, recorded, scraped, start_fake_upstream, start_proxy, wait_for
from tests.support.chat import body, tag
from tests.support.server import runtime

SECRET = "sk-lean-secret-123"
CASES = [
    ("answer", "/v1/chat/completions", body(), {}),
    ("stream", "/v1/chat/completions", body(stream=True), {}),
    ("profile path", "/p/off/v1/chat/completions", body(), {}),
    ("profile header", "/v1/chat/completions", body(), {"x-toolquake-profile": "off"}),
    ("responses", "/v1/responses", {"model": "fake-model", "input": "hi"}, {}),
    ("responses stream", "/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}, {}),
    ("invalid type", "/v1/chat/completions", {"model": "m", "messages": 3}, {}),
    ("invalid json", "/v1/chat/completions", b"{not json", {}),
    ("upstream 500", "/v1/chat/completions", body(), {"x-fake-fault": "status:500"}),
    ("upstream invalid json", "/v1/chat/completions", body(), {"x-fake-fault": "invalid-json"}),
    ("cut stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "cut-stream"}),
    ("cut body", "/v1/chat/completions", body(), {"x-fake-fault": "cut-stream"}),
    ("responses cut stream", "/v1/responses", {"model": "fake-model", "input": "hi", "stream": True},
     {"x-fake-fault": "cut-stream"}),
    ("slow headers", "/v1/chat/completions", body(), {"x-fake-fault": "delay:1500"}),
    ("slow headers stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "delay:1500"}),
    ("upstream hangs", "/v1/chat/completions", body(), {"x-fake-fault": "hang"}),
    ("byte by byte", "/v1/chat/completions", body(), {"x-fake-fault": "slow-bytes:1"}),
    ("byte by byte stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "slow-bytes:1"}),
    ("chunk delay stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "chunk-delay:20"}),
    ("empty stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "empty-stream"}),
    ("expect 100-continue", "/v1/chat/completions", body(), {"expect": "100-continue"}),
    ("client says close", "/v1/chat/completions", body(), {"connection": "close"}),
    ("client says close stream", "/v1/chat/completions", body(stream=True), {"connection": "close"}),
    ("upstream 429 stream", "/v1/chat/completions", body(stream=True), {"x-fake-fault": "status:429"}),
    ("too large", "/v1/chat/completions", b"{" + b" " * 5000 + b"}", {}),
    ("unknown profile", "/p/nope/v1/chat/completions", body(), {}),
]
VOLATILE = ("date", "x-toolquake-request-id", "x-toolquake-overhead-ms", "content-length")  # ids differ in length


def _normal(data: bytes) -> bytes:
    """The answer without what differs between two calls (ids, timestamps), nor between two HTTP clients
    (the name of the exception that said a connection failed: aiohttp's or the native client's)."""
    import re

    data = re.sub(rb"(failed|reached|mid-response) \((\w+)\)", rb"\1 (cause)", data)
    return re.sub(rb'"(id|created|created_at|response_id|item_id)":\s*("[^"]*"|\d+)', b"", data)


@pytest.fixture(scope="module")
def pair(fake_upstream):
    """The lean path served inside the HTTP protocol and as ASGI (both on the native client), and the
    framework's route on aiohttp; the framework's arm last."""
    config = "[server]\nmax_body_bytes = 4096\nread_timeout = 1.0\nlean_path = {}\nlean_protocol = {}\n" \
        "upstream_client = {!r}\n[scoring]\nenabled = false\n" \
        "[profiles.shuffled]\nmode = 'perturb'\nperturbers = [{{ name = 'tool_order' }}]\n" \
        "[profiles.rev]\nmode = 'perturb'\nperturbers = [{{ name = 'tool_order', params = {{ mode = 'reverse' }} }}]\n"
    procs = [start_proxy(fake_upstream.url, config.format("true", "true", "native")),
             start_proxy(fake_upstream.url, config.format("true", "false", "native")),
             start_proxy(fake_upstream.url, config.format("false", "true", "aiohttp"))]
    yield procs
    for proc in procs:
        proc.stop()


def test_each_arm_serves_the_lean_path_where_it_says(pair):
    """The start-up line says where the lean path runs; the first arm really runs it in the protocol (not
    the ASGI fallback a different uvicorn would get)."""
    said = []
    for proc in pair:
        events = [json.loads(x) for x in proc.output().splitlines() if x.startswith("{")]
        said.append([e["served_in"] for e in events if e.get("event") == "lean_path"])
    assert said == [["protocol"], ["asgi"], ["off"]]


def _send(url: str, path: str, payload, headers: dict) -> tuple[int, dict, bytes, str]:
    t = tag()
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    h = {"content-type": "application/json", "authorization": f"Bearer {SECRET}", "x-test-tag": t,
         "x-toolquake-seed": "7", **headers}
    with httpx.stream("POST", url + path, content=content, headers=h, timeout=20) as r:
        data = b"".join(r.iter_raw())
        head = {k: v for k, v in r.headers.items() if k not in VOLATILE}
        return r.status_code, head, data, t


@pytest.mark.parametrize("name, path, payload, headers", CASES, ids=[c[0] for c in CASES])
def test_lean_path_answers_as_the_framework_does(pair, fake_upstream, name, path, payload, headers):
    before = [metric_samples(httpx.get(f"{p.url}/metrics").text) for p in pair]
    got = [_send(p.url, path, payload, headers) for p in pair]
    *leans, (s2, h2, d2, t2) = got
    for s1, h1, d1, _ in leans:
        assert s1 == s2, (name, d1[:200], d2[:200])
        assert h1 == h2
        assert _normal(d1) == _normal(d2)
        if s1 >= 400 and not d1.startswith(b"data:"):
            assert json.loads(d1)["error"]["message"]
    # what reached the upstream: the same headers (no X-Toolquake-*, the client's Authorization) and body
    def seen(t):
        out = []
        for r in recorded(fake_upstream, t):
            h = {k.lower(): v for k, v in r["headers"]} if isinstance(r["headers"], list) else r["headers"]
            assert not [k for k in h if k.lower().startswith("x-toolquake-")]
            out.append(({k: v for k, v in h.items() if k not in ("x-test-tag", "host")}, r["body"]))
        return out

    framework_seen = seen(t2)
    for _, _, _, t1 in leans:
        assert seen(t1) == framework_seen
    # the same metrics moved, by the same amounts (durations aside)
    for p in pair:  # a stream is counted (and logged) after its last byte, then leaves the in-flight gauge
        wait_for(lambda: scraped(p, "toolquake_in_flight_requests") == 0, what=f"{name} to be counted")
    after = [metric_samples(httpx.get(f"{p.url}/metrics").text) for p in pair]
    moved = []
    for b, a in zip(before, after):
        moved.append({k: v - b.get(k, 0.0) for k, v in a.items()
                      if v != b.get(k, 0.0) and not k[0].endswith(("_sum", "_bucket", "_created"))
                      and k[0] not in ("toolquake_event_loop_tasks", "toolquake_upstream_connections",
                                       "toolquake_event_loop_lag_seconds_count")})  # a timer's, not requests
    assert moved[0] == moved[2] and moved[1] == moved[2]
    # one log line each, with the same keys, and never the secret
    for proc in pair:
        assert SECRET not in proc.output()
    lines = []
    for proc in pair:
        events = [json.loads(x) for x in proc.output().splitlines() if x.startswith("{")]
        lines.append([sorted(e) for e in events if e.get("event") == "request"][-1:] if s2 != 413 else [])
    assert lines[0] == lines[2] and lines[1] == lines[2]


def test_a_perturbing_profile_still_perturbs_beside_the_lean_path(pair, fake_upstream):
    """A perturbing profile is left to the framework's route, and still perturbs (on every arm)."""
    for proc in pair:
        t = tag()
        r = httpx.post(f"{proc.url}/p/rev/v1/chat/completions", json=body(), headers={"x-test-tag": t})
        assert r.status_code == 200
        (seen,) = recorded(fake_upstream, t)
        names = [x["function"]["name"] for x in json.loads(seen["body"])["tools"]]
        assert names == [x["function"]["name"] for x in body()["tools"]][::-1]


def _peers(fake, t: str) -> list[tuple]:
    return [tuple(r["peer"]) for r in recorded(fake, t)]


def test_native_client_reuses_connections_and_drops_failed_ones(proxy_factory, fake_upstream):
    """Sequential requests share one upstream connection; a connection whose answer timed out or was cut
    is closed, never handed to the next request; the pool's gauges say what it holds."""
    p = proxy_factory('[server]\nread_timeout = 1.0\nupstream_client = "native"\n[scoring]\nenabled = false\n')

    def ask(t: str, fault: str = "", stream: bool = False) -> int:
        h = {"x-test-tag": t, **({"x-fake-fault": fault} if fault else {})}
        with httpx.stream("POST", f"{p.url}/v1/chat/completions", json=body(stream=stream), headers=h,
                          timeout=20) as r:
            b"".join(r.iter_raw())
            return r.status_code

    first = tag()
    assert [ask(first), ask(first, stream=True), ask(first)] == [200, 200, 200]
    reused = _peers(fake_upstream, first)
    assert len(reused) == 3 and len(set(reused)) == 1, reused
    assert runtime(p.url)[0] == 0  # nothing active; the one connection idle
    assert 'toolquake_upstream_connections{state="idle"} 1.0' in httpx.get(f"{p.url}/metrics").text
    for fault, stream, status in [("delay:1500", False, 504), ("cut-stream", True, 200), ("cut-stream", False, 502)]:
        failed, after = tag(), tag()
        assert ask(failed, fault, stream) == status
        assert [ask(after), ask(after)] == [200, 200]
        (broken,) = _peers(fake_upstream, failed)
        again = _peers(fake_upstream, after)
        assert broken not in again, (fault, stream, broken, again)
        assert len(set(again)) == 1, (fault, stream, again)
        assert runtime(p.url)[0] == 0


@pytest.mark.processes
def test_native_client_skips_a_connection_the_backend_closed_while_idle():
    """The backend closes idle connections after 0.5 s: the next request goes on a new one, and is answered."""
    fake = start_fake_upstream("--keep-alive", "0.5")
    proxy = start_proxy(fake.url, '[server]\nupstream_client = "native"\n[scoring]\nenabled = false\n')
    try:
        t = tag()
        for _ in range(2):
            for _ in range(2):
                r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={"x-test-tag": t}, timeout=20)
                assert r.status_code == 200, r.text
            time.sleep(1.0)
        peers = _peers(fake, t)
        assert peers[0] == peers[1] and peers[2] == peers[3] and peers[1] != peers[2], peers
        samples = metric_samples(httpx.get(f"{proxy.url}/metrics").text)
        assert sum(v for k, v in samples.items() if k[0] == "toolquake_upstream_errors_total") == 0
    finally:
        proxy.stop()
        fake.stop()


def _raw_answer(port: int, source_port: int, fault: str) -> tuple[bytes, int]:
    """The status line the fake answers a request sent on a new connection from `source_port` (0: any) with
    `Connection: close` (the fake closes first: the client's port is free at once), b"" when it dropped it; and
    the port it was sent from."""
    import socket

    raw = json.dumps(body()).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nX-Fake-Fault: {fault}\r\nConnection: close\r\n\r\n").encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", source_port))
        sock.settimeout(20)
        sock.connect(("127.0.0.1", port))
        sent_from = sock.getsockname()[1]
        sock.sendall(head + raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.split(b"\r\n", 1)[0], sent_from


def test_the_fakes_drop_reused_is_per_connection_not_per_client_port(fake_upstream):
    """A new connection from a port an earlier connection used (the kernel hands ports out again) is a new
    connection: `drop-reused` answers it. Counted by client address and port, the fake dropped it, and a native
    client's one retry on a new connection (below) failed now and then with a 502 in a full run."""
    status, source = _raw_answer(fake_upstream.port, 0, "none")
    assert status == b"HTTP/1.1 200 OK"
    assert _raw_answer(fake_upstream.port, source, "drop-reused") == (b"HTTP/1.1 200 OK", source)


def test_native_client_sends_again_only_what_a_reused_connection_dropped_unanswered(fake_upstream):
    """The one retry, deterministically: a request the backend read on a reused keep-alive connection and then
    dropped without a byte of answer is sent once more on a new connection (as Go's net/http does for a
    server that closed an idle connection), so the backend sees it twice; dropped again, the client gets 502
    and there is no third try; dropped on a fresh connection, it is not sent again."""
    fake = fake_upstream
    proxy = start_proxy(fake.url, '[server]\nupstream_client = "native"\n[scoring]\nenabled = false\n')

    def post(t: str, fault: str | None = None) -> httpx.Response:
        h = {"x-test-tag": t, **({"x-fake-fault": fault} if fault else {})}
        return httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers=h, timeout=20)

    try:
        first, again = tag(), tag()
        assert post(first).status_code == 200  # opens the connection, which stays in the pool
        r = post(again, "drop-reused")
        assert r.status_code == 200, r.text
        peers = _peers(fake, again)
        assert len(peers) == 2 and peers[0] == _peers(fake, first)[0] and peers[1] != peers[0]

        twice = tag()  # on the connection that answered `again` (reused), then on a new one: both dropped
        r = post(twice, "drop")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        peers = _peers(fake, twice)
        assert len(peers) == 2 and peers[0] == _peers(fake, again)[1]

        fresh = tag()  # the pool is empty now: a new connection, dropped, not sent again
        r = post(fresh, "drop")
        assert r.status_code == 502
        assert len(_peers(fake, fresh)) == 1
        assert metric_value(httpx.get(f"{proxy.url}/metrics").text, "toolquake_upstream_errors_total") == 2
    finally:
        proxy.stop()


ODD_TARGETS = [
    # under /v1/models/, which [server] passthrough lists by default
    "/v1/models/%C3%8D%C3%B0%F0%BC%AD%AC%C2%B1%C3%81%C3%8EV%C2%BD%19%F3%A3%BA%9D",  # non-Latin-1, a control character
    "/v1/models/mod%20els?x=%C3%A9&y=a%20b",  # a space in the path, escapes in the query
    "/v1/models?note=100%25",  # a literal percent sign
    "/v1/models/caf%C3%A9",
]


@pytest.mark.parametrize("target", ODD_TARGETS)
def test_odd_request_targets_reach_the_upstream_as_aiohttp_sends_them(pair, fake_upstream, target):
    """A passthrough target with non-ASCII, control or space characters (schemathesis found the native client
    answering 500 to the first): both clients get the same answer and send the upstream the same target."""
    seen = []
    for proc in pair:
        t = tag()
        r = httpx.get(proc.url + target, headers={"x-test-tag": t}, timeout=20)
        assert r.status_code < 500, r.text
        (up,) = recorded(fake_upstream, t)
        seen.append((r.status_code, _normal(r.content), up["path"], up["query"]))
    assert seen[0] == seen[1] == seen[2]


def _raw_exchange(url: str, chunks: list[bytes], pause: float = 0.0, reads: int = 1) -> bytes:
    """Send `chunks` on one connection (`pause` seconds apart), then read until `reads` answers are whole or
    the proxy closes."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for i, chunk in enumerate(chunks):
            if i and pause:
                time.sleep(pause)
            sock.sendall(chunk)
        data = b""
        while data.count(b"HTTP/1.1 ") < reads or not data.endswith((b"}", b"\n")):
            more = sock.recv(65536)
            if not more:
                break
            data += more
        return data


def _head_and_body(payload: dict, t: str, extra: str = "") -> tuple[bytes, bytes]:
    raw = json.dumps(payload).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nX-Test-Tag: {t}\r\n{extra}\r\n").encode()
    return head, raw


def test_pipelined_and_slow_bodies_on_the_protocol_path(pair, fake_upstream):
    """Two requests in one write come back whole and in order; a body that arrives after its head (and in
    pieces) is read whole; a client gone before its body is complete sends nothing upstream — on every arm
    alike."""
    for proc in pair:
        t1, t2 = tag(), tag()
        a, b = _head_and_body(body(), t1), _head_and_body(body(), t2)
        data = _raw_exchange(proc.url, [a[0] + a[1] + b[0] + b[1]], reads=2)
        answers = data.split(b"HTTP/1.1 ")[1:]
        assert [x[:3] for x in answers] == [b"200", b"200"], data[:300]
        assert len(recorded(fake_upstream, t1)) == len(recorded(fake_upstream, t2)) == 1

        t3 = tag()
        head, raw = _head_and_body(body(), t3)
        data = _raw_exchange(proc.url, [head, raw[:10], raw[10:]], pause=0.1)
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        (up,) = recorded(fake_upstream, t3)
        assert json.loads(up["body"]) == body()

        t4 = tag()
        head, raw = _head_and_body(body(), t4)
        import socket

        host, port = proc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + raw[:10])
            # the proxy is reading this request (it is in flight) when the client goes
            wait_for(lambda: scraped(proc, "toolquake_in_flight_requests") == 1, what="the request to be read")
        # the proxy gave the request up: only then can its absence upstream say anything
        wait_for(lambda: scraped(proc, "toolquake_in_flight_requests") == 0, what="the request to be given up")
        assert recorded(fake_upstream, t4) == []
        assert httpx.post(proc.url + "/v1/chat/completions", json=body()).status_code == 200


def test_several_upstream_set_cookie_headers_reach_the_client_apart(pair, fake_upstream):
    """A backend (or the load balancer in front of it) sets two cookies whose Expires dates hold commas: the
    client gets the same two Set-Cookie headers — on the lean path in the protocol and as ASGI, on the
    framework's route, streamed or not, on a passthrough route and through a perturbing profile."""
    from tests.fake_upstream import fake_cookies

    h = {"x-fake-cookies": "2"}
    sends = [("POST", "/v1/chat/completions", body()), ("POST", "/v1/chat/completions", body(stream=True)),
             ("POST", "/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}),
             ("GET", "/v1/models", None), ("POST", "/p/shuffled/v1/chat/completions", body()),
             ("POST", "/p/shuffled/v1/chat/completions", body(stream=True))]
    for proc in pair:
        for method, path, payload in sends:
            with httpx.stream(method, proc.url + path, json=payload, headers=h, timeout=20) as r:
                r.read()
                assert r.status_code == 200, (path, r.text[:200])
                assert r.headers.get_list("set-cookie") == fake_cookies(2), (proc.url, method, path)
