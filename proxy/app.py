"""The HTTP server: routes, relay, timing and counting. No perturbation or scoring rule lives here.

Data flows one way: request → profile → perturbers → upstream → restore → client, and a finished
exchange is handed to observers (the scoring queue) after the fact.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
import structlog
from litestar import Litestar, Request, Response, get, route
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import HTTPException
from litestar.response import Stream

from perturbers import ChatRequest, Services
from proxy import streaming
from proxy.config import Config
from proxy.errors import ProxyError, error_body
from proxy.metrics import Metrics
from proxy.pipeline import Outcome, PerturbationFailed, restore, run_profile, seed_for
from proxy.profiles import Profile, ProfileStore
from proxy.protocol import request_decoder
from proxy.upstream import Upstream, UpstreamError, UpstreamResponse, request_headers, response_headers

log = structlog.get_logger("toolquake.proxy")
JSON = "application/json"
_decode = msgspec.json.decode
_encode = msgspec.json.encode
CHAT_ROUTE = "chat_completions"


@dataclass
class Exchange:
    """One finished chat-completions exchange, handed to observers after the client was answered."""

    request_id: str
    profile: str
    mode: str
    model: str | None
    stream: bool
    status: int
    #: the client's request as decoded JSON, and what the upstream received (same object if unchanged)
    request: dict[str, Any]
    sent: dict[str, Any]
    #: the answer the client got (streams reassembled), or None when there was no JSON answer
    response: dict[str, Any] | None
    outcome: Outcome | None
    case: Any
    case_header: str | None
    seed: int
    #: end-to-end client headers (auth included) for a shadow twin; never logged or stored
    forward_headers: list[tuple[str, str]] = field(repr=False, default_factory=list)
    total_s: float = 0.0
    upstream_s: float = 0.0


@dataclass
class ProxyState:
    config: Config
    profiles: ProfileStore
    upstream: Upstream
    metrics: Metrics
    services: Services
    admin_token: str | None = None
    #: called with each finished Exchange; must return quickly (enqueue and go)
    observers: list[Callable[[Exchange], None]] = field(default_factory=list)
    #: (X-Toolquake-Case header, request) -> case or None; set when a corpus is loaded
    case_resolver: Callable[[str | None, ChatRequest], Any] | None = None
    #: schedules perturbers' setup() for new profiles, in the background (set by create_app)
    warm: Callable[[list[Profile]], None] | None = None


def _headers(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _invalid_json(exc: Exception) -> ProxyError:
    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ProxyError(400, f"Request body is not valid JSON: {reason}", code="invalid_json")


def _error(exc: ProxyError, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(content=exc.body(), status_code=exc.status, media_type=JSON, headers=extra_headers)


class ChatHandler:
    """Serves one chat-completions request end to end."""

    def __init__(self, st: ProxyState) -> None:
        self.st = st

    async def __call__(self, request: Request, profile_name: str | None) -> Response:
        st, m = self.st, self.st.metrics
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex[:16]
        headers = _headers(request)
        m.in_flight.inc()
        done_in_background = False
        profile_label, stream, model = profile_name or "-", False, None
        try:
            raw = await request.body()
            try:
                req = request_decoder.decode(raw)
            except msgspec.ValidationError as exc:
                raise ProxyError(400, f"Invalid request body: {exc}", code="invalid_type") from None
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise _invalid_json(exc) from None
            stream, model = bool(req.stream), req.model
            name = profile_name or _header(headers, "x-toolquake-profile") or st.config.server.default_profile
            profile = st.profiles.get(name)
            if profile is None:
                raise ProxyError(404, f"Unknown profile {name!r}. Known profiles: {', '.join(st.profiles.names())}.",
                                 code="unknown_profile")
            profile_label = profile.name
            response, done_in_background = await self._serve(request, rid, t0, headers, raw, profile, stream, model)
            return response
        except ProxyError as exc:
            self._finish(rid, profile_label, stream, model, exc.status, t0, None, None)
            return _error(exc, {"X-Toolquake-Request-Id": rid})
        finally:
            if not done_in_background:
                m.in_flight.dec()

    async def _serve(self, request: Request, rid: str, t0: float, headers: list[tuple[str, str]], raw: bytes,
                     profile: Profile, stream: bool, model: str | None) -> tuple[Response, bool]:
        st = self.st
        want_exchange = bool(st.observers)
        body: dict[str, Any] | None = None
        outcome: Outcome | None = None
        case, case_header = None, _header(headers, "x-toolquake-case")
        seed = seed_for(_header(headers, "x-toolquake-seed"), raw)
        send_raw = raw
        if profile.mode == "perturb" and profile.steps or want_exchange:
            try:
                body = _decode(raw)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise _invalid_json(exc) from None  # e.g. bad UTF-8 in a key the typed decode skipped
            if not isinstance(body, dict):
                raise ProxyError(400, "Request body must be a JSON object.", code="invalid_type")
            chat = ChatRequest(body)
            if st.case_resolver is not None:
                try:
                    case = st.case_resolver(case_header, chat)
                except Exception as exc:  # fail-open: an unknown case never breaks the request
                    log.warning("case_resolution_failed", error_type=type(exc).__name__)
            if profile.mode == "perturb" and profile.steps:
                try:
                    outcome = await run_profile(profile, chat, seed, st.services, case)
                except PerturbationFailed as exc:
                    st.metrics.perturbation_failures.labels(exc.perturber).inc()
                    raise ProxyError(500, str(exc), type="server_error", code="perturbation_failed") from None
                for a in outcome.applied:
                    st.metrics.perturbations.labels(a.name).inc()
                    added = a.report.get("tokens_added")
                    if isinstance(added, int) and added >= 0:
                        st.metrics.tokens_added.labels(a.name, getattr(st.services.token_counter, "source",
                                                                       "none")).observe(added)
                for f in outcome.failed:
                    st.metrics.perturbation_failures.labels(f).inc()
                if outcome.changed:
                    send_raw = outcome.request.encode()
        fwd = request_headers(headers)
        url = st.upstream.api_url("chat/completions")
        t_up = time.perf_counter()
        upstream = await self._send("POST", url, fwd, send_raw, "")
        ctx = _Ctx(rid=rid, t0=t0, t_up=t_up, profile=profile, stream=stream, model=model, body=body,
                   outcome=outcome, case=case, case_header=case_header, seed=seed, fwd=fwd, want=want_exchange)
        if stream and upstream.status_code == 200 and "text/event-stream" in upstream.header("content-type"):
            if outcome is not None and outcome.rewrites_response:
                return await self._stream_rewritten(upstream, ctx), True
            return self._stream_relay(upstream, ctx), True
        return await self._plain(upstream, ctx), False

    async def _send(self, method: str, url: str, headers: list[tuple[str, str]], content: bytes | None,
                    params: str) -> UpstreamResponse:
        try:
            return await self.st.upstream.send(method, url, headers, content, params)
        except UpstreamError as exc:
            self.st.metrics.upstream_errors.labels(exc.kind).inc()
            if exc.kind == "timeout":
                raise ProxyError(504, "The upstream model server did not answer in time. Retry, or raise "
                                 "[server] read_timeout.", type="upstream_error", code="upstream_timeout") from None
            raise ProxyError(502, f"The upstream model server could not be reached ({exc.cause_name}). "
                             "Check [server] upstream and that the backend is running.",
                             type="upstream_error", code="upstream_unreachable") from None

    async def _plain(self, upstream: UpstreamResponse, ctx: _Ctx) -> Response:
        try:
            data = await upstream.aread()
        except UpstreamError as exc:
            self.st.metrics.upstream_errors.labels(exc.kind).inc()
            if exc.kind == "timeout":
                raise ProxyError(504, "The upstream model server stopped answering mid-response.",
                                 type="upstream_error", code="upstream_timeout") from None
            raise ProxyError(502, f"The upstream connection failed mid-response ({exc.cause_name}).",
                             type="upstream_error", code="upstream_unreachable") from None
        finally:
            await upstream.aclose()
        t_up_end = time.perf_counter()
        status = upstream.status_code
        resp_headers = response_headers(upstream.headers)
        answer: dict[str, Any] | None = None
        is_json = "json" in upstream.header("content-type")
        if status == 200 and is_json and (ctx.want or (ctx.outcome and ctx.outcome.rewrites_response)):
            try:
                parsed = _decode(data)
                answer = parsed if isinstance(parsed, dict) else None
            except msgspec.DecodeError:
                answer = None
            if answer is not None and ctx.outcome is not None and ctx.outcome.rewrites_response:
                answer, failed = restore(ctx.outcome, answer)
                for f in failed:
                    self.st.metrics.restore_failures.labels(f).inc()
                data = _encode(answer)
        total = time.perf_counter() - ctx.t0
        upstream_s = t_up_end - ctx.t_up
        resp_headers["X-Toolquake-Overhead-Ms"] = f"{(total - upstream_s) * 1000:.3f}"
        resp_headers["X-Toolquake-Request-Id"] = ctx.rid
        self.st.metrics.ttfb.labels(ctx.profile.name, "false").observe(total)
        self._finish(ctx.rid, ctx.profile.name, False, ctx.model, status, ctx.t0, upstream_s, ctx, answer)
        return Response(content=data, status_code=status, headers=resp_headers,
                        media_type=upstream.header("content-type", JSON))

    def _stream_relay(self, upstream: UpstreamResponse, ctx: _Ctx) -> Stream:
        """Relay the upstream SSE chunk by chunk; capture a copy only when someone will score it."""
        parts: list[bytes] = []
        state = {"first": None, "end": None, "status": 200}
        m = self.st.metrics

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if state["first"] is None:
                        state["first"] = time.perf_counter()
                        m.ttfb.labels(ctx.profile.name, "true").observe(state["first"] - ctx.t0)
                    if ctx.want:
                        parts.append(chunk)
                    yield chunk
            except UpstreamError as exc:
                # headers are sent: tell the client in-band, the way OpenAI streams report errors
                m.upstream_errors.labels(exc.kind).inc()
                state["status"] = 504 if exc.kind == "timeout" else 502
                yield b"data: " + error_body(f"The upstream stream failed ({exc.cause_name}).",
                                             "upstream_error", f"upstream_{exc.kind}") + b"\n\n"
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            end = state["end"] or time.perf_counter()
            answer = streaming.assemble_sse(b"".join(parts)) if ctx.want and parts else None
            self._finish(ctx.rid, ctx.profile.name, True, ctx.model, state["status"], ctx.t0, end - ctx.t_up,
                         ctx, answer)
            m.in_flight.dec()

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _stream_rewritten(self, upstream: UpstreamResponse, ctx: _Ctx) -> Stream:
        """A perturber must rewrite the answer: read the whole upstream stream, restore, re-emit."""
        m = self.st.metrics
        status = 200
        try:
            data = await upstream.aread()
            answer = streaming.assemble_sse(data)
        except UpstreamError as exc:
            m.upstream_errors.labels(exc.kind).inc()
            raise ProxyError(504 if exc.kind == "timeout" else 502, f"The upstream stream failed ({exc.cause_name}).",
                             type="upstream_error", code=f"upstream_{exc.kind}") from None
        finally:
            await upstream.aclose()
        t_up_end = time.perf_counter()
        answer, failed = restore(ctx.outcome, answer)
        for f in failed:
            m.restore_failures.labels(f).inc()
        frames = list(streaming.emit_stream(answer))
        first = {"t": None}

        async def emit() -> AsyncIterator[bytes]:
            for frame in frames:
                if first["t"] is None:
                    first["t"] = time.perf_counter()
                    m.ttfb.labels(ctx.profile.name, "true").observe(first["t"] - ctx.t0)
                yield frame

        async def cleanup() -> None:
            self._finish(ctx.rid, ctx.profile.name, True, ctx.model, status, ctx.t0, t_up_end - ctx.t_up, ctx,
                         answer)
            m.in_flight.dec()

        return Stream(emit(), status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    @staticmethod
    def _stream_headers(upstream: UpstreamResponse, ctx: _Ctx) -> dict[str, str]:
        h = response_headers(upstream.headers)
        h.pop("content-type", None)
        h["X-Toolquake-Request-Id"] = ctx.rid
        return h

    def _finish(self, rid: str, profile: str, stream: bool, model: str | None, status: int, t0: float,
                upstream_s: float | None, ctx: _Ctx | None, answer: dict[str, Any] | None = None) -> None:
        m = self.st.metrics
        total = time.perf_counter() - t0
        s = "true" if stream else "false"
        m.requests.labels(profile, CHAT_ROUTE, f"{status // 100}xx", s, m.model_label(model)).inc()
        m.duration.labels(profile, CHAT_ROUTE, s).observe(total)
        if upstream_s is not None:
            m.upstream_duration.labels(CHAT_ROUTE, s).observe(upstream_s)
            m.overhead.labels(CHAT_ROUTE, s).observe(max(total - upstream_s, 0.0))
        applied = [a.name for a in ctx.outcome.applied] if ctx and ctx.outcome else []
        failed = ctx.outcome.failed if ctx and ctx.outcome else []
        event: dict[str, Any] = dict(request_id=rid, route=CHAT_ROUTE, profile=profile, stream=stream, status=status,
                                     perturbers=applied, total_ms=round(total * 1000, 3))
        if failed:
            event["perturbers_failed"] = failed
        if upstream_s is not None:
            event["upstream_ms"] = round(upstream_s * 1000, 3)
        if self.st.config.server.log_contents and ctx is not None and ctx.body is not None:
            event["messages"] = ctx.body.get("messages")
            event["answer"] = answer
        log.info("request", **event)
        if ctx is not None and ctx.want and ctx.body is not None:
            ex = Exchange(request_id=rid, profile=profile, mode=ctx.profile.mode, model=model, stream=stream,
                          status=status, request=ctx.body,
                          sent=ctx.outcome.request.body if ctx.outcome else ctx.body, response=answer,
                          outcome=ctx.outcome, case=ctx.case, case_header=ctx.case_header, seed=ctx.seed,
                          forward_headers=ctx.fwd, total_s=total, upstream_s=upstream_s or 0.0)
            for observer in self.st.observers:
                try:
                    observer(ex)
                except Exception as exc:  # fail-open: scoring never breaks serving
                    log.warning("observer_failed", error_type=type(exc).__name__, error=str(exc)[:200])


@dataclass
class _Ctx:
    rid: str
    t0: float
    t_up: float
    profile: Profile
    stream: bool
    model: str | None
    body: dict[str, Any] | None
    outcome: Outcome | None
    case: Any
    case_header: str | None
    seed: int
    fwd: list[tuple[str, str]]
    want: bool


class Passthrough:
    """Every other path: method, query, body, status and end-to-end headers relayed untouched."""

    def __init__(self, st: ProxyState) -> None:
        self.st = st

    async def __call__(self, request: Request, url: str, route_label: str) -> Response:
        m = self.st.metrics
        t0 = time.perf_counter()
        m.in_flight.inc()
        status = 502
        try:
            body = await request.body()
            upstream = await ChatHandler(self.st)._send(request.method, url, request_headers(_headers(request)),
                                                        body or None, request.url.query)
            if "text/event-stream" in upstream.header("content-type"):
                status = upstream.status_code

                async def relay() -> AsyncIterator[bytes]:
                    try:
                        async for chunk in upstream.aiter_raw():
                            yield chunk
                    finally:
                        await upstream.aclose()

                return Stream(relay(), status_code=status, headers=response_headers(upstream.headers),
                              background=BackgroundTask(upstream.aclose))
            try:
                data = await upstream.aread()
            finally:
                await upstream.aclose()
            status = upstream.status_code
            return Response(content=data, status_code=status, headers=response_headers(upstream.headers),
                            media_type=upstream.header("content-type") or None)
        except ProxyError as exc:
            status = exc.status
            return _error(exc)
        finally:
            m.in_flight.dec()
            m.requests.labels("-", route_label, f"{status // 100}xx", "false", "none").inc()
            m.duration.labels("-", route_label, "false").observe(time.perf_counter() - t0)


async def _setup_perturbers(st: ProxyState, profiles: list[Profile]) -> None:
    t0 = time.perf_counter()
    seen: set[int] = set()
    for profile in profiles:
        for step in profile.steps if profile else ():
            if id(step.perturber) in seen:
                continue
            seen.add(id(step.perturber))
            try:
                await asyncio.to_thread(step.perturber.setup, st.services)
            except Exception as exc:  # fail-open: the perturber will fail (and be counted) per request instead
                log.warning("perturber_setup_failed", profile=profile.name, perturber=step.perturber.name,
                            error_type=type(exc).__name__, error=str(exc)[:300])
    log.info("perturbers_set_up", profiles=[p.name for p in profiles if p], perturbers=len(seen),
             seconds=round(time.perf_counter() - t0, 3))


def _loop_tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (scraped from another thread)
        return 0


def create_app(config: Config, *, admin_token: str | None = None, services: Services | None = None,
               state_hook: Callable[[ProxyState], None] | None = None) -> Litestar:
    """Build the Litestar app. `state_hook` lets optional parts (scoring, corpus) attach to the state."""
    from perturbers.tokens import make_counter
    from proxy import admin

    server = config.server
    st = ProxyState(
        config=config,
        profiles=ProfileStore(config.profiles),
        upstream=Upstream(server.upstream, connect_timeout=server.connect_timeout, read_timeout=server.read_timeout,
                          max_connections=server.max_connections, client=server.upstream_client),
        metrics=Metrics(server.model_allowlist),
        services=services or Services(token_counter=make_counter(server.token_counter, server.upstream)),
        admin_token=admin_token,
    )
    st.metrics.watch_runtime(st.upstream.pool_states, _loop_tasks)
    chat_handler = ChatHandler(st)
    passthrough = Passthrough(st)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    @route("/v1/chat/completions", http_method=["POST"], name="chat", status_code=200)
    async def chat(request: Request) -> Response:
        return await chat_handler(request, None)

    @route("/p/{profile:str}/v1/chat/completions", http_method=["POST"], name="chat_profile", status_code=200)
    async def chat_profile(request: Request, profile: str) -> Response:
        return await chat_handler(request, profile)

    @route("/v1/{path:path}", http_method=methods, name="v1_passthrough", status_code=200)
    async def v1_other(request: Request, path: str) -> Response:
        return await passthrough(request, st.upstream.api_url(path), "v1_other")

    @route("/p/{profile:str}/v1/{path:path}", http_method=methods, name="v1_profile_passthrough", status_code=200)
    async def v1_profile_other(request: Request, profile: str, path: str) -> Response:
        if st.profiles.get(profile) is None:
            return _error(ProxyError(404, f"Unknown profile {profile!r}. Known profiles: "
                                          f"{', '.join(st.profiles.names())}.", code="unknown_profile"))
        return await passthrough(request, st.upstream.api_url(path), "v1_other")

    @route(["/tokenize", "/detokenize"], http_method=["POST"], name="backend_tokenize", status_code=200)
    async def backend_tokenize(request: Request) -> Response:
        return await passthrough(request, st.upstream.root_url(request.url.path), "backend_extra")

    @route("/extras/{path:path}", http_method=methods, name="backend_extras", status_code=200)
    async def backend_extras(request: Request, path: str) -> Response:
        return await passthrough(request, st.upstream.root_url(f"extras/{path.lstrip('/')}"), "backend_extra")

    @get("/healthz", name="healthz")
    async def healthz() -> Response:
        return Response(content=b'{"status":"ok"}', media_type=JSON)

    @get("/readyz", name="readyz")
    async def readyz() -> Response:
        try:
            status = await st.upstream.probe("models")
        except UpstreamError as exc:
            return Response(content=error_body(f"upstream not reachable: {exc.cause_name}", "upstream_error",
                                               "upstream_unreachable"), status_code=503, media_type=JSON)
        if status >= 500:
            return Response(content=error_body(f"upstream answered {status}", "upstream_error",
                                               "upstream_unhealthy"), status_code=503, media_type=JSON)
        return Response(content=b'{"status":"ready"}', media_type=JSON)

    @get("/metrics", name="metrics")
    async def metrics_route() -> Response:
        return Response(content=st.metrics.exposition(), media_type=st.metrics.content_type)

    def on_http_exception(_: Request, exc: HTTPException) -> Response:
        status = exc.status_code
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(status)
        message = exc.detail if status != 413 else (
            f"Request body is larger than {server.max_body_bytes} bytes; raise [server] max_body_bytes if needed.")
        return Response(content=error_body(str(message), kind, code), status_code=status, media_type=JSON)

    def on_exception(_: Request, exc: Exception) -> Response:
        log.error("internal_error", error_type=type(exc).__name__, error=str(exc)[:300])
        return Response(content=error_body("Internal proxy error; see the proxy log.", "server_error",
                                           "internal_error"), status_code=500, media_type=JSON)

    warmers: set[asyncio.Task] = set()

    def warm(profiles: list[Profile]) -> None:
        """Load what the profiles' perturbers need (pools, models) off the request path, in the background."""
        if not server.warm_up:
            return
        task = asyncio.get_running_loop().create_task(_setup_perturbers(st, profiles))
        warmers.add(task)
        task.add_done_callback(warmers.discard)

    st.warm = warm

    async def startup() -> None:
        warm([st.profiles.get(n) for n in st.profiles.names()])

    async def shutdown() -> None:
        for task in list(warmers):
            task.cancel()
        await st.upstream.aclose()

    app = Litestar(
        route_handlers=[chat, chat_profile, v1_other, v1_profile_other, backend_tokenize, backend_extras,
                        healthz, readyz, metrics_route, *admin.routes(st)],
        exception_handlers={HTTPException: on_http_exception, Exception: on_exception},
        request_max_body_size=server.max_body_bytes,
        on_startup=[startup],
        on_shutdown=[shutdown],
        logging_config=None,
        debug=False,
    )
    app.state.proxy = st
    from proxy.scoring import attach as attach_scoring  # case resolver; scoring queue when [scoring] enabled

    attach_scoring(app, st)
    if state_hook is not None:
        state_hook(st)
    return app
