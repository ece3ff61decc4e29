"""The httpx upstream (`[server] upstream_client = "httpx"`): kept for comparison; see docs/benchmarks.md."""

from __future__ import annotations

from typing import AsyncIterator

import httpx

from toolquake.proxy.server.upstream.base import AnswerTooLarge, Upstream, UpstreamError, UpstreamResponse


class _HttpxResponse(UpstreamResponse):
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status_code = resp.status_code
        self.headers = list(resp.headers.multi_items())
        #: the body's one iterator (httpx reads a body once): a read past its limit leaves the rest to `aiter_raw`
        self._body: AsyncIterator[bytes] | None = None

    async def aread(self, limit: int | None = None) -> bytes:
        if limit is None:
            try:
                return await self._resp.aread()
            except BaseException as exc:
                raise _error(exc) from exc
        parts, size = [], 0
        if self._body is None:
            self._body = self._resp.aiter_bytes()  # decoded, as httpx's own aread
        try:
            async for chunk in self._body:
                parts.append(chunk)
                size += len(chunk)
                if size > limit:
                    break
        except BaseException as exc:
            raise _error(exc) from exc
        if size > limit:
            raise AnswerTooLarge(b"".join(parts))
        return b"".join(parts)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._body is None:
            self._body = self._resp.aiter_raw()
        try:
            async for chunk in self._body:
                yield chunk
        except BaseException as exc:
            raise _error(exc) from exc

    async def aclose(self) -> None:
        await self._resp.aclose()


def _error(exc: BaseException) -> BaseException:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("timeout", exc)
    if isinstance(exc, httpx.TransportError):
        return UpstreamError("unreachable", exc)
    return exc


class HttpxUpstream(Upstream):
    kind = "httpx"

    def __init__(self, base: str, **limits: float) -> None:
        super().__init__(base, **limits)
        self._httpx: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._httpx is None:
            self._httpx = httpx.AsyncClient(
                timeout=httpx.Timeout(self.read_timeout, connect=self.connect_timeout, pool=self.read_timeout),
                limits=httpx.Limits(max_connections=self.max_connections,
                                    max_keepalive_connections=self.max_connections, keepalive_expiry=30.0),
                follow_redirects=False, trust_env=False)
        return self._httpx

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "", timeout: float | None = None) -> UpstreamResponse:
        if params:
            url = f"{url}?{params}"
        client = self._client()
        try:
            request = client.build_request(method, url, headers=headers, content=content,
                                           timeout=timeout if timeout is not None else client.timeout)
            return _HttpxResponse(await client.send(request, stream=True))
        except BaseException as exc:
            raise _error(exc) from exc

    def pool_states(self) -> dict[str, int]:
        states = {"active": 0, "idle": 0}
        pool = getattr(getattr(self._httpx, "_transport", None), "_pool", None)
        for conn in getattr(pool, "connections", ()) or ():
            states["idle" if conn.is_idle() else "active"] += 1
        return states

    async def aclose(self) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
