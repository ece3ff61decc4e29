"""The lean path: model requests that nothing perturbs or observes, served ahead of the framework.

A `POST /v1/chat/completions` or `/v1/responses` (or `/p/<profile>/v1/...`) whose profile perturbs
nothing (`off`, `shadow`, or no steps), on a server with no observers (live scoring off), does not need
the framework's routing, parameter parsing or response classes. `LeanPath` sits in front of the app:
it reads the body itself and hands it to the same `ChatHandler.handle` the framework route calls (the
same decoding, errors, forwarding, stream relay, metrics and log line), then writes the answer with
raw ASGI messages. Everything else goes to the framework unchanged.

`lean_protocol` goes one step further (`[server] lean_protocol = true`, the default): uvicorn's httptools
protocol, subclassed, hands the lean path its requests when it starts their task, before any ASGI app;
the body is taken as it arrived and a whole answer is written head and body in one write.
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
from toolquake.proxy.server.upstream.base import split_joined

if TYPE_CHECKING:
    from toolquake.proxy.server.chat import ChatHandler
    from toolquake.proxy.server.state import ProxyState

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
log = structlog.get_logger("toolquake.proxy")
_PROFILE_HEADER = b"x-toolquake-profile"


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class LeanPath:
    """ASGI app: the lean path for the model routes it can serve, `next_app` for everything else."""

    def __init__(self, st: ProxyState, handlers: dict[str, ChatHandler], next_app: ASGIApp) -> None:
        self.st = st
        #: path suffix after the optional /p/<profile> → handler
        self.handlers = handlers
        self.next_app = next_app
        self.max_body = st.config.server.max_body_bytes

    def _route(self, scope: dict) -> tuple[ChatHandler, str | None] | None:
        """The handler and the profile named in the path, when the lean path may serve this request."""
        if scope["type"] != "http" or scope["method"] != "POST" or self.st.observers:
            return None
        path: str = scope["path"]
        named = None
        if path.startswith("/p/"):
            named, _, rest = path[3:].partition("/")
            path = "/" + rest
            if not named:
                return None
        handler = self.handlers.get(path)
        if handler is None:
            return None
        name = named
        if name is None:
            for k, v in scope["headers"]:
                if k == _PROFILE_HEADER:
                    name = v.decode("latin-1")
                    break
        profile = self.st.profiles.get(name or self.st.config.server.default_profile)
        if profile is None or (profile.mode == "perturb" and profile.steps):
            return None  # unknown profiles (404) and perturbing ones: the framework's route
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
        """Serve a routed request with ASGI `receive`/`send`; with uvicorn's request `cycle` (the lean
        protocol below), a body that already arrived whole is taken as it is and a plain answer goes out
        in one write."""
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


def lean_protocol(app: Any) -> type | None:
    """uvicorn's httptools protocol, with the requests the lean path serves taken before the ASGI app (no
    ASGI scope handed through the framework, the body taken as it arrived, a plain answer in one write);
    None where `app` has no lean path or this uvicorn's request cycle is not the one this was written for
    (then the lean path runs as ASGI, unchanged in what it answers)."""
    lean = getattr(app, "asgi_handler", None)
    if not isinstance(lean, LeanPath):
        return None
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError:  # pragma: no cover - uvicorn[standard] is a dependency
        return None
    expected = {"scope", "transport", "flow", "message_event", "keep_alive", "on_response", "default_headers",
                "expect_100_continue"}
    if not callable(getattr(HttpToolsProtocol, "_start_asgi_task", None)) \
            or not expected <= set(inspect.signature(RequestResponseCycle.__init__).parameters):
        return None

    class LeanProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
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
