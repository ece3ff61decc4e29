"""Streamed answers as small strategies over one shared helper (`StreamWriter`): the time to the first byte,
in-band errors once the client has the headers, and the cleanup after its last byte (count, log, observe,
then the steps that read the relayed bytes)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import structlog
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from toolquake.proxy.server.answer.base import off_loop
from toolquake.proxy.server.answer.observe import finish
from toolquake.proxy.server.answer.plain import JSON, answer_too_large, bad_upstream_answer
from toolquake.proxy.server.errors import ProxyError, error_body
from toolquake.proxy.server.upstream import AnswerTooLarge, UpstreamError, response_headers

if TYPE_CHECKING:
    from toolquake.proxy.server.answer.base import Plan
    from toolquake.proxy.server.answer.path import AnswerPath
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.server.upstream import UpstreamResponse

log = structlog.get_logger("toolquake.proxy")


def stream_error(m: Metrics, kind: str, message: str, code: str) -> bytes:
    """An error told in-band, the way OpenAI streams report them (the headers are sent)."""
    m.upstream_errors.labels(kind).inc()
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


class StreamWriter:
    """One streamed answer on its way to the client. A strategy writes `frames`; this class holds what they
    share. `body`: the backend's bytes, set when the steps that read them afterwards should get them."""

    def __init__(self, path: AnswerPath, asked: Asked, served: Served, upstream: UpstreamResponse,
                 plan: Plan) -> None:
        self.path, self.asked, self.served, self.upstream, self.plan = path, asked, served, upstream, plan
        self.m = path.st.metrics
        self.first: float | None = None
        self.end: float | None = None
        self.body: bytes | None = None
        self.gen: AsyncIterator[bytes] | None = None

    def frames(self) -> AsyncIterator[bytes]:  # pragma: no cover - interface
        raise NotImplementedError

    def response(self) -> Stream:
        self.served.status = 200
        self.gen = self.frames()
        h = response_headers(self.upstream.headers)
        h.pop("content-type", None)
        h["X-Toolquake-Request-Id"] = self.asked.request_id
        return Stream(self.gen, status_code=200, headers=h, media_type="text/event-stream",
                      background=BackgroundTask(self.cleanup))

    def first_byte(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.m.child(self.m.ttfb, self.asked.profile_name, "true" if self.asked.stream else "false").observe(
                self.first - self.asked.t0)

    def uninspected(self) -> None:
        """The answer ran past `[server] max_answer_bytes`: relayed on as it comes, uninspected, nothing more of it
        kept (no step, observer or check reads it); counted and logged."""
        asked, limit = self.asked, self.path.st.config.server.max_answer_bytes
        self.served.uninspected = "too_large"
        self.m.answers_uninspected.labels("too_large").inc()
        log.warning("answer_too_large", request_id=asked.request_id, route=asked.route, stream=asked.stream,
                    max_answer_bytes=limit, relayed=True)

    def failed(self, exc: UpstreamError) -> bytes:
        self.served.status = 504 if exc.kind == "timeout" else 502
        return stream_error(self.m, exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                            f"upstream_{exc.kind}")

    def unfinished(self, empty: bool) -> bytes:
        """The stream ended without its end marker (chat `[DONE]`, a final Responses event)."""
        self.served.status = 502
        what = "an empty stream" if empty else "a stream that ended unfinished"
        return stream_error(self.m, "invalid_response", f"The upstream model server sent {what}.",
                            "upstream_invalid_response")

    def too_large(self) -> bytes:
        """The answer ran past `[server] max_answer_bytes` and the strategy needs it whole: an error, in-band."""
        self.served.status = 502
        return b"data: " + answer_too_large(self.path.st, self.asked, self.served).body() + b"\n\n"

    async def closed(self) -> None:
        self.end = time.perf_counter()
        await self.upstream.aclose()

    async def settle(self) -> None:
        """After the last byte, before the request is counted: what a strategy still owes the steps."""

    async def cleanup(self) -> None:
        if self.gen is not None:
            await self.gen.aclose()  # type: ignore[attr-defined]
        await self.upstream.aclose()
        asked, served = self.asked, self.served
        served.upstream_s = (self.end or time.perf_counter()) - (served.t_upstream or asked.t0)
        await self.settle()
        finish(self.path.st, asked, served)
        self.m.in_flight.dec()
        if self.body and served.status == 200:  # after the request is counted: no part of its duration
            await self.path.after_bytes(asked, served, self.plan, self.body)
        elif self.plan.bytes and served.trace is not None:  # nothing to read: the span held for it ends now
            served.trace.release()


class Relay(StreamWriter):
    """The upstream's stream relayed chunk by chunk; a copy kept only when a step or an observer reads it."""

    parts: list[bytes] | None = None

    async def frames(self) -> AsyncIterator[bytes]:
        markers = self.asked.api.end_markers if self.asked.api is not None else ()
        keep = max(len(x) for x in markers) if markers else 0
        parts = self.parts = [] if self.plan.keeps(self.asked) else None
        room = self.path.st.config.server.max_answer_bytes  # what may still be kept of it
        ended, tail = False, b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.first is None:
                    self.first_byte()
                if parts is not None:
                    room -= len(chunk)
                    if room >= 0:
                        parts.append(chunk)
                    else:  # past the bound: what was kept goes, the rest is relayed uninspected
                        parts = self.parts = None
                        self.uninspected()
                if not ended:
                    seen = tail + chunk
                    ended = any(x in seen for x in markers)
                    tail = seen[-keep:]
                yield chunk
            if not ended:
                yield self.unfinished(self.first is None)
        except UpstreamError as exc:
            yield self.failed(exc)
        finally:
            await self.closed()

    async def settle(self) -> None:
        whole = b"".join(self.parts) if self.parts else b""
        self.body = whole
        asked, served, api = self.asked, self.served, self.asked.api
        if whole and api is not None and (asked.observed or self.plan.answer):
            if await self.summarized(whole):
                return
            native = await off_loop(api.assemble, whole)
            served.response = api.answer_to_internal(native) if native else None
            if served.response is not None:
                served.response = await self.path.read(asked, served, self.plan, served.response)

    async def summarized(self, whole: bytes) -> bool:
        """The steps that read the answer read only its summary, and nobody else reads it: they get the summary
        (`served.response` stays None, as for an answer nobody reads)."""
        asked, served, api = self.asked, self.served, self.asked.api
        if asked.observed or (asked.request is not None and self.path.st.config.server.log_contents) or \
                not all(step.summary_enough(asked, served) for step in self.plan.answer):
            return False
        summary = await off_loop(api.summarize, whole) if api is not None else None
        if summary is None:
            return False
        for step in self.plan.answer:
            await step.on_answer(asked, served, summary)
        return True


class Rewritten(StreamWriter):
    """The answer must change before the client sees it: the whole upstream stream is read (`prepare`, before
    the client has headers: a failure is a plain error), rewritten by the steps, and re-emitted as a stream
    of the client's API (the bytes as they came when no step changed it)."""

    out: list[bytes] = []

    async def prepare(self) -> Rewritten:
        asked, served, api, m = self.asked, self.served, self.asked.api, self.m
        assert api is not None
        try:
            data = await self.upstream.aread(self.path.st.config.server.max_answer_bytes)
        except AnswerTooLarge:
            raise answer_too_large(self.path.st, asked, served) from None
        except UpstreamError as exc:
            m.upstream_errors.labels(exc.kind).inc()
            raise ProxyError(504 if exc.kind == "timeout" else 502, f"The upstream stream failed ({exc.cause_name}).",
                             type="upstream_error", code=f"upstream_{exc.kind}") from None
        finally:
            await self.upstream.aclose()
        native = await off_loop(api.assemble, data)
        if native is None or not any(x in data for x in api.end_markers):
            m.upstream_errors.labels("invalid_response").inc()
            raise bad_upstream_answer("an empty stream" if native is None else "a stream that ended unfinished")
        self.end = time.perf_counter()
        served.upstream_s = self.end - (served.t_upstream or asked.t0)
        served.status = 200
        wire: Any = await self.path.rewrite(asked, served, self.plan, native)
        self.out = [data] if wire is native else list(api.emit(wire))
        self.body = data
        return self

    async def frames(self) -> AsyncIterator[bytes]:
        for frame in self.out:
            self.first_byte()
            yield frame


class Uninspected(StreamWriter):
    """A whole answer past `[server] max_answer_bytes` that no step must change (`plain_answer` raised
    `AnswerTooLarge`): what was read of it, then the rest as it comes, relayed with the upstream's status and
    content type, uninspected (not checked to be JSON, no step or observer reads it) and never kept."""

    def __init__(self, path: AnswerPath, asked: Asked, served: Served, upstream: UpstreamResponse, plan: Plan,
                 head: bytes) -> None:
        super().__init__(path, asked, served, upstream, plan)
        self.head = head

    def response(self) -> Stream:
        upstream = self.upstream
        self.served.status = upstream.status_code
        self.uninspected()
        self.gen = self.frames()
        h = response_headers(upstream.headers)
        media = h.pop("content-type", JSON)
        h["X-Toolquake-Request-Id"] = self.asked.request_id
        return Stream(self.gen, status_code=upstream.status_code, headers=h, media_type=media,
                      background=BackgroundTask(self.cleanup))

    async def frames(self) -> AsyncIterator[bytes]:
        head, self.head = self.head, b""
        try:
            self.first_byte()
            yield head
            del head
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except UpstreamError as exc:  # the head is sent: the body just ends (the client's JSON decode fails)
            self.m.upstream_errors.labels(exc.kind).inc()
            self.served.status = 504 if exc.kind == "timeout" else 502
        finally:
            await self.closed()

