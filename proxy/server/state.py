"""The server's shared state types: what features attached to a server (live scoring, shadow twins,
replay) may know of it, without importing the module that assembles the app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from toolquake.perturbers import ChatRequest, Services
    from toolquake.proxy.server.apis import Api
    from toolquake.proxy.server.config import Config
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.pipeline import Outcome
    from toolquake.proxy.server.profiles import Profile, ProfileStore
    from toolquake.proxy.server.upstream import Upstream


@dataclass
class RequestContext:
    """One model request (chat completions or Responses) from arrival to the last byte of its answer.

    The handler fills it in as the request goes (profile, seed, case, outcome, then status and
    timings); the log line is written from it; observers get it once the client was answered.
    `request` and `response` are chat-completions shaped whatever the API (the one internal form);
    `api`, `wire_request` and `conversion` say how to speak the client's API again.
    """

    request_id: str
    #: perf_counter() at arrival, and when the request went upstream
    t0: float
    api: Api | None = None
    t_upstream: float | None = None
    profile: Profile | None = None
    stream: bool = False
    model: str | None = None
    seed: int = 0
    case: Any = None
    case_header: str | None = None
    #: the client's request, chat-shaped (None when nobody needs it decoded); as sent, and its conversion
    request: dict[str, Any] | None = None
    wire_request: dict[str, Any] | None = field(default=None, repr=False)
    conversion: Any = field(default=None, repr=False)
    outcome: Outcome | None = None
    #: end-to-end client headers (auth included) as sent upstream; for a shadow twin, never logged or stored
    forward_headers: list[tuple[str, str]] = field(repr=False, default_factory=list)
    #: observers will get this context when the answer is finished (the answer is then kept)
    observed: bool = False
    # -- the answer
    status: int = 0
    #: the answer the client got (streams reassembled), or None when there was no JSON answer
    response: dict[str, Any] | None = None
    total_s: float = 0.0
    upstream_s: float | None = None
    #: names of the tools the proxy added that the model called (before `injected_calls` handled them)
    injected_calls: list[str] = field(default_factory=list)
    #: the body sent upstream (its tools are what the backend's answer is checked against)
    sent_raw: bytes = field(default=b"", repr=False)
    #: conformance rules the backend's answer broke (conformance.Violation), and the rule a `repair` fixed
    violations: list[Any] = field(default_factory=list)
    repaired: str | None = None

    @property
    def route(self) -> str:
        return self.api.route if self.api is not None else "-"

    @property
    def profile_name(self) -> str:
        return self.profile.name if self.profile is not None else "-"

    @property
    def mode(self) -> str:
        return self.profile.mode if self.profile is not None else "off"

    @property
    def sent(self) -> dict[str, Any] | None:
        """What the upstream received (the client's request when nothing changed it)."""
        return self.outcome.request.body if self.outcome is not None else self.request


@dataclass
class ProxyState:
    config: Config
    profiles: ProfileStore
    upstream: Upstream
    metrics: Metrics
    services: Services
    admin_token: str | None = None
    #: called with each finished RequestContext; must return quickly (enqueue and go)
    observers: list[Callable[[RequestContext], None]] = field(default_factory=list)
    #: (X-Toolquake-Case header, request) -> case or None; set by an extension that knows a corpus
    case_resolver: Callable[[str | None, ChatRequest], Any] | None = None
    #: called with a finished RequestContext and its conformance violations (only when there are some);
    #: must return quickly
    conformance_sinks: list[Callable[[RequestContext, list[Any]], None]] = field(default_factory=list)
    #: schedules perturbers' setup() for new profiles, in the background (set by create_app)
    warm: Callable[[list[Profile]], None] | None = None
