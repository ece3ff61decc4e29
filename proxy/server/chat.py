"""The chat-completions route: decode, choose the profile, perturb, forward, relay or restore, count.

One `RequestContext` carries a request from arrival to its last byte; the log line and the
observers (live scoring, replay) are fed from it after the client was answered.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

import msgspec
import structlog
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from toolquake.perturbers import ChatRequest
from toolquake.proxy.server import streaming
from toolquake.proxy.server.errors import ProxyError, error_body
from toolquake.proxy.server.pipeline import PerturbationFailed, restore, run_profile, seed_for
from toolquake.proxy.server.protocol import request_decoder
from toolquake.proxy.server.state import ProxyState, RequestContext
from toolquake.proxy.server.upstream import UpstreamError, UpstreamResponse, request_headers, response_headers

log = structlog.get_logger("toolquake.proxy")
JSON = "application/json"
CHAT_ROUTE = "chat_completions"
_decode = msgspec.json.decode
_encode = msgspec.json.encode


def client_headers(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The first value of header `name` (lower-case)."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def invalid_json(exc: Exception) -> ProxyError:
    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ProxyError(400, f"Request body is not valid JSON: {reason}", code="invalid_json")


def error_response(exc: ProxyError, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(content=exc.body(), status_code=exc.status, media_type=JSON, headers=extra_headers)


def unknown_profile(name: str, known: list[str]) -> ProxyError:
    return ProxyError(404, f"Unknown profile {name!r}. Known profiles: {', '.join(known)}.", code="unknown_profile")


async def send_upstream(st: ProxyState, method: str, url: str, headers: list[tuple[str, str]],
                        content: bytes | None, params: str = "") -> UpstreamResponse:
    """Send to the backend; failures become the proxy's own 502/504 (and are counted)."""
    try:
        return await st.upstream.send(method, url, headers, content, params)
    except UpstreamError as exc:
        st.metrics.upstream_errors.labels(exc.kind).inc()
        if exc.kind == "timeout":
            raise ProxyError(504, "The upstream model server did not answer in time. Retry, or raise "
                             "[server] read_timeout.", type="upstream_error", code="upstream_timeout") from None
        raise ProxyError(502, f"The upstream model server could not be reached ({exc.cause_name}). "
                         "Check [server] upstream and that the backend is running.",
                         type="upstream_error", code="upstream_unreachable") from None


class ChatHandler:
    """Serves one chat-completions request end to end."""

    def __init__(self, st: ProxyState) -> None:
        self.st = st

    async def __call__(self, request: Request, profile_name: str | None) -> Response:
        st = self.st
        ctx = RequestContext(request_id=uuid.uuid4().hex[:16], t0=time.perf_counter())
        headers = client_headers(request)
        st.metrics.in_flight.inc()
        streamed = False  # a streamed answer finishes (and leaves in_flight) in its background task
        try:
            raw = await request.body()
            try:
                req = request_decoder.decode(raw)
            except msgspec.ValidationError as exc:
                raise ProxyError(400, f"Invalid request body: {exc}", code="invalid_type") from None
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise invalid_json(exc) from None
            ctx.stream, ctx.model = bool(req.stream), req.model
            name = profile_name or header(headers, "x-toolquake-profile") or st.config.server.default_profile
            ctx.profile = st.profiles.get(name)
            if ctx.profile is None:
                raise unknown_profile(name, st.profiles.names())
            response = await self._serve(ctx, headers, raw)
            streamed = isinstance(response, Stream)
            return response
        except ProxyError as exc:
            ctx.status = exc.status
            self._finish(ctx, observe=False)
            return error_response(exc, {"X-Toolquake-Request-Id": ctx.request_id})
        finally:
            if not streamed:
                st.metrics.in_flight.dec()

    async def _serve(self, ctx: RequestContext, headers: list[tuple[str, str]], raw: bytes) -> Response:
        st, profile = self.st, ctx.profile
        assert profile is not None
        ctx.observed = bool(st.observers)
        ctx.case_header = header(headers, "x-toolquake-case")
        ctx.seed = seed_for(header(headers, "x-toolquake-seed"), raw)
        send_raw = raw
        perturbing = profile.mode == "perturb" and bool(profile.steps)
        if perturbing or ctx.observed:
            try:
                body = _decode(raw)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise invalid_json(exc) from None  # e.g. bad UTF-8 in a key the typed decode skipped
            if not isinstance(body, dict):
                raise ProxyError(400, "Request body must be a JSON object.", code="invalid_type")
            ctx.request = body
            chat = ChatRequest(body)
            if st.case_resolver is not None:
                try:
                    ctx.case = st.case_resolver(ctx.case_header, chat)
                except Exception as exc:  # fail-open: an unknown case never breaks the request
                    log.warning("case_resolution_failed", error_type=type(exc).__name__)
            if perturbing:
                try:
                    ctx.outcome = await run_profile(profile, chat, ctx.seed, st.services, ctx.case)
                except PerturbationFailed as exc:
                    st.metrics.perturbation_failures.labels(exc.perturber).inc()
                    raise ProxyError(500, str(exc), type="server_error", code="perturbation_failed") from None
                st.metrics.count_outcome(ctx.outcome, getattr(st.services.token_counter, "source", "none"))
                if ctx.outcome.changed:
                    send_raw = ctx.outcome.request.encode()
        ctx.forward_headers = request_headers(headers)
        ctx.t_upstream = time.perf_counter()
        upstream = await send_upstream(st, "POST", st.upstream.api_url("chat/completions"), ctx.forward_headers,
                                       send_raw)
        if ctx.stream and upstream.status_code == 200 and "text/event-stream" in upstream.header("content-type"):
            if ctx.outcome is not None and ctx.outcome.rewrites_response:
                return await self._stream_rewritten(upstream, ctx)
            return self._stream_relay(upstream, ctx)
        return await self._plain(upstream, ctx)

    async def _plain(self, upstream: UpstreamResponse, ctx: RequestContext) -> Response:
        st = self.st
        try:
            data = await upstream.aread()
        except UpstreamError as exc:
            st.metrics.upstream_errors.labels(exc.kind).inc()
            if exc.kind == "timeout":
                raise ProxyError(504, "The upstream model server stopped answering mid-response.",
                                 type="upstream_error", code="upstream_timeout") from None
            raise ProxyError(502, f"The upstream connection failed mid-response ({exc.cause_name}).",
                             type="upstream_error", code="upstream_unreachable") from None
        finally:
            await upstream.aclose()
        ctx.upstream_s = time.perf_counter() - (ctx.t_upstream or ctx.t0)
        ctx.status = upstream.status_code
        resp_headers = response_headers(upstream.headers)
        rewrites = ctx.outcome is not None and ctx.outcome.rewrites_response
        if ctx.status == 200 and "json" in upstream.header("content-type") and (ctx.observed or rewrites):
            try:
                parsed = _decode(data)
                ctx.response = parsed if isinstance(parsed, dict) else None
            except msgspec.DecodeError:
                ctx.response = None
            if ctx.response is not None and rewrites:
                ctx.response, failed = restore(ctx.outcome, ctx.response)
                st.metrics.count_restore_failures(failed)
                data = _encode(ctx.response)
        total = time.perf_counter() - ctx.t0
        resp_headers["X-Toolquake-Overhead-Ms"] = f"{(total - ctx.upstream_s) * 1000:.3f}"
        resp_headers["X-Toolquake-Request-Id"] = ctx.request_id
        st.metrics.ttfb.labels(ctx.profile_name, "false").observe(total)
        self._finish(ctx)
        return Response(content=data, status_code=ctx.status, headers=resp_headers,
                        media_type=upstream.header("content-type", JSON))

    def _stream_relay(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
        """Relay the upstream SSE chunk by chunk; capture a copy only when someone will score it."""
        parts: list[bytes] = []
        state: dict[str, Any] = {"first": None, "end": None}
        ctx.status = 200
        m = self.st.metrics

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if state["first"] is None:
                        state["first"] = time.perf_counter()
                        m.ttfb.labels(ctx.profile_name, "true").observe(state["first"] - ctx.t0)
                    if ctx.observed:
                        parts.append(chunk)
                    yield chunk
            except UpstreamError as exc:
                # headers are sent: tell the client in-band, the way OpenAI streams report errors
                m.upstream_errors.labels(exc.kind).inc()
                ctx.status = 504 if exc.kind == "timeout" else 502
                yield b"data: " + error_body(f"The upstream stream failed ({exc.cause_name}).",
                                             "upstream_error", f"upstream_{exc.kind}") + b"\n\n"
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            ctx.upstream_s = (state["end"] or time.perf_counter()) - (ctx.t_upstream or ctx.t0)
            ctx.response = streaming.assemble_sse(b"".join(parts)) if ctx.observed and parts else None
            self._finish(ctx)
            m.in_flight.dec()

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _stream_rewritten(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
        """A perturber must rewrite the answer: read the whole upstream stream, restore, re-emit."""
        m = self.st.metrics
        assert ctx.outcome is not None
        try:
            data = await upstream.aread()
            answer = streaming.assemble_sse(data)
        except UpstreamError as exc:
            m.upstream_errors.labels(exc.kind).inc()
            raise ProxyError(504 if exc.kind == "timeout" else 502, f"The upstream stream failed ({exc.cause_name}).",
                             type="upstream_error", code=f"upstream_{exc.kind}") from None
        finally:
            await upstream.aclose()
        ctx.upstream_s = time.perf_counter() - (ctx.t_upstream or ctx.t0)
        ctx.status = 200
        ctx.response, failed = restore(ctx.outcome, answer)
        m.count_restore_failures(failed)
        frames = list(streaming.emit_stream(ctx.response))
        first: dict[str, float | None] = {"t": None}

        async def emit() -> AsyncIterator[bytes]:
            for frame in frames:
                if first["t"] is None:
                    first["t"] = time.perf_counter()
                    m.ttfb.labels(ctx.profile_name, "true").observe(first["t"] - ctx.t0)
                yield frame

        async def cleanup() -> None:
            self._finish(ctx)
            m.in_flight.dec()

        return Stream(emit(), status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    @staticmethod
    def _stream_headers(upstream: UpstreamResponse, ctx: RequestContext) -> dict[str, str]:
        h = response_headers(upstream.headers)
        h.pop("content-type", None)
        h["X-Toolquake-Request-Id"] = ctx.request_id
        return h

    def _finish(self, ctx: RequestContext, observe: bool = True) -> None:
        """Count, log, and hand the finished request to the observers."""
        st, m = self.st, self.st.metrics
        ctx.total_s = time.perf_counter() - ctx.t0
        s = "true" if ctx.stream else "false"
        m.requests.labels(ctx.profile_name, CHAT_ROUTE, f"{ctx.status // 100}xx", s, m.model_label(ctx.model)).inc()
        m.duration.labels(ctx.profile_name, CHAT_ROUTE, s).observe(ctx.total_s)
        if ctx.upstream_s is not None:
            m.upstream_duration.labels(CHAT_ROUTE, s).observe(ctx.upstream_s)
            m.overhead.labels(CHAT_ROUTE, s).observe(max(ctx.total_s - ctx.upstream_s, 0.0))
        outcome = ctx.outcome
        event: dict[str, Any] = dict(request_id=ctx.request_id, route=CHAT_ROUTE, profile=ctx.profile_name,
                                     stream=ctx.stream, status=ctx.status,
                                     perturbers=[a.name for a in outcome.applied] if outcome else [],
                                     total_ms=round(ctx.total_s * 1000, 3))
        if outcome is not None and outcome.failed:
            event["perturbers_failed"] = outcome.failed
        if ctx.upstream_s is not None:
            event["upstream_ms"] = round(ctx.upstream_s * 1000, 3)
        if st.config.server.log_contents and ctx.request is not None:
            event["messages"] = ctx.request.get("messages")
            event["answer"] = ctx.response
        log.info("request", **event)
        if observe and ctx.observed and ctx.request is not None:
            for observer in st.observers:
                try:
                    observer(ctx)
                except Exception as exc:  # fail-open: scoring never breaks serving
                    log.warning("observer_failed", error_type=type(exc).__name__, error=str(exc)[:200])
