"""The fault matrix, streaming and not: every fault gets its documented answer, the upstream
connection is released, no task is left behind, and the next request is fine."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest

from tests.support import start_proxy, wait_for
from tests.support.chat import body
from tests.support.ports import held_port
from tests.support.server import on_every_worker, runtime

CONFIG = "[server]\nread_timeout = 1.0\n[scoring]\nenabled = false\n"


@pytest.fixture(scope="module", params=[("aiohttp", 1), ("httpx", 1), ("native", 1), ("native", 2)],
                ids=["aiohttp", "httpx", "native", "native-2workers"])
def proxy_1s(fake_upstream, request):
    """The fault matrix runs against every upstream client (`[server] upstream_client`), and against two
    worker processes sharing the port (`--workers 2`).

    With several workers, `/healthz` answers as soon as one of them serves; the others may still be starting.
    A worker that has not started adds nothing to `toolquake_event_loop_tasks` (its share of the summed gauge
    is 0 until its event loop runs), so a baseline read then is short by that worker's idle tasks, and every
    later reading looks like "N task(s) left behind" (seen under load: the sum went 6 -> 11 in the first half
    second after `/healthz` answered). So the fixture waits until every worker has served a request."""
    client, workers = request.param
    config = CONFIG.replace("[server]\n", f'[server]\nupstream_client = "{client}"\n')
    proc = start_proxy(fake_upstream.url, config, None, "--workers", str(workers))
    if workers > 1:
        on_every_worker(proc, lambda: httpx.post(f"{proc.url}/v1/chat/completions", json=body()), per_worker=1)
    yield proc
    proc.stop()


def settled(url: str, baseline_tasks: float, timeout: float = 15.0) -> tuple[float, float, float]:
    """Wait until no upstream connection is active, nothing is in flight, tasks are back to baseline; the state
    then (or the last one seen, for the caller's assertions to name, after `timeout`)."""
    state = [runtime(url)]

    def at_rest() -> bool:
        state[0] = runtime(url)
        active, tasks, in_flight = state[0]
        return active == 0 and in_flight == 0 and tasks <= baseline_tasks

    with contextlib.suppress(AssertionError):
        wait_for(at_rest, timeout, "the proxy to be at rest")
    return state[0]


def fault_request(url: str, fault: str, stream: bool) -> tuple[int, bytes]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body(stream=stream),
                      headers={"x-fake-fault": fault}, timeout=20) as r:
        return r.status_code, b"".join(r.iter_raw())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    "fault, check",
    [
        ("status:500", lambda status, data: status == 500 and b'"injected"' in data),
        ("status:429", lambda status, data: status == 429),
        ("invalid-json", lambda status, data: status == 502 and b"upstream_invalid_response" in data),
        ("hang", lambda status, data: status == 504 and b"upstream_timeout" in data),
        ("delay:1500", lambda status, data: status == 504 and b"upstream_timeout" in data),
        ("slow-bytes:1", lambda status, data: status == 200 and (b"[DONE]" in data or b"tool_calls" in data)),
        (
            "cut-stream",
            lambda status, data: (
                (status == 200 and data.startswith(b"data: ") and b"[DONE]" not in data and b'"error"' in data)
                or (status == 502 and b"upstream_unreachable" in data)
            ),
        ),
    ],
)
def test_fault_gets_its_answer_and_leaves_nothing_behind(proxy_1s, fault, check, stream):
    url = proxy_1s.url
    assert httpx.post(f"{url}/v1/chat/completions", json=body()).status_code == 200
    _, baseline_tasks, _ = settled(url, 1e9)
    status, data = fault_request(url, fault, stream)
    assert check(status, data), (status, data[:300])
    if fault == "cut-stream":  # a stream that started stays 200 and ends early; a plain answer cannot
        assert status == (200 if stream else 502)
    if status >= 500:
        assert b'"error"' in data and b'"message"' in data
    active, tasks, in_flight = settled(url, baseline_tasks)
    assert active == 0, "an upstream connection was not released"
    assert in_flight == 0
    assert tasks <= baseline_tasks, f"{tasks - baseline_tasks} task(s) left behind"
    assert httpx.post(f"{url}/v1/chat/completions", json=body()).status_code == 200


@pytest.fixture(scope="module")
def refused_proxy():
    """A proxy whose upstream refuses every connection (a port this process holds and never listens on)."""
    with held_port("127.0.0.1") as port:
        proc = start_proxy(f"http://127.0.0.1:{port}", CONFIG)
        yield proc
        proc.stop()


@pytest.mark.processes
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_upstream_refusing_connections_is_502_every_time(refused_proxy, stream):
    p = refused_proxy
    for _ in range(3):
        status, data = fault_request(p.url, "", stream)
        assert status == 502 and b"upstream_unreachable" in data
    assert runtime(p.url)[2] == 0


def test_client_abort_mid_stream_releases_everything(proxy_1s):
    url = proxy_1s.url
    _, baseline_tasks, _ = settled(url, 1e9)
    for _ in range(5):
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body(stream=True), headers={"x-fake-fault": "chunk-delay:200"}
        ) as r:
            next(r.iter_raw())
    active, tasks, in_flight = settled(url, baseline_tasks)
    assert (active, in_flight) == (0, 0)
    assert tasks <= baseline_tasks
    assert httpx.post(f"{url}/v1/chat/completions", json=body()).status_code == 200


def test_client_sending_slowly_is_served(proxy_1s):
    """A client that trickles its request (headers, then the body in small pieces) gets a normal answer."""
    import json

    payload = json.dumps(body()).encode()
    host, port = proxy_1s.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for i in range(0, len(head), 7):
            s.sendall(head[i : i + 7])
            time.sleep(0.005)
        for i in range(0, len(payload), 50):
            s.sendall(payload[i : i + 50])
            time.sleep(0.02)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    assert b'"tool_calls"' in data
