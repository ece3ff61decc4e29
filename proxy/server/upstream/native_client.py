"""The native upstream (`[server] upstream_client = "native"`): a minimal HTTP/1.1 client on asyncio's
Protocol and httptools' C response parser, with its own keep-alive pool.

It does one thing per request: write the request head and body in one `write`, feed what the socket
delivers to the parser, and hand the body on as it arrives (Content-Length, chunked, or until the
connection closes; SSE is not parsed). Timeouts are a timer per wait (`connect_timeout` to connect,
`read_timeout` for the head and between body reads), like aiohttp's `sock_connect` / `sock_read`.
What it does not handle goes to the aiohttp client unchanged: `https://` upstreams (no TLS here) and
`HEAD` requests (an answer with no body whatever its headers say). A request that fails on a reused
keep-alive connection before one byte of the answer arrived (the backend closed the idle connection
as we wrote) is sent once more on a new connection; any later failure is the caller's
`UpstreamError`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, AsyncIterator
from urllib.parse import quote, urlsplit

import httptools

from toolquake.proxy.server.upstream.aiohttp_client import AiohttpUpstream
from toolquake.proxy.server.upstream.base import QUERY_SAFE, AnswerTooLarge, Upstream, UpstreamResponse, classify

#: body bytes buffered from the socket before it stops reading (a slow client of a fast stream)
_HIGH_WATER = 256 * 1024
KEEPALIVE_S = 30.0
#: characters a request target keeps as they are (RFC 3986 pchar / query, and "%" of escapes already there)
_PATH_SAFE = "/:@!$&'()*+,;=-._~%"


class UpstreamTimeout(Exception):
    """The backend did not answer (or send the next bytes) within the configured timeout."""


class UpstreamClosed(Exception):
    """The backend closed the connection before its answer was complete."""


class UpstreamProtocolError(Exception):
    """The backend's bytes are not an HTTP/1.1 answer."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        # one parser for the connection's answers: it starts over after each complete one (a connection
        # whose answer failed or was cut is never reused)
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[str, str]] = []
        self.status = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("the backend switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(str(exc)))
            return
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if self.head_done and self._reads_to_close():
                self.complete = True  # no length, not chunked: the body ends with the connection
            else:
                self.error = UpstreamClosed(str(exc) if exc else "connection closed before the answer was complete")
        self._wake()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an interim answer (100 Continue): wait for the real one
            self.headers = []
            return
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.status >= 200:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()  # asked now: the parser resets after this

    # -- helpers
    def _reads_to_close(self) -> bool:
        for k, v in self.headers:
            lk = k.lower()
            if lk == "content-length" or (lk == "transfer-encoding" and "chunked" in v.lower()):
                return False
        return True

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until new bytes arrive, the connection closes, or `timeout` passes (UpstreamTimeout)."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("no answer within the read timeout"))


class _NativeResponse(UpstreamResponse):
    def __init__(self, owner: NativeUpstream, key: tuple[str, int], conn: _Conn) -> None:
        self._owner, self._key, self._conn = owner, key, conn
        self.status_code = conn.status
        self.headers = conn.headers
        self._released = False

    async def aread(self, limit: int | None = None) -> bytes:
        conn, parts, size = self._conn, [], 0
        try:
            while True:
                if conn.chunks:
                    size += conn.buffered
                    parts.append(conn.take())
                    if limit is not None and size > limit:
                        break
                if conn.complete:
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._owner.read_timeout)
        except BaseException as exc:
            raise _error(exc) from exc
        raise AnswerTooLarge(b"".join(parts))

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                    continue
                if conn.complete:
                    return
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._owner.read_timeout)
        except BaseException as exc:
            raise _error(exc) from exc

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        self._owner._release(self._key, self._conn)


def _error(exc: BaseException) -> BaseException:
    return classify(exc, (UpstreamTimeout,), (UpstreamClosed, UpstreamProtocolError, OSError))


class _Slots:
    """At most `n` requests at once; the rest wait in arrival order (asyncio.Semaphore's contract without its
    per-acquire scan of the waiters)."""

    __slots__ = ("free", "waiters")

    def __init__(self, n: int) -> None:
        self.free = n
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut  # release() handed its slot to this waiter
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            elif fut in self.waiters:
                self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class NativeUpstream(Upstream):
    kind = "native"

    def __init__(self, base: str, **limits: Any) -> None:
        super().__init__(base, **limits)
        self._fallback = AiohttpUpstream(base, **limits)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        #: connections with a request on them
        self._busy: set[_Conn] = set()
        self._slots = _Slots(self.max_connections)
        self._heads: dict[tuple[str, str], tuple[tuple[str, int], bytes]] = {}

    def _target(self, method: str, url: str) -> tuple[tuple[str, int], bytes] | None:
        """(host, port) and the start of the request head for `url`; None when the fallback must send it."""
        key = (method, url)
        found = self._heads.get(key)
        if found is not None:
            return found
        parts = urlsplit(url)
        if parts.scheme != "http" or method == "HEAD" or not parts.hostname:
            return None
        port = parts.port or 80
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        if ":" in parts.hostname:  # IPv6 literal
            host = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
        # percent-encoded as aiohttp (yarl) sends it: non-ASCII, spaces and control characters escaped,
        # escapes already there kept
        path = quote(parts.path or "/", safe=_PATH_SAFE)
        target = path + (f"?{quote(parts.query, safe=QUERY_SAFE)}" if parts.query else "")
        head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
        found = ((parts.hostname, port), head)
        if len(self._heads) < 256:  # the proxy sends to a handful of fixed URLs
            self._heads[key] = found
        return found

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "", timeout: float | None = None) -> UpstreamResponse:
        target = self._target(method, f"{url}?{params}" if params else url)
        if target is None:
            return await self._fallback.send(method, url, headers, content, params, timeout=timeout)
        key, start = target
        lines = [start]
        for k, v in headers:
            lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        if content is not None:
            lines.append(b"Content-Length: %d\r\n\r\n" % len(content))
            lines.append(content)
        else:
            lines.append(b"\r\n")
        request = b"".join(lines)
        read_timeout = self.read_timeout if timeout is None else timeout
        await self._slots.acquire()
        conn: _Conn | None = None
        try:
            conn, reused = await self._connection(key, timeout)
            try:
                await self._exchange(conn, request, read_timeout)
            except UpstreamClosed:
                if not reused or conn.got_bytes:
                    raise
                self._drop(conn)  # the backend closed it while idle: once more on a new connection
                conn, _ = await self._connection(key, timeout, fresh=True)
                await self._exchange(conn, request, read_timeout)
        except BaseException as exc:
            if conn is not None:
                self._drop(conn)
            self._slots.release()
            raise _error(exc) from exc
        return _NativeResponse(self, key, conn)

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._busy.discard(conn)

    async def _exchange(self, conn: _Conn, request: bytes, read_timeout: float) -> None:
        assert conn.transport is not None
        conn.transport.write(request)
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            await conn.wait(read_timeout)

    async def _connection(self, key: tuple[str, int], timeout: float | None,
                          fresh: bool = False) -> tuple[_Conn, bool]:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        now = loop.time()
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_S:
                conn._reset()
                self._busy.add(conn)
                return conn, True
            conn.close()
        conn = _Conn(loop)
        connect = loop.create_connection(lambda: conn, key[0], key[1])
        try:
            await asyncio.wait_for(connect, self.connect_timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout("no connection within the connect timeout") from None
        self._busy.add(conn)
        return conn, False

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        """A fully read answer on a connection both sides keep alive goes back to the pool; else it closes."""
        self._busy.discard(conn)
        self._slots.release()
        if conn.complete and not conn.closed and not conn.chunks and conn.keep_alive:
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()

    def pool_states(self) -> dict[str, int]:
        fallback = self._fallback.pool_states()
        idle = sum(1 for conns in self._idle.values() for c in conns if not c.closed)
        return {"active": len(self._busy) + fallback["active"], "idle": idle + fallback["idle"]}

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await self._fallback.aclose()
