"""Limits on client connections, held in uvicorn's HTTP protocol so they apply to every request of every worker.

`limited_protocol` subclasses the protocol a server runs (the lean protocol of proxy/server/lean.py, or
uvicorn's httptools protocol when the lean path runs as ASGI or is off), so the framework's routes, the lean
path and the admin and health routes are all behind the same limits:

- the request head (request line and headers) must arrive within `header_timeout` seconds: from the connection's
  start for its first request, from a request's first byte for a later one on a kept-alive connection (408, or
  a plain close when not a byte of the request came); the idle time between requests is uvicorn's
  `timeout_keep_alive` ([server] keep_alive_timeout);
- the request body must arrive whole within `body_timeout` seconds of the end of its head (a total deadline, not
  a minimum rate: a body that trickles is cut as one that stopped), else 408 and the connection is closed; the
  request's handler, waiting for the body, sees the client gone and ends, which frees its in-flight slot;
- a head larger than `max_header_bytes` gets 431 (measured as the bytes arrive, so a huge header is never
  buffered whole), a URL longer than `max_url_bytes` 414;
- beyond `max_client_connections` open connections a new one gets 503 at once; beyond
  `max_in_flight_requests` requests being served a new request gets 503 (the health and metrics routes are
  never refused), both with `Retry-After`.

Every refusal is an OpenAI-shaped error, counted in `toolquake_connections_rejected_total{reason}`. A
refused connection is closed without losing the answer: the write side is shut first and what the client
still sends is read and dropped for up to `LINGER_S`, so the client reads the answer rather than a reset.
The cost per request is four more Python calls (on_message_begin, on_headers_complete, _start_asgi_task: 57 → 60
per request through the protocol, measured before the body deadline, which adds on_message_complete) with a few
attribute reads, lengths and two clock reads; a body chunk costs one length and one comparison. One timer per
connection serves both deadlines (the head's and the body's): it is re-armed only when it fires early, or when a
body is due before it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

import httptools

from toolquake.proxy.server.errors import error_body

if TYPE_CHECKING:
    from toolquake.proxy.server.config import ServerConfig

#: seconds a refused connection is kept to read and drop what the client still sends, so it gets the answer
LINGER_S = 2.0
#: seconds a client is asked to wait (`Retry-After`) after a 503 for too many connections or requests
RETRY_AFTER_S = 1
#: routes never refused for the number of requests in flight (probes and scrapes must see a busy proxy)
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
#: the protocol methods and attributes this relies on (uvicorn's httptools protocol)
_NEEDED = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_headers_complete",
           "on_message_complete", "_start_asgi_task", "_unset_keepalive_if_required", "send_400_response",
           "_should_upgrade", "handle_websocket_upgrade", "_unsupported_upgrade_warning")


class _Refused(Exception):
    """Raised out of a parser callback to stop parsing; the refusal is in the protocol's `_refusal`."""


def _answer(status: int, phrase: bytes, message: str, type_: str, code: str, extra: bytes = b"") -> bytes:
    body = error_body(message, type_, code)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
            % (status, phrase, len(body), extra)) + body


def _refusals(server: ServerConfig) -> dict[str, bytes]:
    """The whole answer (status line, head, body) for each reason, built once."""
    retry = b"retry-after: %d\r\n" % RETRY_AFTER_S
    return {
        "header_timeout": _answer(408, b"Request Timeout", f"The request headers did not arrive within "
                                  f"{server.header_timeout:g} s ([server] header_timeout).", "invalid_request_error",
                                  "request_timeout"),
        "body_timeout": _answer(408, b"Request Timeout", f"The request body did not arrive whole within "
                                f"{server.body_timeout:g} s of its headers ([server] body_timeout).",
                                "invalid_request_error", "request_timeout"),
        "header_too_large": _answer(431, b"Request Header Fields Too Large", f"The request line and headers are "
                                    f"larger than {server.max_header_bytes} bytes ([server] max_header_bytes).",
                                    "invalid_request_error", "request_header_fields_too_large"),
        "url_too_long": _answer(414, b"URI Too Long", f"The request URL is longer than {server.max_url_bytes} "
                                f"bytes ([server] max_url_bytes).", "invalid_request_error", "uri_too_long"),
        "too_many_connections": _answer(503, b"Service Unavailable", f"The proxy has "
                                        f"{server.max_client_connections} client connections open on this worker "
                                        f"([server] max_client_connections); retry in {RETRY_AFTER_S} s.",
                                        "server_error", "too_many_connections", retry),
    }


def rejection_counter(app: Any) -> Callable[[str], None] | None:
    """`count(reason)` over `toolquake_connections_rejected_total` of the proxy behind `app` (None: no proxy)."""
    st = getattr(getattr(app, "state", None), "proxy", None)
    if st is None:
        return None
    metrics = st.metrics

    def count(reason: str) -> None:
        metrics.child(metrics.connections_rejected, reason).inc()

    return count


def _busy_app(server: ServerConfig, count: Callable[[str], None]) -> Callable[..., Any]:
    """The ASGI app answering a request beyond max_in_flight_requests (the connection stays usable)."""
    body = error_body(f"The proxy is serving {server.max_in_flight_requests} requests on this worker "
                      f"([server] max_in_flight_requests); retry in {RETRY_AFTER_S} s.", "server_error",
                      "too_many_requests")
    head = {"type": "http.response.start", "status": 503,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                        (b"retry-after", b"%d" % RETRY_AFTER_S)]}
    end = {"type": "http.response.body", "body": body, "more_body": False}

    async def busy(scope: dict, receive: Any, send: Any) -> None:
        count("too_many_requests")
        await send(head)
        await send(end)

    return busy


class _Limits:
    """The limits, mixed in ahead of uvicorn's protocol by `limited_protocol`, which sets the class attributes
    below from the [server] section; the protocol behind it in the MRO provides the rest (`loop`, `connections`,
    `tasks`, `transport`, `parser`, `cycle`, `pipeline`, `scope`, `flow`, `app`, `url`, `headers` and the methods in
    `_NEEDED`)."""

    header_timeout: float
    body_timeout: float
    max_header_bytes: int
    max_url_bytes: int
    max_connections: int
    max_requests: int
    #: reason → the whole answer (`_refusals`)
    refusals: dict[str, bytes]
    #: `counted(reason)`: one refusal more in `toolquake_connections_rejected_total`
    counted: Callable[[str], None]
    #: the ASGI app answering a request beyond `max_requests`
    busy: Callable[..., Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: bytes of the request head received so far (counted per read); -1 between heads
        self._head_seen = 0
        #: when the head in progress must be complete (loop time)
        self._head_deadline = 0.0
        #: when the body in progress must be complete (loop time); 0 when no body is in progress
        self._body_deadline = 0.0
        #: the connection's one timer, for the head's deadline or the body's (whichever is in progress)
        self._timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        #: the size of the read being parsed
        self._chunk = 0
        #: a refusal raised out of a parser callback
        self._refusal: str | None = None
        #: answered and closing: whatever the client still sends is dropped
        self._refused = False

    # -- connection ---------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse("too_many_connections")
            return
        # the first request's head is due header_timeout after the connection opened
        self._head_deadline = self.loop.time() + self.header_timeout
        self._timer = self.loop.call_later(self.header_timeout, self._timer_fired)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_timers()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._chunk = len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:  # a callback below stopped the parser: our answer
                self._refuse(self._refusal)
            else:  # a malformed request: uvicorn's own answer
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._head_seen >= 0 and not self._refused:
            # a head still incomplete after this read: all of the read counts (at most one read too much)
            self._head_seen += self._chunk
            if self._head_seen > self.max_header_bytes:
                self._refuse("header_too_large")

    # -- parser callbacks ---------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_seen < 0:  # a later request on a kept-alive connection: its head is due from now
            self._head_seen = 0
            self._head_deadline = self.loop.time() + self.header_timeout
            if self._timer is None:
                self._timer = self.loop.call_later(self.header_timeout, self._timer_fired)

    def on_headers_complete(self) -> None:
        # the URL while it arrives is bounded by the head's cap; its own cap is checked here, once
        if len(self.url) > self.max_url_bytes:
            self._stop_parsing("url_too_long")
        if self._head_seen + self._chunk > self.max_header_bytes and self._head_size() > self.max_header_bytes:
            self._stop_parsing("header_too_large")
        self._head_seen = -1
        super().on_headers_complete()
        if self.cycle is None or self.cycle.scope is not self.scope:  # an upgrade: no request cycle of its own
            return
        # the body is due body_timeout from now (a request without one completes before this read's parse ends)
        due = self._body_deadline = self.loop.time() + self.body_timeout
        timer = self._timer
        if timer is None or timer.when() > due:  # else the head's timer, due sooner, finds the body and re-arms
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(due, self._timer_fired)

    def on_message_complete(self) -> None:
        self._body_deadline = 0.0
        super().on_message_complete()

    def _head_size(self) -> int:
        """The request head's size as sent (request line, headers, line ends), from what was parsed."""
        return len(self.url) + 16 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _stop_parsing(self, reason: str) -> None:
        self._refusal = reason
        raise _Refused(reason)

    # -- requests in flight ---------------------------------------------------------------------------
    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if len(self.tasks) >= self.max_requests and app is self.app \
                and cycle.scope["path"] not in UNLIMITED_PATHS:
            app = self.busy
        super()._start_asgi_task(cycle, app)

    # -- timers and refusals --------------------------------------------------------------------------
    def _timer_fired(self) -> None:
        self._timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._head_seen < 0:
            if self._body_deadline:
                self._body_timer_fired()
            return  # no head or body in progress: the next request's first byte arms the timer again
        left = self._head_deadline - self.loop.time()
        if left > 0:  # the head in progress began after this timer was set
            self._timer = self.loop.call_later(left, self._timer_fired)
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head stalled behind an answer still being written: close after that answer
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            self.counted("header_timeout")
            return
        if self._head_seen == 0:  # not a byte of a request: nothing to answer
            self.counted("header_timeout")
            self._refused = True
            self._cancel_timers()
            self.transport.close()
            return
        self._refuse("header_timeout")

    def _body_timer_fired(self) -> None:
        now = self.loop.time()
        if self.pipeline:  # queued behind an answer still being served (reading paused): due once its turn comes
            self._body_deadline = max(self._body_deadline, now + self.body_timeout)
        if self._body_deadline > now:
            self._timer = self.loop.call_at(self._body_deadline, self._timer_fired)
            return
        cycle = self.cycle
        if cycle.response_started:  # answered without the whole body (a refusal, a route that reads none): close
            self.counted("body_timeout")
            self._refused = True
            self._cancel_timers()
            self.transport.close()
            return
        # the handler waits for the body: it now gets a disconnect and what it still sends is dropped (uvicorn's
        # cycle), so it ends and frees its slot while the 408 goes out
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse("body_timeout", answering=True)

    def _refuse(self, reason: str, answering: bool = False) -> None:
        """Answer `reason`'s error and close: write side first, then drop what still comes for LINGER_S. `answering`:
        the request being served is the one refused (its cycle no longer writes), so the answer is ours to write."""
        self.counted(reason)
        self._refused = True
        self._cancel_timers()
        self._unset_keepalive_if_required()
        transport = self.transport
        if transport.is_closing():
            return
        if not answering and self.cycle is not None and not self.cycle.response_complete:
            transport.close()  # an answer is being written on this connection: no room for ours
            return
        transport.write(self.refusals[reason])
        if transport.can_write_eof():
            transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, transport.close)
        else:  # pragma: no cover - TLS transports cannot half-close
            transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._linger_timer = None


def limited_protocol(base: type, server: ServerConfig, count: Callable[[str], None] | None = None) -> type | None:
    """`base` (uvicorn's httptools protocol or a subclass) with the limits of `server` ([server] section);
    `count(reason)` is called for each refusal. None where `base` lacks what this hooks (another uvicorn)."""
    if not all(callable(getattr(base, name, None)) for name in _NEEDED):
        return None
    counted = count or (lambda reason: None)
    name = f"Limited{base.__name__}"
    return type(name, (_Limits, base), {
        "__qualname__": name, "header_timeout": server.header_timeout, "body_timeout": server.body_timeout,
        "max_header_bytes": server.max_header_bytes, "max_url_bytes": server.max_url_bytes,
        "max_connections": server.max_client_connections,
        "max_requests": server.max_in_flight_requests, "refusals": _refusals(server),
        "counted": staticmethod(counted), "busy": staticmethod(_busy_app(server, counted))})
