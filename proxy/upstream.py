"""The upstream client: one pooled httpx client, URLs fixed by configuration, header hygiene."""

from __future__ import annotations

import httpx

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


def response_headers(headers: httpx.Headers, *, drop_length: bool = True) -> dict[str, str]:
    """Upstream response headers for the client, hop-by-hop removed."""
    out: dict[str, str] = {}
    for key, value in headers.multi_items():
        lk = key.lower()
        if lk in _RESPONSE_DROP or (drop_length and lk == "content-length"):
            continue
        out[key] = value if lk not in out else out[lk] + ", " + value
    return out


class Upstream:
    """The backend. `base` ends in `/v1` (or whatever prefix the backend serves the API under)."""

    def __init__(self, base: str, *, connect_timeout: float, read_timeout: float,
                 max_connections: int) -> None:
        self.base = base.rstrip("/")
        # the backend's own extras (/tokenize, /extras/...) live at its root
        self.root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=read_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=30.0),
            follow_redirects=False,
            trust_env=False,
        )

    def api_url(self, path: str) -> str:
        """`path` is what follows `/v1/` in the client's URL."""
        return f"{self.base}/{path.lstrip('/')}"

    def root_url(self, path: str) -> str:
        return f"{self.root}/{path.lstrip('/')}"

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "") -> httpx.Response:
        """Send and return the response with its body not yet read (the caller closes it)."""
        if params:
            url = f"{url}?{params}"
        request = self.client.build_request(method, url, headers=headers, content=content)
        return await self.client.send(request, stream=True)

    def pool_states(self) -> dict[str, int]:
        """Connections in the pool: `active` (a request in flight) and `idle` (kept alive)."""
        pool = getattr(getattr(self.client, "_transport", None), "_pool", None)
        states = {"active": 0, "idle": 0}
        for conn in getattr(pool, "connections", ()) or ():
            states["idle" if conn.is_idle() else "active"] += 1
        return states

    async def aclose(self) -> None:
        await self.client.aclose()
