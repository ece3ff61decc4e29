"""The fast path's adapter (proxy/server/lean.py) against the uvicorn installed here: every uvicorn internal its
protocol seam relies on is there, with the signature and the behaviour it was written for, and a request the
seam serves gets, byte for byte on the socket, the answer the framework's route writes. An upgrade of uvicorn
that moves any of this fails here, instead of the lean path quietly falling back to ASGI or writing what
uvicorn itself would not."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tests.support.chat import body, tag
from toolquake.proxy.server import lean
from toolquake.proxy.server.app import create_app
from toolquake.proxy.server.chat import Plain
from toolquake.proxy.server.config import load_config
from toolquake.proxy.server.limits import limited_protocol

DATE = [(b"date", b"Thu, 26 Nov 2026 10:00:00 GMT")]


# -- the internals, one by one --------------------------------------------------------------------------------

def test_uvicorn_starts_every_request_through_the_method_the_seam_overrides():
    assert list(inspect.signature(HttpToolsProtocol._start_asgi_task).parameters) == ["self", "cycle", "app"]
    # a request whose head is complete, and a pipelined request whose turn came
    for caller in (HttpToolsProtocol.on_headers_complete, HttpToolsProtocol.on_response_complete):
        assert "self._start_asgi_task(" in inspect.getsource(caller), caller.__name__


def test_uvicorn_protocol_and_cycle_hold_what_the_seam_reads():
    config = uvicorn.Config(_never_called, log_level="warning")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        from uvicorn.server import ServerState

        protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        for name in lean.PROTOCOL_INTERNALS:
            assert hasattr(protocol, name), name
        assert protocol.app is config.loaded_app and protocol.loop is loop and isinstance(protocol.tasks, set)
    finally:
        loop.close()
    assert lean.CYCLE_PARAMETERS <= set(inspect.signature(RequestResponseCycle.__init__).parameters)
    cycle = _cycle(keep_alive=True)
    for name in lean.CYCLE_INTERNALS:
        assert hasattr(cycle, name), name
    assert hasattr(cycle.flow, "write_paused")
    assert inspect.iscoroutinefunction(RequestResponseCycle.run_asgi)
    assert (cycle.body, cycle.more_body, cycle.response_started, cycle.response_complete, cycle.disconnected) \
        == (bytearray(), True, False, False, False)


def test_the_seam_is_offered_on_this_uvicorn(tmp_path):
    """Where this fails, `toolquake serve` says `served_in: asgi` and loses the protocol path's speed."""
    app = create_app(_config(tmp_path, "http://127.0.0.1:9/v1", lean_path=True))
    lean_protocol = lean.lean_protocol(app)
    assert lean_protocol is not None and issubclass(lean_protocol, HttpToolsProtocol)
    assert limited_protocol(lean_protocol, app.state.proxy.config.server) is not None
    assert lean.lean_protocol(create_app(_config(tmp_path, "http://127.0.0.1:9/v1", lean_path=False))) is None


ANSWERS = [
    ("plain", Plain(b'{"ok":true}', 200, {"x-toolquake-request-id": "abc"}), True),
    ("closing", Plain(b'{"ok":true}', 200), False),
    ("says close", Plain(b'{"ok":true}', 200, {"connection": "close"}), True),
    ("two cookies", Plain(b"{}", 200, {"set-cookie": "a=1; Expires=Wed, 01 Jan 2031 00:00:00 GMT\nb=2"}), True),
    ("error", Plain(b'{"error":{}}', 404, {"Content-Type": "application/json"}), True),
    ("no phrase", Plain(b"", 599), True),
    ("text", Plain(b"hi", 200, media_type="text/plain"), True),
]


@pytest.mark.parametrize("name, answer, keep_alive", ANSWERS, ids=[a[0] for a in ANSWERS])
def test_the_one_write_is_what_uvicorns_send_writes(name, answer, keep_alive):
    """The lean path's one write of a whole answer: the same bytes and the same cycle state as uvicorn's `send`
    given the same head and body in two messages."""
    ours, theirs = _cycle(keep_alive), _cycle(keep_alive)
    assert lean._write_plain(answer, ours)
    asyncio.run(_uvicorn_send(theirs, answer))
    assert len(ours.transport.writes) == 1
    assert ours.transport.writes[0] == b"".join(theirs.transport.writes)
    for attr in ("response_started", "response_complete", "keep_alive", "waiting_for_100_continue"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.transport.closed == theirs.transport.closed == (not keep_alive or name == "says close")
    assert ours.message_event.is_set() and theirs.message_event.is_set()
    assert ours.responses == theirs.responses == 1


@pytest.mark.parametrize("header", [(b"x-bad", b"a\x01b"), (b"bad name", b"v")], ids=["value", "name"])
def test_the_one_write_leaves_to_uvicorn_what_uvicorn_refuses(header):
    ours, theirs = _cycle(True), _cycle(True)
    ours.default_headers = theirs.default_headers = [*DATE, header]
    answer = Plain(b"{}", 200)
    assert not lean._write_plain(answer, ours)
    assert ours.transport.writes == [] and not ours.response_started
    with pytest.raises(RuntimeError, match="Invalid HTTP header"):
        asyncio.run(_uvicorn_send(theirs, answer))


def test_the_one_write_waits_where_uvicorn_would():
    for state in ("disconnected", "response_started"):
        cycle = _cycle(True)
        setattr(cycle, state, True)
        assert not lean._write_plain(Plain(b"{}", 200), cycle) and cycle.transport.writes == []
    cycle = _cycle(True)
    cycle.flow.pause_writing()
    assert not lean._write_plain(Plain(b"{}", 200), cycle) and cycle.transport.writes == []


# -- through a served socket -----------------------------------------------------------------------------------

REQUESTS = [
    ("answer", "/v1/chat/completions", body(), {}),
    ("stream", "/v1/chat/completions", body(stream=True), {}),
    ("responses", "/v1/responses", {"model": "fake-model", "input": "hi"}, {}),
    ("responses stream", "/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}, {}),
    ("invalid json", "/v1/chat/completions", b"{not json", {}),
    ("upstream 500", "/v1/chat/completions", body(), {"x-fake-fault": "status:500"}),
    ("cookies", "/v1/chat/completions", body(), {"x-fake-cookies": "2"}),
    ("profile path", "/p/off/v1/chat/completions", body(), {}),
]
#: head fields whose values differ between two answers (and the length, as ids differ in length)
VOLATILE = re.compile(rb"^(date|x-toolquake-request-id|x-toolquake-overhead-ms|content-length): .*$", re.M | re.I)
IDS = re.compile(rb'"(id|created|created_at|response_id|item_id)":\s*("[^"]*"|\d+)')


@pytest.fixture(scope="module")
def served(fake_upstream, tmp_path_factory):
    """The lean path served through the protocol seam (as `toolquake serve` runs it, behind the limits), and the
    framework's route (`lean_path = false`), each by uvicorn in a thread, with every socket write recorded."""
    tmp = tmp_path_factory.mktemp("fast-path")
    servers = {"protocol": _Served(tmp, fake_upstream.url, lean_path=True),
               "framework": _Served(tmp, fake_upstream.url, lean_path=False)}
    yield servers
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("name, path, payload, headers", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_the_protocol_seam_answers_byte_for_byte_as_the_framework(served, name, path, payload, headers):
    lean_writes = served["protocol"].ask(path, payload, headers)
    framework_writes = served["framework"].ask(path, payload, headers)
    assert _normal(b"".join(lean_writes)) == _normal(b"".join(framework_writes))
    assert _length_is_right(b"".join(lean_writes)) and _length_is_right(b"".join(framework_writes))
    if b"text/event-stream" not in lean_writes[0]:  # a whole answer: one write through the seam, not through ASGI
        assert len(lean_writes) == 1 and len(framework_writes) > 1, (len(lean_writes), len(framework_writes))


def test_a_request_the_lean_path_does_not_take_falls_back_to_the_framework(served):
    perturbed = served["protocol"].ask("/p/reversed/v1/chat/completions", body(), {})
    assert perturbed[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert len(perturbed) > 1  # head and body apart: written by uvicorn's send for the framework's route
    assert b'"choices"' in b"".join(perturbed)


# -- helpers ---------------------------------------------------------------------------------------------------

async def _never_called(scope: dict, receive: Any, send: Any) -> None:  # pragma: no cover - never served
    raise AssertionError("not served")


class _Wire:
    """What uvicorn writes to a connection, kept (the transport a cycle is given)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _cycle(keep_alive: bool) -> Any:
    wire = _Wire()
    cycle = RequestResponseCycle(
        scope={"type": "http", "method": "POST", "path": "/v1/chat/completions", "http_version": "1.1"},
        transport=wire, flow=FlowControl(wire), logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"), access_log=False, default_headers=list(DATE),
        message_event=asyncio.Event(), expect_100_continue=False, keep_alive=keep_alive,
        on_response=lambda: setattr(cycle, "responses", cycle.responses + 1))
    cycle.responses = 0
    return cycle


async def _uvicorn_send(cycle: Any, answer: Plain) -> None:
    await cycle.send(lean._head(answer, len(answer.content)))
    await cycle.send({"type": "http.response.body", "body": answer.content, "more_body": False})


def _config(tmp, upstream: str, *, lean_path: bool) -> Any:
    path = tmp / f"lean-{lean_path}.toml"
    path.write_text(f"[server]\nlean_path = {str(lean_path).lower()}\n[scoring]\nenabled = false\n"
                    "[profiles.reversed]\nmode = 'perturb'\n"
                    "perturbers = [{ name = 'tool_order', params = { mode = 'reverse' } }]\n")
    return load_config(path, env={}, overrides={"upstream": upstream})


class _Tap:
    """A connection's transport, every write kept on the way through."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Served:
    """`create_app` served by uvicorn in a thread of this process, with the protocol `toolquake serve` would run
    (the limits over the lean protocol, or over uvicorn's own when the lean path is off)."""

    def __init__(self, tmp, upstream: str, *, lean_path: bool) -> None:
        app = create_app(_config(tmp, f"{upstream}/v1", lean_path=lean_path))
        server = app.state.proxy.config.server
        base = lean.lean_protocol(app) if lean_path else HttpToolsProtocol
        assert base is not None
        limited = limited_protocol(base, server)
        assert limited is not None
        self.connections: list[list[bytes]] = []
        connections = self.connections

        class Tapped(limited):  # type: ignore[misc,valid-type]
            def connection_made(self, transport: Any) -> None:
                connections.append([])
                super().connection_made(_Tap(transport, connections[-1]))

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, http=Tapped, loop="uvloop", log_level="warning",
                                                    access_log=False, server_header=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def ask(self, path: str, payload: Any, headers: dict) -> list[bytes]:
        """What the server wrote on the one connection of this request, write by write."""
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        h = {"content-type": "application/json", "x-test-tag": tag(), "x-toolquake-seed": "7", **headers}
        with httpx.Client(timeout=20) as client:
            before = len(self.connections)
            r = client.post(self.url + path, content=content, headers=h)
            r.read()
            assert len(self.connections) == before + 1
            writes = self.connections[-1]
        return list(writes)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def _normal(data: bytes) -> bytes:
    """An answer on the wire without what differs between two requests: ids, timestamps, their lengths, and
    where a chunked body's chunks end (a stream is relayed as the upstream's bytes arrive)."""
    head, _, rest = data.partition(b"\r\n\r\n")
    if re.search(rb"^transfer-encoding: chunked\r?$", head.replace(b"\r\n", b"\n"), re.M | re.I):
        rest = _dechunk(rest)
    return VOLATILE.sub(rb"\1: -", head.replace(b"\r\n", b"\n")) + b"\n\n" + IDS.sub(b"", rest)


def _dechunk(data: bytes) -> bytes:
    """A chunked body's payload; the framing must be whole and end with the last (empty) chunk."""
    out, at = [], 0
    while True:
        line_end = data.index(b"\r\n", at)
        size = int(data[at:line_end], 16)
        start = line_end + 2
        assert data[start + size:start + size + 2] == b"\r\n", data[at:at + 40]
        if size == 0:
            assert start + 2 == len(data), data[start:]
            return b"".join(out)
        out.append(data[start:start + size])
        at = start + size + 2


def _length_is_right(data: bytes) -> bool:
    head, _, rest = data.partition(b"\r\n\r\n")
    found = re.search(rb"^content-length: (\d+)\r?$", head.replace(b"\r\n", b"\n"), re.M | re.I)
    return found is None or int(found.group(1)) == len(rest)
