"""The upstream client: one interface (`base.py`), one implementation per HTTP client."""

from __future__ import annotations

import importlib

from toolquake.proxy.server.upstream.base import (
    INTERNAL_PREFIX,
    AnswerTooLarge,
    Upstream,
    UpstreamError,
    UpstreamResponse,
    request_headers,
    response_headers,
)

__all__ = ["CLIENTS", "INTERNAL_PREFIX", "AnswerTooLarge", "Upstream", "UpstreamError", "UpstreamResponse",
           "make_upstream", "request_headers", "response_headers"]

#: `[server] upstream_client` → the module and class that implement it (imported only when chosen)
CLIENTS: dict[str, tuple[str, str]] = {
    "aiohttp": ("toolquake.proxy.server.upstream.aiohttp_client", "AiohttpUpstream"),
    "httpx": ("toolquake.proxy.server.upstream.httpx_client", "HttpxUpstream"),
    "native": ("toolquake.proxy.server.upstream.native_client", "NativeUpstream"),
}


def make_upstream(base: str, *, client: str = "native", connect_timeout: float, read_timeout: float,
                  max_connections: int) -> Upstream:
    if client not in CLIENTS:
        raise ValueError(f"upstream_client must be one of {', '.join(CLIENTS)}")
    module, name = CLIENTS[client]
    cls = getattr(importlib.import_module(module), name)
    return cls(base, connect_timeout=connect_timeout, read_timeout=read_timeout, max_connections=max_connections)
