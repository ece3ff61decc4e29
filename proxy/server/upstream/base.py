"""The upstream interface: URLs fixed by configuration, header hygiene, errors, the answer type.

One implementation per HTTP client (`aiohttp_client.py`, `httpx_client.py`), chosen by
`[server] upstream_client` through `make_upstream` (this package's `__init__`). Every implementation
raises `UpstreamError` with a `kind` (`timeout` or `unreachable`), never its client's own exceptions.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

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
#: characters a query string keeps as they are (RFC 3986 query, and "%" of escapes already there); the others are
#: escaped where a client would send them raw
QUERY_SAFE = "/:@!$&'()*+,;=-._~%?"


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time (`kind`: timeout | unreachable)."""

    def __init__(self, kind: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = kind
        self.cause_name = type(cause).__name__


class AnswerTooLarge(Exception):
    """An answer read whole (`UpstreamResponse.aread(limit)`) ran past `limit` bytes: `head` is what was read of it
    (at most `limit` plus one chunk); the rest is still to come from `aiter_raw()`, or the response is closed."""

    def __init__(self, head: bytes) -> None:
        super().__init__(f"the upstream's answer is larger than the limit ({len(head)} bytes read)")
        self.head = head


def classify(exc: BaseException, timeouts: tuple[type[BaseException], ...],
             unreachable: tuple[type[BaseException], ...]) -> BaseException:
    """A client's exception as the `UpstreamError` it means; cancellation and programming errors unchanged."""
    if isinstance(exc, timeouts):
        return UpstreamError("timeout", exc)
    if isinstance(exc, unreachable):
        return UpstreamError("unreachable", exc)
    return exc


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
    """Upstream response headers for the client: hop-by-hop, length, date and server removed. Repeated
    headers are joined with ", " (RFC 9110 §5.3), except Set-Cookie, whose values may hold commas (Expires
    dates): those are joined with a newline, which no header value can hold, and written as separate headers
    again where the answer goes out (`split_joined`)."""
    out: dict[str, str] = {}
    for key, value in headers:
        lk = key.lower()
        if lk in _RESPONSE_DROP:
            continue
        out[lk] = value if lk not in out else out[lk] + (KEEP_APART if lk == "set-cookie" else ", ") + value
    return out


#: joins the values of a header that must go out as several headers (see response_headers)
KEEP_APART = "\n"


def split_joined(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """ASGI response headers with each value joined by `KEEP_APART` written as one header per value."""
    if not any(b"\n" in v for _, v in headers):
        return headers
    out = []
    for name, value in headers:
        if b"\n" in value:
            out.extend((name, part) for part in value.split(b"\n"))
        else:
            out.append((name, value))
    return out


def split_joined_app(app: Any) -> Any:
    """An ASGI app whose answers' heads go through `split_joined` (the framework's routes; the lean path
    splits its own)."""

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def split_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = split_joined(list(message.get("headers") or ()))
            await send(message)

        await app(scope, receive, split_send)

    return wrapped


class UpstreamResponse:
    """An upstream answer whose body has not been read yet. Always `aclose()` it."""

    status_code: int
    headers: list[tuple[str, str]]

    def header(self, name: str, default: str = "") -> str:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return default

    async def aread(self, limit: int | None = None) -> bytes:  # pragma: no cover - interface
        """The whole body; past `limit` bytes (when given) `AnswerTooLarge`, with what was read, and the rest unread."""
        raise NotImplementedError

    def aiter_raw(self) -> AsyncIterator[bytes]:  # pragma: no cover - interface
        raise NotImplementedError

    async def aclose(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Upstream:
    """The backend. `base` ends in `/v1` (or whatever prefix the backend serves the API under).

    Subclasses implement `send`, `pool_states` and `aclose` with one HTTP client each.
    """

    kind = ""

    def __init__(self, base: str, *, connect_timeout: float, read_timeout: float, max_connections: int) -> None:
        self.base = base.rstrip("/")
        # the backend's own extras (/tokenize, /extras/...) live at its root
        self.root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        self.connect_timeout, self.read_timeout, self.max_connections = connect_timeout, read_timeout, max_connections

    def api_url(self, path: str) -> str:
        """`path` is what follows `/v1/` in the client's URL, percent-encoded (`paths.encoded`); the URL is sent
        as it is (no client may resolve dot segments or decode escapes in it)."""
        return f"{self.base}/{path.lstrip('/')}"

    def root_url(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}"

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "", timeout: float | None = None) -> UpstreamResponse:  # pragma: no cover
        """Send and return the answer with its body not yet read (the caller must `aclose()` it)."""
        raise NotImplementedError

    async def probe(self, path: str, timeout: float = 2.0) -> int:
        """Status of GET {base}/{path}; UpstreamError when the backend cannot be reached."""
        resp = await self.send("GET", self.api_url(path), [], None, timeout=timeout)
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        return resp.status_code

    def pool_states(self) -> dict[str, int]:  # pragma: no cover - interface
        """Connections in the pool: `active` (a request in flight) and `idle` (kept alive)."""
        raise NotImplementedError

    async def aclose(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError
