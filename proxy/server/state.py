"""The server's shared state types: what features attached to a server (live scoring, shadow twins,
replay) may know of it, without importing the module that assembles the app.

A model request is described in two parts, each with one name wherever it is passed around:
`Asked` (`asked`), what the request is, fixed once it was decoded; and `Served` (`served`), what
happened to it on the way (the perturbation outcome, the answer, its status, timings and verdicts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

from toolquake.proxy.server.hooks import TraceHooks, Tracer

if TYPE_CHECKING:
    from toolquake.perturbers import ChatRequest, Services
    from toolquake.proxy.server.apis import Api
    from toolquake.proxy.server.config import Config
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.pipeline import Outcome
    from toolquake.proxy.server.profiles import Profile, ProfileStore
    from toolquake.proxy.server.upstream import Upstream


class Asked(NamedTuple):
    """What one model request (chat completions or Responses) is, once it was decoded (immutable: a named tuple,
    as cheap to make as the request's hot path needs).

    `request` is chat-completions shaped whatever the API (the one internal form; None when nobody
    needs it decoded); `api`, `wire_request` and `conversion` say how to speak the client's API again.
    """

    request_id: str
    #: perf_counter() at arrival
    t0: float
    api: Api | None = None
    profile: Profile | None = None
    stream: bool = False
    model: str | None = None
    #: the perturbation seed (`pipeline.perturbation_seed_for`: X-Toolquake-Seed, the conversation, the body), which
    #: seeds each step's RNG; not the sampling seed a request body may send the model
    perturbation_seed: int = 0
    case: Any = None
    case_header: str | None = None
    request: dict[str, Any] | None = None
    wire_request: dict[str, Any] | None = None
    conversion: Any = None
    #: end-to-end client headers (auth included) as sent upstream; for a shadow twin, never logged or stored
    forward_headers: list[tuple[str, str]] | tuple[()] = ()
    #: observers read this request decoded, and its answer (which is then kept); False: the request was only
    #: validated, and only the case observers get it (with `request` None)
    observed: bool = False

    def __repr__(self) -> str:  # never the headers (auth) nor the bodies
        return (f"Asked(request_id={self.request_id!r}, route={self.route!r}, profile={self.profile_name!r}, "
                f"stream={self.stream!r}, model={self.model!r}, perturbation_seed={self.perturbation_seed!r}, "
                f"observed={self.observed!r})")

    @property
    def route(self) -> str:
        return self.api.route if self.api is not None else "-"

    @property
    def profile_name(self) -> str:
        return self.profile.name if self.profile is not None else "-"

    @property
    def mode(self) -> str:
        return self.profile.mode if self.profile is not None else "off"


@dataclass(slots=True)
class Served:
    """What happened to one model request, filled in as it goes: the profile's outcome, what was sent
    upstream, then the answer's status, timings and verdicts. The log line is written from it; observers
    get it (with its `Asked`) once the client was answered."""

    outcome: Outcome | None = None
    #: what the upstream received, chat-shaped (the client's request when nothing changed it; None when
    #: nobody needed it decoded), and its bytes (its tools are what the backend's answer is checked against)
    sent: dict[str, Any] | None = None
    sent_raw: bytes = field(default=b"", repr=False)
    #: perf_counter() when the request went upstream
    t_upstream: float | None = None
    status: int = 0
    #: the answer the client got (streams reassembled), chat-shaped, or None when there was no JSON answer
    response: dict[str, Any] | None = None
    total_s: float = 0.0
    upstream_s: float | None = None
    #: names of the tools the proxy added that the model called (before `injected_calls` handled them)
    injected_calls: tuple[str, ...] = ()
    #: conformance rules the backend's answer broke (conformance.Violation), and the rule a `repair` fixed
    violations: list[Any] = field(default=())  # type: ignore[assignment]
    repaired: str | None = None
    #: why the answer reached the client uninspected, or was refused (`too_large`: past max_answer_bytes)
    uninspected: str | None = None
    #: the request's trace (hooks.TraceHooks: the tracing wing's when it is attached and on), else None
    trace: TraceHooks | None = None


#: called with each finished request; must return quickly (enqueue and go)
Observer = Callable[[Asked, Served], None]


class CaseHint(NamedTuple):
    """What the typed decode of a request tells about its case before the body is decoded whole: its first user
    message (a one-message list, empty when it has none; the whole converted list for the Responses API) and
    the names of its tools, as the decoded request would give them."""

    messages: list[dict[str, Any]]
    tools: frozenset[str]


class Undecided:
    """`CaseResolver.quick`'s answer when only the request decoded whole can tell its case."""

    def __repr__(self) -> str:
        return "UNDECIDED"


UNDECIDED = Undecided()


class CaseResolver(Protocol):
    """Ties a request to a case (set by an extension that knows a corpus: `live.attach`)."""

    def __call__(self, header: str | None, request: ChatRequest) -> Any:
        """(X-Toolquake-Case header, the decoded request) -> its case, or None."""

    def quick(self, header: str | None, hint: CaseHint) -> Any:
        """The same answer from the header or the hint, before the body is decoded whole: the case, None (no case
        can match), or UNDECIDED (decode it and ask `__call__`). Runs for every request: cheap look-ups only."""
#: called with a finished request and its conformance violations (only when there are some); must return quickly
ConformanceSink = Callable[[Asked, Served, list[Any]], None]


@dataclass
class ProxyState:
    config: Config
    profiles: ProfileStore
    upstream: Upstream
    metrics: Metrics
    services: Services
    admin_token: str | None = None
    #: get every finished request, decoded, with its answer (recording, replay)
    observers: list[Observer] = field(default_factory=list)
    #: get every finished request too, but read only those tied to a case or of a profile that perturbs or
    #: shadows (live scoring): those are decoded and `observed`; any other is served undecoded and reaches them
    #: with `asked.request` None and its answer unread
    case_observers: list[Observer] = field(default_factory=list)
    case_resolver: CaseResolver | None = None
    conformance_sinks: list[ConformanceSink] = field(default_factory=list)
    #: schedules perturbers' setup() for new profiles, in the background (set by create_app)
    warm: Callable[[list[Profile]], None] | None = None
    #: the tracer: the tracing wing's when attached (`toolquake.proxy.tracing.attach`), else a no-op (hooks.py)
    tracing: Tracer = field(default_factory=Tracer)
