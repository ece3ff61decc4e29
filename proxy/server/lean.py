"""The fast path: one adapter between the model routes' handler, the framework and uvicorn.

**What it covers.** A `POST /v1/chat/completions` or `/v1/responses` (or `/p/<profile>/v1/...`) whose profile
perturbs nothing (`off`, `shadow`, or no steps), on a server with no observer of every request (a recording, the
replay's): live scoring's case observer does not count, it reads only requests tied to a case. Such a request
needs none of the framework's routing, parameter parsing or response classes: `LeanPath` reads the body itself,
hands it to the same `ChatHandler.handle` the framework's route calls (the same decoding, errors, forwarding,
stream relay, metrics and log line) and writes the answer itself. `tests/server/test_lean_path.py` holds it to
the framework's statuses, headers, bodies, upstream requests, metrics and log lines, and
`tests/server/test_fast_path_adapter.py` to the framework's bytes on the socket.

**Two seams, one each, both on `LeanPath`:**

- *into the framework*, `LeanPath.install(app, ...)` (called by `create_app`): the one place that replaces
  Litestar's `app.asgi_handler`, the ASGI callable `Litestar.__call__` awaits for every request once it has set
  `scope["app"]`. The framework's own handler is kept behind `split_joined_app` (several upstream Set-Cookie
  headers go out as several) and gets every request the lean path does not take, unchanged. With `[server]
  lean_path = false` only that wrapper is installed.
- *into uvicorn*, `LeanPath.protocol()` (`toolquake serve`, `[server] lean_protocol = true`, the default): a
  subclass of uvicorn's httptools protocol whose `_start_asgi_task(cycle, app)` -- the method uvicorn calls when a
  request's head is complete, or when a pipelined request's turn comes -- runs `LeanPath.serve` on the request
  cycle instead of the ASGI app for the requests the lean path takes, before any ASGI hop. Connection limits
  (proxy/server/limits.py) subclass this protocol in turn.

**How it falls back.** A request the lean path does not take (another route or method, a perturbing or unknown
profile, an observer of every request attached, a path with an escape or one `paths.unsafe` refuses) goes to the
framework, whose guard answers an unsafe path 400 `invalid_path` (proxy/server/paths.py). Inside the protocol: a
body still arriving is read through uvicorn's `receive` (100-continue, flow control); an answer uvicorn must write
itself (the client gone, the transport paused, a header it would refuse) and every stream go through uvicorn's
`send`; an exception becomes uvicorn's 500, or a closed connection once answering began (`run_asgi`). Where the
installed uvicorn lacks what the protocol seam uses (`protocol()` returns None), the lean path runs as ASGI
instead, answering the same; the start-up line `{"event": "lean_path", "served_in": "protocol" | "asgi" | "off"}`
says which.

**Why uvicorn internals.** Serving in the protocol skips the ASGI hop through the framework's handler, takes a
body that already arrived whole as it is, and writes a whole answer's head and body in one socket write
(uvicorn's `send` writes them apart): 1.07-1.13x requests/s and 0.89-0.92x CPU per request on the unperturbed
path against the same lean path as ASGI (docs/benchmarks.md). uvicorn offers no public hook there.

**Exactly which internals** (`uvicorn.protocols.http.httptools_impl`), listed in `PROTOCOL_INTERNALS` and
`CYCLE_INTERNALS` and checked by `tests/server/test_fast_path_adapter.py`:

- `HttpToolsProtocol._start_asgi_task(cycle, app)`, overridden (everything not taken goes to `super()`); the
  protocol's `app` (the loaded app, compared by identity so uvicorn's and the limits' refusal apps pass),
  `loop` and `tasks` (the server's task set, which graceful shutdown waits on);
- `RequestResponseCycle`: `run_asgi(app)` (uvicorn's exception wrapper), `scope`, and for the body taken
  whole and the one write: `body`, `more_body`, `waiting_for_100_continue`, `disconnected`, `response_started`,
  `response_complete`, `keep_alive`, `flow.write_paused`, `default_headers`, `transport`, `message_event`,
  `on_response` -- kept in the state uvicorn's own `send` leaves them in.
"""

from __future__ import annotations

import asyncio
import http
import inspect
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog
from litestar.response import Stream

from toolquake.proxy.server.chat import Plain
from toolquake.proxy.server.errors import error_body
from toolquake.proxy.server.limits import rejection_counter
from toolquake.proxy.server.paths import guarded, unsafe
from toolquake.proxy.server.upstream.base import split_joined, split_joined_app

if TYPE_CHECKING:
    from litestar import Litestar

    from toolquake.proxy.server.chat import ChatHandler
    from toolquake.proxy.server.state import ProxyState

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
log = structlog.get_logger("toolquake.proxy")
_PROFILE_HEADER = b"x-toolquake-profile"
#: what the protocol seam calls or reads on uvicorn's httptools protocol (`HttpToolsProtocol`)
PROTOCOL_INTERNALS = ("_start_asgi_task", "app", "loop", "tasks")
#: what it reads or sets on uvicorn's request cycle (`RequestResponseCycle`): its constructor's parameters the
#: attributes come from, then the attributes it sets up itself, then its method
CYCLE_PARAMETERS = frozenset({"scope", "transport", "flow", "message_event", "keep_alive", "on_response",
                              "default_headers", "expect_100_continue"})
CYCLE_INTERNALS = ("scope", "transport", "flow", "message_event", "keep_alive", "on_response", "default_headers",
                   "waiting_for_100_continue", "disconnected", "body", "more_body", "response_started",
                   "response_complete", "run_asgi")


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class LeanPath:
    """The fast-path adapter: an ASGI app serving the model routes it can take and handing everything else to
    `next_app` (the framework), installed by `install`; `protocol()` serves the same inside uvicorn."""

    def __init__(self, st: ProxyState, handlers: dict[str, ChatHandler], next_app: ASGIApp) -> None:
        self.st = st
        #: path suffix after the optional /p/<profile> → handler
        self.handlers = handlers
        self.next_app = next_app
        self.max_body = st.config.server.max_body_bytes

    # -- the seam into the framework ------------------------------------------------------------------------
    @classmethod
    def install(cls, app: Litestar, st: ProxyState, handlers: dict[str, ChatHandler], *,
                enabled: bool) -> LeanPath | None:
        """Put the lean path (when `enabled`) in front of `app`'s framework handler, which is kept behind
        `split_joined_app` and the refusal of unsafe paths (`paths.guarded`: 400 `invalid_path`); the only place
        `app.asgi_handler` is replaced. The adapter, or None."""
        framework = guarded(split_joined_app(app.asgi_handler), rejection_counter(app))
        lean = cls(st, handlers, framework) if enabled else None
        app.asgi_handler = lean or framework
        return lean

    @staticmethod
    def of(app: Any) -> LeanPath | None:
        """The adapter installed in front of `app`, if it still is the app's handler (None once anything else
        wrapped it: then the protocol seam must not bypass that wrapper)."""
        handler = getattr(app, "asgi_handler", None)
        return handler if isinstance(handler, LeanPath) else None

    # -- the seam into uvicorn ------------------------------------------------------------------------------
    def protocol(self) -> type | None:
        """uvicorn's httptools protocol, with the requests this adapter takes served when uvicorn starts their
        task (no ASGI hop through the framework, the body taken as it arrived, a plain answer in one write);
        None where this uvicorn is not the one this was written for (then the lean path runs as ASGI)."""
        base = _uvicorn_protocol()
        if base is None:
            return None
        lean = self

        class LeanProtocol(base):  # type: ignore[misc,valid-type]
            def _start_asgi_task(self, cycle: Any, app: Any) -> None:
                routed = lean._route(cycle.scope) if app is self.app else None
                if routed is None:
                    super()._start_asgi_task(cycle, app)
                    return

                async def serve(scope: dict, receive: Any, send: Any) -> None:
                    await lean.serve(routed, scope, receive, send, cycle)

                # uvicorn's own wrapper: an exception becomes a 500 (or a closed connection once answering began)
                task = self.loop.create_task(cycle.run_asgi(serve))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)

        return LeanProtocol

    # -- routing and serving, shared by both seams -----------------------------------------------------------

    def _route(self, scope: dict) -> tuple[ChatHandler, str | None] | None:
        """The handler and the profile named in the path, when the lean path may serve this request."""
        if scope["type"] != "http" or scope["method"] != "POST" or self.st.observers:  # case observers: taken
            return None
        path: str = scope["path"]
        named = None
        if path.startswith("/p/"):
            named, _, rest = path[3:].partition("/")
            path = "/" + rest
            if not named:
                return None
        handler = self.handlers.get(path)
        raw = scope.get("raw_path")
        if handler is None or raw is None or b"%" in raw or unsafe(raw, scope["path"]):
            return None  # an escape, a dot segment (a profile named ".."): the framework's guard judges it
        name = named
        if name is None:
            for k, v in scope["headers"]:
                if k == _PROFILE_HEADER:
                    name = v.decode("latin-1")
                    break
        profile = self.st.profiles.get(name or self.st.config.server.default_profile)
        if profile is None or profile.perturbs:
            return None  # unknown profiles (404) and perturbing ones (remedies too): the framework's route
        return handler, named

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        routed = self._route(scope)
        if routed is None:
            await self.next_app(scope, receive, send)
            return
        await self.serve(routed, scope, receive, send)

    async def serve(self, routed: tuple[ChatHandler, str | None], scope: dict, receive: Callable[[], Awaitable[dict]],
                    send: Callable[[dict], Awaitable[None]], cycle: Any = None) -> None:
        """Serve a routed request with ASGI `receive`/`send`; with uvicorn's request `cycle` (the protocol
        seam), a body that already arrived whole is taken as it is and a plain answer goes out in one write."""
        handler, named = routed
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]

        async def read_body() -> bytes:
            if cycle is not None and not cycle.more_body and not cycle.waiting_for_100_continue \
                    and not cycle.disconnected:
                if len(cycle.body) > self.max_body:
                    raise _TooLarge
                body = bytes(cycle.body)
                cycle.body = b""
                return body
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > self.max_body:
                        raise _TooLarge
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)

        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            response = await handler.handle(headers, read_body, named)
            if isinstance(response, Stream):
                await _send_stream(response, tracked_send, receive)
            elif cycle is not None and _write_plain(response, cycle):
                started = True
                if response.background is not None:
                    await response.background()
            else:
                await _send_plain(response, tracked_send)
        except _Disconnected:
            return
        except _TooLarge:
            message = f"Request body is larger than {self.max_body} bytes; raise [server] max_body_bytes if needed."
            await _send_plain(Plain(error_body(message, "invalid_request_error", "request_too_large"), 413), send)
        except Exception as exc:  # the framework's last-resort handler, as on every other route
            log.error("internal_error", error_type=type(exc).__name__, error=str(exc)[:300])
            if started:
                raise
            await _send_plain(Plain(error_body("Internal proxy error; see the proxy log.", "server_error",
                                               "internal_error"), 500), send)


def _head(response: Plain | Stream, length: int | None) -> dict[str, Any]:
    headers = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in response.headers.items()]
    if not any(k == b"content-type" for k, _ in headers) and response.media_type:
        media = str(response.media_type)
        if media.startswith("text/") and "charset" not in media:
            media += "; charset=utf-8"
        headers.append((b"content-type", media.encode("latin-1")))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": response.status_code, "headers": split_joined(headers)}


_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_status_lines: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _status_lines.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _status_lines[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


def _write_plain(response: Plain, cycle: Any) -> bool:
    """Write a whole answer to uvicorn's request `cycle` in one write (head and body), keeping the cycle's
    state as its own `send` would; False (nothing written) where that `send` must do it: the client is
    gone, the transport asks to wait, or a header it would refuse."""
    if cycle.disconnected or cycle.response_started or cycle.flow.write_paused:
        return False
    body = response.content
    head = _head(response, len(body))["headers"]
    every = (*cycle.default_headers, *head)
    # the checks uvicorn's send makes per header, made once over all names and all values (both patterns are
    # single characters, so no match can span two of them)
    if _BAD_NAME.search(b"".join(n for n, _ in every)) or _BAD_VALUE.search(b"".join(v for _, v in every)):
        return False
    parts = [_status_line(response.status_code)]
    says_close = False
    for name, value in every:
        if name == b"connection" and b"close" in [t.strip().lower() for t in value.split(b",")]:
            says_close = True
        parts += (name, b": ", value, b"\r\n")
    close = says_close or not cycle.keep_alive
    if close and not says_close:
        parts.append(b"connection: close\r\n")
    parts += (b"\r\n", body)
    cycle.response_started = cycle.response_complete = True
    cycle.waiting_for_100_continue = False
    cycle.keep_alive = not close
    cycle.transport.write(b"".join(parts))
    cycle.message_event.set()
    if close:
        cycle.transport.close()
    cycle.on_response()
    return True


def _uvicorn_protocol() -> type | None:
    """uvicorn's httptools protocol, if it has what the protocol seam uses (`PROTOCOL_INTERNALS`' method, the
    request cycle's constructor taking `CYCLE_PARAMETERS`), else None."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError:  # pragma: no cover - uvicorn[standard] is a dependency
        return None
    if not callable(getattr(HttpToolsProtocol, "_start_asgi_task", None)) \
            or not CYCLE_PARAMETERS <= set(inspect.signature(RequestResponseCycle.__init__).parameters):
        return None
    return HttpToolsProtocol


def lean_protocol(app: Any) -> type | None:
    """The protocol seam of the adapter installed in front of `app` (`LeanPath.protocol`); None where `app`
    has no lean path or this uvicorn lacks what the seam uses."""
    lean = LeanPath.of(app)
    return lean.protocol() if lean is not None else None


async def _send_plain(response: Plain, send: Callable[[dict], Awaitable[None]]) -> None:
    body = response.content
    await send(_head(response, len(body)))
    await send({"type": "http.response.body", "body": body, "more_body": False})
    if response.background is not None:
        await response.background()


async def _send_stream(response: Stream, send: Callable[[dict], Awaitable[None]],
                       receive: Callable[[], Awaitable[dict]]) -> None:
    """Relay the stream; stop (and let its generator release the upstream) when the client goes away."""

    async def relay() -> None:
        await send(_head(response, None))
        async for chunk in response.iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    sender = asyncio.ensure_future(relay())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(sender, watcher, return_exceptions=True)
        if response.background is not None:
            await response.background()
    if sender.done() and not sender.cancelled() and sender.exception() is not None:
        raise sender.exception()
