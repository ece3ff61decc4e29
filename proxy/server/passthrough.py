"""Every route but the model routes: method, query, body, status and end-to-end headers relayed untouched, for the
paths `[server] passthrough` lists (proxy/server/paths.py); any other path gets 404 `not_found`, nothing sent."""

from __future__ import annotations

import time
from typing import AsyncIterator

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from toolquake.proxy.server.chat import client_headers, error_response, send_upstream
from toolquake.proxy.server.errors import ProxyError
from toolquake.proxy.server.paths import Passlist, encoded
from toolquake.proxy.server.state import ProxyState
from toolquake.proxy.server.upstream import AnswerTooLarge, UpstreamResponse, request_headers, response_headers


class Passthrough:
    def __init__(self, st: ProxyState) -> None:
        self.st = st
        self.passlist = Passlist(st.config.server.passthrough)

    def url(self, path: str) -> str:
        """The upstream URL of a client path (`/v1/...` under the backend's API base, any other at its root);
        ProxyError 404 when `[server] passthrough` does not list it."""
        if not self.passlist.allows(path):
            raise ProxyError(404, f"The proxy does not relay {path} to the backend; the operator may list it in "
                             "[server] passthrough.", code="not_found")
        if path.startswith("/v1/"):
            return self.st.upstream.api_url(encoded(path[4:]))
        return self.st.upstream.root_url(encoded(path))

    async def __call__(self, request: Request, path: str, route_label: str) -> Response:
        """Relay `request` to the client path `path` (the request's path without /p/<profile>)."""
        m = self.st.metrics
        t0 = time.perf_counter()
        m.in_flight.inc()
        status = 502
        try:
            url = self.url(path)
            body = await request.body()
            upstream = await send_upstream(self.st, request.method, url, request_headers(client_headers(request)),
                                           body or None, request.url.query)
            if "text/event-stream" in upstream.header("content-type"):
                status = upstream.status_code
                return _relayed(upstream, b"")
            try:
                data = await upstream.aread(self.st.config.server.max_answer_bytes)
            except AnswerTooLarge as big:  # past max_answer_bytes: relayed as it comes, never held whole
                status = upstream.status_code
                return _relayed(upstream, big.head)
            except BaseException:
                await upstream.aclose()
                raise
            await upstream.aclose()
            status = upstream.status_code
            return Response(content=data, status_code=status, headers=response_headers(upstream.headers),
                            media_type=upstream.header("content-type") or None)
        except ProxyError as exc:
            status = exc.status
            return error_response(exc)
        finally:
            m.in_flight.dec()
            m.requests.labels("-", route_label, f"{status // 100}xx", "false", "none").inc()
            m.duration.labels("-", route_label, "false").observe(time.perf_counter() - t0)


def _relayed(upstream: UpstreamResponse, head: bytes) -> Stream:
    """The upstream's answer relayed as it comes (`head`: what was read of it already)."""

    async def relay() -> AsyncIterator[bytes]:
        try:
            if head:
                yield head
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    return Stream(relay(), status_code=upstream.status_code, headers=response_headers(upstream.headers),
                  background=BackgroundTask(upstream.aclose))
