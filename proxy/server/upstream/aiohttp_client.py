"""The aiohttp upstream (the default): its C HTTP parser and pool cost a fraction of httpx's per request."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import quote

import aiohttp
from yarl import URL

from toolquake.proxy.server.upstream.base import QUERY_SAFE, AnswerTooLarge, Upstream, UpstreamResponse, classify


class _AiohttpResponse(UpstreamResponse):
    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]
        self._done = False

    async def aread(self, limit: int | None = None) -> bytes:
        parts, size = [], 0
        try:
            if limit is None:
                data = await self._resp.read()
            else:
                async for chunk in self._resp.content.iter_any():
                    parts.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        break
                data = b"".join(parts)
        except BaseException as exc:
            raise _error(exc) from exc
        if limit is not None and size > limit:
            raise AnswerTooLarge(data)
        self._done = True
        return data

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except BaseException as exc:
            raise _error(exc) from exc
        self._done = True

    async def aclose(self) -> None:
        # a fully read answer gives its connection back to the pool; anything else closes it
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


def _error(exc: BaseException) -> BaseException:
    return classify(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError), (aiohttp.ClientError, OSError))


class AiohttpUpstream(Upstream):
    kind = "aiohttp"

    def __init__(self, base: str, **limits: float) -> None:
        super().__init__(base, **limits)
        self._session: aiohttp.ClientSession | None = None  # created on first use, inside the running loop

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
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

    async def send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                   params: str = "", timeout: float | None = None) -> UpstreamResponse:
        if params:
            url = f"{url}?{quote(params, safe=QUERY_SAFE)}"
        kwargs = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}
        try:
            # encoded: sent as it is (yarl would otherwise resolve dot segments and re-decode escapes)
            resp = await self._client().request(method, URL(url, encoded=True), headers=headers, data=content,
                                                allow_redirects=False, compress=False, **kwargs)
        except BaseException as exc:
            raise _error(exc) from exc
        return _AiohttpResponse(resp)

    def pool_states(self) -> dict[str, int]:
        states = {"active": 0, "idle": 0}
        if self._session is not None:
            connector = self._session.connector
            states["active"] = sum(len(v) for v in getattr(connector, "_acquired_per_host", {}).values())
            states["idle"] = sum(len(v) for v in getattr(connector, "_conns", {}).values())
        return states

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
