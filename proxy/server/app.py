"""The app: routes wired to their handlers, error handlers, start-up and shutdown.

No perturbation or scoring rule lives here. Data flows one way: request → profile → perturbers →
upstream → restore → client (proxy/server/chat.py), and a finished request is handed to observers
after the fact. Features such as live scoring attach themselves through `extensions`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterable

import structlog
from litestar import Litestar, Request, Response, get, route
from litestar.exceptions import HTTPException

from toolquake.perturbers import Services
from toolquake.proxy.server import admin
from toolquake.proxy.server.apis import CHAT, RESPONSES
from toolquake.proxy.server.chat import ChatHandler, error_response, unknown_profile
from toolquake.proxy.server.config import NO_PROFILE, NOISE_PROFILE, Config
from toolquake.proxy.server.errors import error_body
from toolquake.proxy.server.lean import LeanPath
from toolquake.proxy.server.metrics import REFRESH_S, Metrics
from toolquake.proxy.server.passthrough import Passthrough
from toolquake.proxy.server.profiles import Profile, ProfileStore, SharedProfiles
from toolquake.proxy.server.state import ProxyState
from toolquake.proxy.server.upstream import UpstreamError, make_upstream

log = structlog.get_logger("toolquake.proxy")
JSON = "application/json"
#: a feature attached to a new app: gets the app and the server state (adds observers, hooks, routes)
Extension = Callable[[Litestar, ProxyState], object]


class WarmUp:
    """The start-up warm-up's progress: while it runs, /readyz answers 503 `warming_up` naming what is
    still loading. Profiles the admin API adds later are warmed too, but never flip readiness back."""

    def __init__(self, profiles: list[str]) -> None:
        self.pending = list(profiles)   # profiles whose perturbers are not set up yet, in order
        self.current = ""               # "profile/perturber" being set up now
        self.done = not profiles

    def describe(self) -> str:
        what = f"{self.current} (profiles left: {', '.join(self.pending)})" if self.current else ", ".join(self.pending)
        return f"warming up: loading {what}"


async def _setup_perturbers(st: ProxyState, profiles: list[Profile], progress: WarmUp | None = None) -> None:
    t0 = time.perf_counter()
    seen: set[int] = set()
    failed: list[str] = []
    errors: set[tuple[str, str]] = set()
    try:
        for profile in profiles:
            for perturber in profile.all_steps() if profile else ():  # the remedies too
                if id(perturber) in seen:
                    continue
                seen.add(id(perturber))
                if progress is not None:
                    progress.current = f"{profile.name}/{perturber.name}"
                try:
                    await asyncio.to_thread(perturber.setup, st.services)
                except Exception as exc:  # fail-open: the perturber will fail (and be counted) per request instead
                    failed.append(f"{profile.name}/{perturber.name}")
                    error = (type(exc).__name__, str(exc)[:300])
                    if error not in errors:  # once per distinct error (no embeddings: dozens of profiles, one cause)
                        errors.add(error)
                        log.warning("perturber_setup_failed", profile=profile.name, perturber=perturber.name,
                                    error_type=error[0], error=error[1])
            if progress is not None and profile and profile.name in progress.pending:
                progress.pending.remove(profile.name)
    finally:
        if progress is not None:  # readiness never waits on a warm-up that failed or was cancelled
            progress.done, progress.current, progress.pending = True, "", []
    log.info("perturbers_set_up", profiles=[p.name for p in profiles if p], perturbers=len(seen),
             seconds=round(time.perf_counter() - t0, 3), failed=failed)
    if progress is not None and failed:
        log.warning("ready_after_failed_warm_up", failed=failed,
                    hint="these perturbers load on first use and may fail (and be counted) per request")


def _loop_tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (scraped from another thread)
        return 0


class Lifecycle:
    """One app's start-up and shutdown: the perturbers' warm-up (and the readiness it holds back), the
    background tasks (warm-ups, the loop-lag probe, the gauges' refresh), the upstream pool closed last."""

    def __init__(self, st: ProxyState) -> None:
        self.st = st
        self.warming = WarmUp([])  # replaced at start-up when [server] warm_up is on
        self.background: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def warm(self, profiles: list[Profile], progress: WarmUp | None = None) -> None:
        """Load what the profiles' perturbers need (pools, models) off the request path, in the background."""
        if self.st.config.server.warm_up:
            self.spawn(_setup_perturbers(self.st, profiles, progress))

    async def refresh_gauges(self) -> None:  # several workers: each keeps its share of the process gauges current
        while True:
            self.st.metrics.refresh()
            await asyncio.sleep(REFRESH_S)

    async def startup(self) -> None:
        st = self.st
        configured = [st.profiles.get(n) for n in st.profiles.names()]
        if st.config.server.warm_up:  # not ready until every configured profile's perturbers are set up (or failed)
            self.warming = WarmUp([p.name for p in configured if p])
        self.warm(configured, self.warming)
        self.spawn(st.metrics.watch_loop_lag())  # cancelled by shutdown()
        if st.metrics.multiprocess:
            self.spawn(self.refresh_gauges())

    async def shutdown(self) -> None:
        for task in list(self.background):
            task.cancel()
        await self.st.upstream.aclose()


def _proxy_state(config: Config, admin_token: str | None, services: Services | None,
                 shared: Path | None) -> ProxyState:
    from toolquake.perturbers.helpers.tokens import make_counter

    server = config.server
    st = ProxyState(
        config=config,
        profiles=ProfileStore(config.profiles, SharedProfiles(shared / "profiles") if shared else None,
                              limit=server.max_profiles),
        upstream=make_upstream(server.upstream, client=server.upstream_client, connect_timeout=server.connect_timeout,
                               read_timeout=server.read_timeout, max_connections=server.max_connections),
        metrics=Metrics(server.model_allowlist, multiprocess=shared is not None),
        services=services or Services(token_counter=make_counter(server.token_counter, server.upstream)),
        admin_token=admin_token,
    )
    st.metrics.watch_runtime(st.upstream.pool_states, _loop_tasks)
    st.profiles.on_gone = st.metrics.forget_profiles
    st.metrics.profiles_shown = lambda: (*st.profiles.names(), NO_PROFILE, NOISE_PROFILE)
    return st


def _model_routes(chat_handler: ChatHandler, responses_handler: ChatHandler) -> list:
    """The two model routes of each API, with and without a profile in the path."""

    @route("/v1/chat/completions", http_method=["POST"], name="chat", status_code=200)
    async def chat(request: Request) -> Response:
        return await chat_handler(request, None)

    @route("/p/{profile:str}/v1/chat/completions", http_method=["POST"], name="chat_profile", status_code=200)
    async def chat_profile(request: Request, profile: str) -> Response:
        return await chat_handler(request, profile)

    @route("/v1/responses", http_method=["POST"], name="responses", status_code=200)
    async def responses(request: Request) -> Response:
        return await responses_handler(request, None)

    @route("/p/{profile:str}/v1/responses", http_method=["POST"], name="responses_profile", status_code=200)
    async def responses_profile(request: Request, profile: str) -> Response:
        return await responses_handler(request, profile)

    return [chat, chat_profile, responses, responses_profile]


def _passthrough_routes(st: ProxyState) -> list:
    """The rest of the API and the backend's own routes that `[server] passthrough` lists, relayed untouched."""
    passthrough = Passthrough(st)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    # `path` (the framework's decoding) is declared for the OpenAPI schema; the path relayed is the request's own
    @route("/v1/{path:path}", http_method=methods, name="v1_passthrough", status_code=200)
    async def v1_other(request: Request, path: str) -> Response:
        return await passthrough(request, request.scope["path"], "v1_other")

    @route("/p/{profile:str}/v1/{path:path}", http_method=methods, name="v1_profile_passthrough", status_code=200)
    async def v1_profile_other(request: Request, profile: str, path: str) -> Response:
        if st.profiles.get(profile) is None:
            return error_response(unknown_profile(profile, st.profiles))
        full: str = request.scope["path"]
        return await passthrough(request, full[full.index("/", 3):], "v1_other")

    async def backend_root(request: Request) -> Response:
        return await passthrough(request, request.scope["path"], "backend_extra")

    async def backend_below(request: Request, path: str) -> Response:
        return await passthrough(request, request.scope["path"], "backend_extra")

    whole, below = passthrough.passlist.root_routes()
    root = [route(path, http_method=methods, name=f"backend_root_{i}", status_code=200)(backend_root)
            for i, path in enumerate(whole)]
    root += [route(f"/{first}/{{path:path}}", http_method=methods, name=f"backend_below_{i}",
                   status_code=200)(backend_below) for i, first in enumerate(below)]
    return [v1_other, v1_profile_other, *root]


def _probe_routes(st: ProxyState, life: Lifecycle) -> list:
    """Liveness, readiness (held back while the warm-up runs, then the upstream's health) and metrics."""

    @get("/healthz", name="healthz")
    async def healthz() -> Response:
        return Response(content=b'{"status":"ok"}', media_type=JSON)

    @get("/readyz", name="readyz")
    async def readyz() -> Response:
        if not life.warming.done:
            return Response(content=error_body(life.warming.describe(), "server_error", "warming_up"),
                            status_code=503, media_type=JSON)
        try:
            status = await st.upstream.probe("models")
        except UpstreamError as exc:
            return Response(content=error_body(f"upstream not reachable: {exc.cause_name}", "upstream_error",
                                               "upstream_unreachable"), status_code=503, media_type=JSON)
        if status >= 500:
            return Response(content=error_body(f"upstream answered {status}", "upstream_error",
                                               "upstream_unhealthy"), status_code=503, media_type=JSON)
        # which token counter the budgets of this proxy's profiles are counted with (its kind only: no path), so
        # that `toolquake replay --proxy` can refuse token-budget arms on the estimate (proxy/replay/run.py)
        return Response(content=_ready_body(getattr(st.services.token_counter, "source", None)), media_type=JSON)

    @get("/metrics", name="metrics")
    async def metrics_route() -> Response:
        return Response(content=await st.metrics.render(), media_type=st.metrics.content_type)

    return [healthz, readyz, metrics_route]


def _ready_body(counter: Any) -> bytes:
    """/readyz's answer: ready, and the kind of token counter (`estimate`, `upstream`, `tiktoken`, `tokenizer`)."""
    return json.dumps({"status": "ready", **({"token_counter": counter} if isinstance(counter, str) else {})},
                      separators=(",", ":")).encode()


def _exception_handlers(max_body_bytes: int) -> dict:
    """OpenAI-shaped errors for what the framework raises (404, 405, 413, ...) and for anything unexpected."""

    def on_http_exception(request: Request, exc: HTTPException) -> Response:
        status = exc.status_code
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(status)
        message = exc.detail
        if status == 413:
            message = f"Request body is larger than {max_body_bytes} bytes; raise [server] max_body_bytes if needed."
        elif status == 404:  # no route: say which paths there are
            message = (f"The proxy has no route {request.scope['path']}: it serves the model routes, /healthz, "
                       "/readyz, /metrics, /admin/profiles, and relays to the backend the paths [server] "
                       "passthrough lists.")
        return Response(content=error_body(str(message), kind, code), status_code=status, media_type=JSON)

    def on_exception(_: Request, exc: Exception) -> Response:
        log.error("internal_error", error_type=type(exc).__name__, error=str(exc)[:300])
        return Response(content=error_body("Internal proxy error; see the proxy log.", "server_error",
                                           "internal_error"), status_code=500, media_type=JSON)

    return {HTTPException: on_http_exception, Exception: on_exception}


def create_app(config: Config, *, admin_token: str | None = None, services: Services | None = None,
               extensions: Iterable[Extension] = (), shared: Path | None = None) -> Litestar:
    """Build the Litestar app; each extension (e.g. `toolquake.proxy.live.attach`) is called with the new
    app and its state, in order, before the app is returned. `shared`: the directory the workers of one
    server share (`workers.Runtime`), None for a single process."""
    server = config.server
    st = _proxy_state(config, admin_token, services, shared)
    chat_handler = ChatHandler(st, CHAT)
    responses_handler = ChatHandler(st, RESPONSES)
    life = Lifecycle(st)
    st.warm = life.warm
    st.profiles.on_new = life.warm
    app = Litestar(
        route_handlers=[*_model_routes(chat_handler, responses_handler), *_passthrough_routes(st),
                        *_probe_routes(st, life), *admin.routes(st)],
        exception_handlers=_exception_handlers(server.max_body_bytes),
        request_max_body_size=server.max_body_bytes,
        on_startup=[life.startup],
        on_shutdown=[life.shutdown],
        logging_config=None,
        debug=False,
    )
    app.state.proxy = st
    for extension in extensions:
        extension(app, st)
    # the fast path's seam into the framework (proxy/server/lean.py): requests nothing perturbs or observes skip
    # the framework; the framework's answers write joined Set-Cookie headers as several again
    LeanPath.install(app, st, {f"/v1/{CHAT.path}": chat_handler, f"/v1/{RESPONSES.path}": responses_handler},
                     enabled=server.lean_path)
    return app
