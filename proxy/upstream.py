"""The upstream client: one pooled client, URLs fixed by configuration, header hygiene.

Two implementations behind one small interface, chosen by `[server] upstream_client`:
`aiohttp` (the default: its C HTTP parser and connection pool cost a fraction of httpx's per request,
and httpx's pool degrades under concurrency) and `httpx`. Both raise `UpstreamError` with a `kind`
(`timeout` or `unreachable`), never their own exception types.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

# RFC 9110 §7.6.1 hop-by-hop headers, plus those the HTTP client sets for itself
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
# set by our own server on every response; the upstream's copies would be duplicates
_RESPONSE_DROP = HOP_BY_HOP | {"date", "server"}
# never sent upstream: our evaluation metadata, and encodings we would have to undo to score
_REQUEST_DROP = HOP_BY_HOP | {"accept-encoding"}
INTERNAL_PREFIX = "x-toolquake-"
CLIENTS = ("aiohttp", "httpx")


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time (`kind`: timeout | unreachable)."""

    def __init__(self, kind: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = kind
        self.cause_name = type(cause).__name__


def request_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """End-to-end client headers for the upstream: hop-by-hop and every X-Toolquake-* dropped."""
    named_by_connection = set()
    for key, value in headers:
        if key.lower() == "connection":
            named_by_connection.update(v.strip().lower() for v in value.split(","))
    out = []
    for key, value in headers:
        lk = key.lower()
        if lk in _REQUEST_DROP or lk in named_by_connection or lk.startswith(INTERNAL_PREFIX):
            continue
        out.append((key, value))
    return out


def response_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """Upstream response headers for the client: hop-by-hop, length, date and server removed."""
    out: dict[str, str] = {}
    for key, value in headers:
        lk = key.lower()
        if lk in _RESPONSE_DROP:
            continue
        out[lk] = value if lk not in out else out[lk] + ", " + value
    return out


class UpstreamResponse:
    """An upstream answer whose body has not been read yet. Always `aclose()` it."""

    status_code: int
    headers: list[tuple[str, str]]

    def header(self, name: str, default: str = "") -> str:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return default

    async def aread(self) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def aiter_raw(self) -> AsyncIterator[bytes]:  # pragma: no cover - interface
        raise NotImplementedError

    async def aclose(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _AiohttpResponse(UpstreamResponse):
    def __init__(self, resp) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]
        self._done = False

    async def aread(self) -> bytes:
        try:
            data = await self._resp.read()
        except BaseException as exc:
            raise _aiohttp_error(exc) from exc
        self._done = True
        return data

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except BaseException as exc:
            raise _aiohttp_error(exc) from exc
        self._done = True

    async def aclose(self) -> None:
        # a fully read answer gives its connection back to the pool; anything else closes it
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


def _aiohttp_error(exc: BaseException) -> BaseException:
    import aiohttp

    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamError("timeout", exc)
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return UpstreamError("unreachable", exc)
    return exc  # cancellation and programming errors pass through unchanged


class _HttpxResponse(UpstreamResponse):
    def __init__(self, resp) -> None:
        self._resp = resp
        self.status_code = resp.status_code
        self.headers = list(resp.headers.multi_items())

    async def aread(self) -> bytes:
        try:
            return await self._resp.aread()
        except BaseException as exc:
            raise _httpx_error(exc) from exc

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except BaseException as exc:
            raise _httpx_error(exc) from exc

    async def aclose(self) -> None:
        await self._resp.aclose()


def _httpx_error(exc: BaseException) -> BaseException:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("timeout", exc)
    if isinstance(exc, httpx.TransportError):
        return UpstreamError("unreachable", exc)
    return exc


class Upstream:
    """The backend. `base` ends in `/v1` (or whatever prefix the backend serves the API under)."""

    def __init__(self, base: str, *, connect_timeout: float, read_timeout: float, max_connections: int,
                 client: str = "aiohttp") -> None:
        if client not in CLIENTS:
            raise ValueError(f"upstream_client must be one of {', '.join(CLIENTS)}")
        self.base = base.rstrip("/")
        # the backend's own extras (/tokenize, /extras/...) live at its root
        self.root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        self.kind = client
        self.connect_timeout, self.read_timeout, self.max_connections = connect_timeout, read_timeout, max_connections
        self._session = None  # created on first use, inside the running event loop
        self._httpx = None

    def api_url(self, path: str) -> str:
        """`path` is what follows `/v1/` in the client's URL."""
        return f"{self.base}/{path.lstrip('/')}"

    def root_url(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}"

    def _aiohttp_session(self):
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=30.0,
                                             use_dns_cache=True, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout,
                                              sock_read=self.read_timeout),
                # send what the client sent: no User-Agent, Accept, Accept-Encoding or Content-Type of our own
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    def _httpx_client(self):
        if self._httpx is None:
            import httpx

            self._httpx = httpx.AsyncClient(
                timeout=httpx.Timeout(self.read_timeout, connect=self.connect_timeout, pool=self.read_timeout),
                limits=httpx.Limits(max_connections=self.max_connections,
                                    max_keepalive_connections=self.max_connections, keepalive_expiry=30.0),
                follow_redirects=False, trust_env=False)
        return self._httpx

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "", timeout: float | None = None) -> UpstreamResponse:
        """Send and return the answer with its body not yet read (the caller must `aclose()` it)."""
        if params:
            url = f"{url}?{params}"
        if self.kind == "httpx":
            client = self._httpx_client()
            try:
                request = client.build_request(method, url, headers=headers, content=content,
                                               timeout=timeout if timeout is not None else client.timeout)
                return _HttpxResponse(await client.send(request, stream=True))
            except BaseException as exc:
                raise _httpx_error(exc) from exc
        session = self._aiohttp_session()
        kwargs = {}
        if timeout is not None:
            import aiohttp

            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        try:
            resp = await session.request(method, url, headers=headers, data=content, allow_redirects=False,
                                         compress=False, **kwargs)
        except BaseException as exc:
            raise _aiohttp_error(exc) from exc
        return _AiohttpResponse(resp)

    async def probe(self, path: str, timeout: float = 2.0) -> int:
        """Status of GET {base}/{path}; UpstreamError when the backend cannot be reached."""
        resp = await self.send("GET", self.api_url(path), [], None, timeout=timeout)
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        return resp.status_code

    def pool_states(self) -> dict[str, int]:
        """Connections in the pool: `active` (a request in flight) and `idle` (kept alive)."""
        states = {"active": 0, "idle": 0}
        if self._session is not None:
            connector = self._session.connector
            states["active"] = sum(len(v) for v in getattr(connector, "_acquired_per_host", {}).values())
            states["idle"] = sum(len(v) for v in getattr(connector, "_conns", {}).values())
        if self._httpx is not None:
            pool = getattr(getattr(self._httpx, "_transport", None), "_pool", None)
            for conn in getattr(pool, "connections", ()) or ():
                states["idle" if conn.is_idle() else "active"] += 1
        return states

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._httpx is not None:
            await self._httpx.aclose()
