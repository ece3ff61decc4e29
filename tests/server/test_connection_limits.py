"""Connection limits (proxy/server/limits.py), attacked as a hostile client would, with raw sockets against real
`toolquake serve` processes: half-sent headers are cut off, an over-size head gets 431 (a long URL 414), an idle
kept-alive connection is closed, and beyond the connection or request limit a client gets an OpenAI-shaped 503 with
Retry-After, a body that stalls or trickles gets 408 and frees its in-flight slot; after each attack a normal client
(the `openai` SDK) is served. On the lean path in the protocol, the lean path as ASGI (`lean_protocol = false`),
the framework's route (a perturbing profile, or `lean_path = false`), and with two workers."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support import Proc, metric_value, recorded, start_proxy
from tests.support.chat import TOOLS, body, tag

HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 4.0
#: not a whole number of seconds: uvicorn was handed int(keep_alive_timeout) before, closing 0.9 s early
KEEP_ALIVE = 2.9
MAX_HEADER = 16384
MAX_URL = 4096
MAX_CONNECTIONS = 6
MAX_REQUESTS = 2
#: what a loaded machine may add to a timer before a socket sees its effect
MARGIN = 5.0
#: timers never fire early; clocks of two processes may differ by this much
EARLY = 0.05
CONFIG = f"""
[server]
header_timeout = {HEADER_TIMEOUT}
body_timeout = {BODY_TIMEOUT}
keep_alive_timeout = {KEEP_ALIVE}
max_header_bytes = {MAX_HEADER}
max_url_bytes = {MAX_URL}
max_client_connections = {MAX_CONNECTIONS}
max_in_flight_requests = {MAX_REQUESTS}
lean_path = {{lean_path}}
lean_protocol = {{lean_protocol}}
[scoring]
enabled = false
[profiles.reversed]
mode = "perturb"
perturbers = [{{{{ name = "tool_order", params = {{{{ mode = "reverse" }}}} }}}}]
"""
#: arm → (lean_protocol, the profile its model requests name)
ARMS = {"lean-protocol": ("true", "off"), "lean-asgi": ("false", "off"), "framework": ("true", "reversed")}


@pytest.fixture(scope="module", params=list(ARMS))
def arm(request, fake_upstream) -> Any:
    lean_protocol, profile = ARMS[request.param]
    proc = start_proxy(fake_upstream.url, CONFIG.format(lean_path="true", lean_protocol=lean_protocol))
    proc.profile = profile  # type: ignore[attr-defined]
    proc.fake = fake_upstream  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def two_workers(fake_upstream) -> Any:
    proc = start_proxy(fake_upstream.url, CONFIG.format(lean_path="true", lean_protocol="true"), None, "--workers",
                       "2")
    proc.profile = "off"  # type: ignore[attr-defined]
    proc.fake = fake_upstream  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def lean_off(fake_upstream) -> Any:
    """Every request through the framework (`lean_path = false`, `lean_protocol = false`)."""
    proc = start_proxy(fake_upstream.url, CONFIG.format(lean_path="false", lean_protocol="false"))
    proc.profile = "off"  # type: ignore[attr-defined]
    proc.fake = fake_upstream  # type: ignore[attr-defined]
    yield proc
    proc.stop()


# -- raw HTTP/1.1 over a socket ------------------------------------------------------------------------

def _port(proc: Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def _connect(proc: Proc) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(proc)), timeout=HEADER_TIMEOUT + MARGIN)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole answer (status, headers, body with its Content-Length) from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a whole head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return status, headers, rest[:length]


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the proxy closes `sock` (whatever it still sends is read and dropped)."""
    start = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def _model_request(proc: Any, headers: str = "", body_bytes: bytes | None = None) -> bytes:
    data = body_bytes if body_bytes is not None else json.dumps(body()).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Toolquake-Profile: {proc.profile}\r\n{headers}Content-Length: {len(data)}\r\n\r\n").encode() + data


def _assert_openai_error(status: int, headers: dict[str, str], data: bytes, want_status: int, code: str) -> None:
    assert status == want_status, (status, data)
    assert headers["content-type"].startswith("application/json")
    error = json.loads(data)["error"]
    assert error["code"] == code and error["message"] and error["type"], error


def _served(proc: Any) -> None:
    """A normal client (the SDK, fresh connections, no retries) is served on the arm's route; where the profile
    perturbs, the upstream saw the tools reversed (the framework's route ran)."""
    t = tag()
    deadline = time.monotonic() + 10
    with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0,
                       default_headers={"X-Toolquake-Profile": proc.profile, "X-Test-Tag": t}) as client:
        while True:  # a connection refused by a test just before may take a moment to be gone
            try:
                answer = client.chat.completions.create(**body())
                break
            except openai.APIStatusError as exc:
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    (seen_request,) = recorded(proc.fake, t)
    seen = [tool["function"]["name"] for tool in json.loads(seen_request["body"])["tools"]]
    names = [tool["function"]["name"] for tool in TOOLS]
    assert seen == (names[::-1] if proc.profile == "reversed" else names)
    assert answer.choices[0].message.tool_calls[0].function.name == seen[0]  # the fake calls the first tool


# -- header-read timeout -------------------------------------------------------------------------------

def test_half_sent_headers_are_cut_off_with_408(arm):
    started = time.monotonic()  # before the connection: the proxy's clock starts later, never earlier
    sock = _connect(arm)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    status, headers, data = _read_answer(sock)
    waited = time.monotonic() - started
    _assert_openai_error(status, headers, data, 408, "request_timeout")
    assert HEADER_TIMEOUT - EARLY <= waited <= HEADER_TIMEOUT + MARGIN, waited
    assert _closed_after(sock) < MARGIN
    sock.close()
    _served(arm)


def test_a_connection_that_sends_nothing_is_closed(arm):
    started = time.monotonic()
    sock = _connect(arm)
    _closed_after(sock)
    waited = time.monotonic() - started
    sock.close()
    assert HEADER_TIMEOUT - EARLY <= waited <= HEADER_TIMEOUT + MARGIN, waited
    _served(arm)


def test_half_sent_headers_of_a_second_request_on_a_kept_alive_connection_are_cut_off(arm):
    """The first request is answered; the next one's head stalls: its header timeout runs from its first byte
    (the keep-alive timer stopped at that byte, and nothing else watched the connection before)."""
    sock = _connect(arm)
    sock.sendall(_model_request(arm))
    status, _, _ = _read_answer(sock)
    assert status == 200
    started = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
    status, headers, data = _read_answer(sock)
    waited = time.monotonic() - started
    _assert_openai_error(status, headers, data, 408, "request_timeout")
    assert HEADER_TIMEOUT - EARLY <= waited <= HEADER_TIMEOUT + MARGIN, waited
    sock.close()
    _served(arm)


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_timeout(arm):
    """Closed keep_alive_timeout after the answer, not earlier (its fraction was cut off before) nor much later."""
    sock = _connect(arm)
    started = time.monotonic()  # before the request: the proxy's keep-alive clock starts after its answer
    sock.sendall(_model_request(arm))
    assert _read_answer(sock)[0] == 200
    _closed_after(sock)
    waited = time.monotonic() - started
    sock.close()
    assert KEEP_ALIVE - EARLY <= waited <= KEEP_ALIVE + MARGIN, waited


# -- body timeout ------------------------------------------------------------------------------------------

#: what a stalled body announces and what it sends of it
STALLED_LENGTH, STALLED_SENT = 100_000, 25


def _stall(proc: Any, n: int) -> list[socket.socket]:
    """`n` model requests whose head and first STALLED_SENT of STALLED_LENGTH body bytes are sent, then nothing."""
    socks = []
    for _ in range(n):
        sock = _connect(proc)
        sock.settimeout(BODY_TIMEOUT + MARGIN)
        sock.sendall(_model_request(proc, body_bytes=b"{" * STALLED_SENT)
                     .replace(b"Content-Length: %d" % STALLED_SENT, b"Content-Length: %d" % STALLED_LENGTH))
        socks.append(sock)
    return socks


def _rejected(proc: Proc, reason: str) -> float:
    return metric_value(httpx.get(f"{proc.url}/metrics").text, "toolquake_connections_rejected_total", reason=reason)


def _stalled_bodies_get_408_and_free_their_slots(proc: Any, n: int) -> None:
    """`n` stalled bodies (each holding an in-flight slot) are answered 408 at the body timeout, their connections
    closed and counted; then a normal client is served (the slots are free again)."""
    before = _rejected(proc, "body_timeout")
    started = time.monotonic()  # before the requests: the proxy's clock starts later, never earlier
    socks = _stall(proc, n)
    try:
        for sock in socks:
            status, headers, data = _read_answer(sock)
            _assert_openai_error(status, headers, data, 408, "request_timeout")
            assert "body_timeout" in json.loads(data)["error"]["message"]
            assert headers["connection"] == "close"
            assert _closed_after(sock) < MARGIN
        waited = time.monotonic() - started
        assert BODY_TIMEOUT - EARLY <= waited <= BODY_TIMEOUT + MARGIN, waited
    finally:
        for sock in socks:
            sock.close()
    _served(proc)
    assert _rejected(proc, "body_timeout") >= before + n


def test_stalled_bodies_holding_every_slot_get_408_and_free_them(arm):
    """MAX_REQUESTS connections send a head and 25 of 100,000 body bytes, then nothing: while they stall, every
    other request is refused (they hold every in-flight slot), then each gets 408 at the body timeout and a normal
    client is served again (before, they held the slots for ever)."""
    _served(arm)
    started = time.monotonic()
    socks = _stall(arm, MAX_REQUESTS)
    try:
        while True:  # the stalled requests hold both slots: another request is refused
            other = _connect(arm)
            other.sendall(_model_request(arm))
            status, headers, data = _read_answer(other)
            other.close()
            if status == 503:
                _assert_openai_error(status, headers, data, 503, "too_many_requests")
                break
            assert status == 200 and time.monotonic() - started < BODY_TIMEOUT, (status, data)
        for sock in socks:
            status, headers, data = _read_answer(sock)
            _assert_openai_error(status, headers, data, 408, "request_timeout")
            assert _closed_after(sock) < MARGIN
    finally:
        for sock in socks:
            sock.close()
    _served(arm)


def test_a_stalled_body_gets_408_and_is_counted(arm):
    _stalled_bodies_get_408_and_free_their_slots(arm, 1)


def test_a_stalled_body_gets_408_on_the_framework_with_the_lean_path_off(lean_off):
    _stalled_bodies_get_408_and_free_their_slots(lean_off, MAX_REQUESTS)


def test_a_trickling_body_is_cut_at_the_body_timeout(arm):
    """A body whose bytes keep coming (one every 0.2 s) but that is not whole by the body timeout is cut alike: the
    timeout is a deadline for the whole body, not for the gap between two reads."""
    started = time.monotonic()
    (sock,) = _stall(arm, 1)
    sent = STALLED_SENT
    try:
        while not select.select([sock], [], [], 0.2)[0]:
            assert time.monotonic() - started < BODY_TIMEOUT + MARGIN, "no answer to a trickling body"
            sock.sendall(b" ")
            sent += 1
        status, headers, data = _read_answer(sock)
        waited = time.monotonic() - started
        _assert_openai_error(status, headers, data, 408, "request_timeout")
        assert BODY_TIMEOUT - EARLY <= waited <= BODY_TIMEOUT + MARGIN, waited
        assert sent > STALLED_SENT + 5  # bytes kept coming until the cut
    finally:
        sock.close()
    _served(arm)


def test_a_body_sent_in_parts_within_the_body_timeout_is_served(arm):
    """The deadline holds a body to its length, not to one read: a body in three writes 0.5 s apart is served."""
    data = json.dumps(body()).encode()
    request = _model_request(arm, body_bytes=data)
    head = request[:len(request) - len(data)]
    sock = _connect(arm)
    try:
        sock.sendall(head)
        for part in (data[:10], data[10:20], data[20:]):
            time.sleep(0.5)
            sock.sendall(part)
        status, _, answer = _read_answer(sock)
        assert status == 200, answer
    finally:
        sock.close()


# -- head size -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [MAX_HEADER + 1024, 1024 * 1024])
def test_an_oversize_header_gets_431_and_the_connection_is_closed(arm, size):
    sock = _connect(arm)
    # sent from a thread: the proxy answers before the last byte and drops what still comes
    sender = threading.Thread(target=sock.sendall, args=(_model_request(arm, f"X-Big: {'a' * size}\r\n"),))
    sender.start()
    status, headers, data = _read_answer(sock)
    _assert_openai_error(status, headers, data, 431, "request_header_fields_too_large")
    assert headers["connection"] == "close"
    assert _closed_after(sock) < MARGIN
    sender.join(MARGIN)
    sock.close()
    _served(arm)


def test_many_headers_over_the_cap_in_small_writes_get_431(arm):
    """The cap counts the whole head, not one header, also when it comes in many small writes."""
    sock = _connect(arm)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    for i in range(MAX_HEADER // 500 + 10):
        try:
            sock.sendall(f"X-H{i}: {'b' * 500}\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.001)
    status, headers, data = _read_answer(sock)
    _assert_openai_error(status, headers, data, 431, "request_header_fields_too_large")
    sock.close()


def test_a_head_under_the_cap_is_served_whatever_its_body(arm):
    """A head just under the cap, in one write with its body, is not mistaken for an oversize one."""
    sock = _connect(arm)
    sock.sendall(_model_request(arm, f"X-Pad: {'p' * (MAX_HEADER - 1024)}\r\n"))
    status, _, data = _read_answer(sock)
    sock.close()
    assert status == 200, data


def test_a_long_url_gets_414(arm):
    sock = _connect(arm)
    sock.sendall(f"GET /v1/models?q={'u' * MAX_URL} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, headers, data = _read_answer(sock)
    _assert_openai_error(status, headers, data, 414, "uri_too_long")
    assert _closed_after(sock) < MARGIN
    sock.close()
    _served(arm)


def test_refusals_are_counted_by_reason(arm):
    sock = _connect(arm)
    sock.sendall(f"GET /{'u' * (MAX_URL + 1)} HTTP/1.1\r\n\r\n".encode())
    assert _read_answer(sock)[0] == 414
    sock.close()
    text = httpx.get(f"{arm.url}/metrics").text
    assert metric_value(text, "toolquake_connections_rejected_total", reason="url_too_long") >= 1


# -- connections and requests in flight ----------------------------------------------------------------

def test_a_connection_beyond_the_limit_gets_503_json_at_once(arm):
    _served(arm)
    held = [_connect(arm) for _ in range(MAX_CONNECTIONS)]
    extra = _connect(arm)
    try:
        status, headers, data = _read_answer(extra)  # before the client sent a byte
        _assert_openai_error(status, headers, data, 503, "too_many_connections")
        assert headers["retry-after"] == "1"
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # read and dropped: no reset, a clean close
        assert _closed_after(extra) < MARGIN
        for sock in held:  # the connections within the limit are served
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_answer(sock)[0] == 200
    finally:
        for sock in (*held, extra):
            sock.close()
    _served(arm)


def _slow_requests(proc: Any, n: int, delay_ms: int) -> tuple[list[threading.Thread], list[Any]]:
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        try:
            results[i] = httpx.post(f"{proc.url}/v1/chat/completions", json=body(), timeout=30,
                                    headers={"X-Toolquake-Profile": proc.profile, "X-Fake-Fault": f"delay:{delay_ms}"})
        except httpx.HTTPError as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def _wait_in_flight(proc: Proc, n: int, results: list[Any]) -> None:
    # A scrape being served is one of the worker's tasks in flight too (never refused, but counted): polling
    # while the slow requests are still arriving could push one of them past the limit. They take 3 s upstream,
    # so wait until they are surely in, then poll.
    time.sleep(1.0)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = httpx.get(f"{proc.url}/metrics").text
        if metric_value(text, "toolquake_in_flight_requests") >= n:
            return
        time.sleep(0.05)
    answered = [r if isinstance(r, Exception) or r is None else (r.status_code, r.text[:200]) for r in results]
    rejected = {reason: metric_value(text, "toolquake_connections_rejected_total", reason=reason)
                for reason in ("too_many_connections", "too_many_requests", "header_timeout")}
    raise AssertionError(f"{n} requests never were in flight; the slow requests got {answered}; rejected so far "
                         f"{rejected}")


def test_a_request_beyond_the_in_flight_limit_gets_503_json(arm):
    _served(arm)
    threads, results = _slow_requests(arm, MAX_REQUESTS, 3000)
    _wait_in_flight(arm, MAX_REQUESTS, results)  # /metrics is never refused
    sock = _connect(arm)
    sock.sendall(_model_request(arm))
    status, headers, data = _read_answer(sock)
    _assert_openai_error(status, headers, data, 503, "too_many_requests")
    assert headers["retry-after"] == "1"
    assert "close" not in headers.get("connection", "")
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection stays usable; probes never refused
    assert _read_answer(sock)[0] == 200
    sock.close()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [200] * MAX_REQUESTS, results
    text = httpx.get(f"{arm.url}/metrics").text
    assert metric_value(text, "toolquake_connections_rejected_total", reason="too_many_requests") >= 1
    _served(arm)


# -- two workers: every worker holds the limits ----------------------------------------------------------

def test_two_workers_cut_off_stalled_bodies(two_workers):
    """Stalled bodies get 408 on either worker (the kernel hands the connections to either), counted over both."""
    _stalled_bodies_get_408_and_free_their_slots(two_workers, MAX_REQUESTS)


def test_two_workers_cut_off_half_sent_headers_and_oversize_heads(two_workers):
    socks = [_connect(two_workers) for _ in range(4)]  # the kernel hands them to either worker
    started = time.monotonic()
    for sock in socks:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: ")
    for sock in socks:
        status, headers, data = _read_answer(sock)
        _assert_openai_error(status, headers, data, 408, "request_timeout")
        sock.close()
    assert time.monotonic() - started <= HEADER_TIMEOUT + MARGIN
    for _ in range(4):
        sock = _connect(two_workers)
        sock.sendall(_model_request(two_workers, f"X-Big: {'a' * (MAX_HEADER + 1)}\r\n"))
        status, headers, data = _read_answer(sock)
        _assert_openai_error(status, headers, data, 431, "request_header_fields_too_large")
        sock.close()
    _served(two_workers)


def test_two_workers_each_hold_the_connection_limit(two_workers):
    _served(two_workers)
    n = 2 * MAX_CONNECTIONS + 3
    socks = [_connect(two_workers) for _ in range(n)]
    refused = 0
    try:
        for sock in socks:  # refused: a 503 at once; accepted: closed without a word at the header timeout
            try:
                first = sock.recv(65536)
            except ConnectionResetError:
                first = b""
            if first:
                assert first.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in first, first
                refused += 1
    finally:
        for sock in socks:
            sock.close()
    assert refused >= n - 2 * MAX_CONNECTIONS, refused
    _served(two_workers)


def test_two_workers_each_hold_the_request_limit(two_workers):
    _served(two_workers)
    n = 2 * MAX_REQUESTS + 2
    threads, results = _slow_requests(two_workers, n, 3000)
    for t in threads:
        t.join(30)
    statuses = [r.status_code for r in results]
    assert statuses.count(200) <= 2 * MAX_REQUESTS and statuses.count(503) >= n - 2 * MAX_REQUESTS, statuses
    assert set(statuses) <= {200, 503}, results
    for r in results:
        if r.status_code == 503:
            # a worker handed more connections than its limit refuses those at once
            assert r.json()["error"]["code"] in ("too_many_requests", "too_many_connections")
            assert r.headers["retry-after"] == "1"
    _served(two_workers)


@pytest.mark.parametrize("fragment", ["header_timeout = 0", "body_timeout = 0", "max_client_connections = 0",
                                      "max_in_flight_requests = 0", "max_profiles = 0",
                                      "max_url_bytes = 0", "max_header_bytes = 100\nmax_url_bytes = 200",
                                      "keep_alive_timeout = -1"])
def test_limits_that_would_refuse_everything_are_config_errors(tmp_path, fragment):
    from toolquake.proxy.server.config import ConfigError, load_config

    path = tmp_path / "limits.toml"
    path.write_text(f"[server]\n{fragment}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={})
    assert fragment.split()[0] in str(raised.value) or fragment.splitlines()[-1].split()[0] in str(raised.value)
    path.write_text("[server]\nheader_timeout = 0.5\nmax_client_connections = 1\n")
    assert load_config(path, env={}).server.max_client_connections == 1
