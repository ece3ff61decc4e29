"""Shadow twins: for a `mode = "shadow"` profile, the perturbed copy of a request the client never sees.

The client was answered from its original request (streamed if it asked). After the fact, for a
sampled share of requests (`sample_rate`, decided from the request's perturbation seed so reruns
repeat), the profile's perturbers, then its remedies, run over the original body (a profile of remedies only:
the twin is the remedied request, compared with the client's unremedied answer), the result goes to the same
upstream client (non-stream, with the client's own end-to-end headers, auth included), and the answer — restored
when a perturber rewrote its shape — is handed on to be compared with the original answer. At most
`max_concurrent` twins per profile are in flight; a twin over that limit is skipped and counted,
never queued, so shadowing can never build up load or delay anybody.

The noise floor: for a share `noise_rate` of requests (decided from the perturbation seed, independently of
`sample_rate`), a second twin goes out *unperturbed* — the client's own request again. How often it
disagrees with the original answer is the model's own nondeterminism; it is counted under the
profile label `<noise>` (`NOISE_PROFILE`), never in the profile's own consistency. Noise twins share
the profile's `max_concurrent`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import structlog

from toolquake.perturbers import ChatRequest
from toolquake.proxy.server.apis import CHAT
from toolquake.proxy.server.config import NOISE_PROFILE
from toolquake.proxy.server.pipeline import Outcome, PerturbationFailed, restore, run_profile

if TYPE_CHECKING:
    from prometheus_client import Counter

    from toolquake.proxy.server.state import Asked, ProxyState, Served

log = structlog.get_logger("toolquake.shadow")


@dataclass
class Twin:
    """The perturbed twin of one exchange, after its answer came back (or failed)."""

    outcome: Outcome | None
    sent: dict[str, Any] | None
    answer: dict[str, Any] | None = None
    status: int = 0
    upstream_s: float = 0.0
    error: str | None = None
    restore_failed: list[str] = field(default_factory=list)
    #: "twin" (perturbed) or "noise" (unperturbed: the model's own nondeterminism)
    kind: str = "twin"


def sampled(perturbation_seed: int, rate: float, salt: str = "shadow") -> bool:
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return random.Random(f"{perturbation_seed}:{salt}").random() < rate


def twin_body(body: dict[str, Any]) -> dict[str, Any]:
    """The perturbed request as the twin sends it: never streamed."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    return out


class ShadowRunner:
    """Launches twins off the hot path; `done(asked, served, twin)` gets each finished twin."""

    def __init__(self, st: ProxyState, requests: Counter, done: Callable[[Asked, Served, Twin], None]) -> None:
        self.st = st
        self.requests = requests
        self.done = done
        self.in_flight: dict[str, int] = {}
        self.tasks: set[asyncio.Task] = set()

    def launch(self, asked: Asked, served: Served) -> bool:
        """Start the twin of the request (and its noise twin) if sampled and the profile has room; never waits."""
        profile = self.st.profiles.get(asked.profile_name)
        if profile is None or profile.mode != "shadow" or served.status != 200 or served.response is None:
            return False
        spec = profile.spec
        if spec.noise_rate > 0:
            self._start(asked, served, profile, "noise", sampled(asked.perturbation_seed, spec.noise_rate, "noise"))
        return self._start(asked, served, profile, "twin", sampled(asked.perturbation_seed, spec.sample_rate))

    def _start(self, asked: Asked, served: Served, profile: Any, kind: str, chosen: bool) -> bool:
        label = NOISE_PROFILE if kind == "noise" else asked.profile_name
        if not chosen:
            self.requests.labels(label, "sampled_out").inc()
            return False
        if self.in_flight.get(asked.profile_name, 0) >= profile.spec.max_concurrent:
            self.requests.labels(label, "busy").inc()
            return False
        self.in_flight[asked.profile_name] = self.in_flight.get(asked.profile_name, 0) + 1
        if served.trace is not None:  # the request's span waits for the twin's consistency
            served.trace.hold()
        task = asyncio.get_running_loop().create_task(self._run(asked, served, profile, kind))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _run(self, asked: Asked, served: Served, profile: Any, kind: str = "twin") -> None:
        try:
            try:
                twin = await self._twin(asked, profile, perturb=kind == "twin", kind=kind, trace=served.trace)
            finally:
                self.in_flight[asked.profile_name] -= 1
            twin.kind = kind
            label = NOISE_PROFILE if kind == "noise" else asked.profile_name
            self.requests.labels(label, "answered" if twin.error is None else "failed").inc()
            try:
                self.done(asked, served, twin)
            except Exception as exc:  # fail-open: a broken consumer never takes the runner down
                log.warning("shadow_consumer_failed", error_type=type(exc).__name__, error=str(exc)[:200])
        finally:
            if served.trace is not None:
                served.trace.release()

    async def _twin(self, asked: Asked, profile: Any, perturb: bool = True, kind: str = "twin",
                    trace: Any = None) -> Twin:
        st, m = self.st, self.st.metrics
        outcome = None
        request = asked.request or {}
        if perturb:
            try:
                outcome = await run_profile(profile, ChatRequest(request), asked.perturbation_seed, st.services,
                                            asked.case)
            except Exception as exc:  # strict profiles raise; the client was served already
                if isinstance(exc, PerturbationFailed):
                    m.count_failure(exc, profile.name)
                return Twin(None, None, error=f"perturbation: {type(exc).__name__}")
            m.count_outcome(outcome, getattr(st.services.token_counter, "source", "none"), profile.name)
            request = outcome.request.body
        twin = Twin(outcome, twin_body(request))
        api = asked.api or CHAT
        # the twin speaks the client's API (a Responses request's twin is a Responses request)
        wire = twin_body(api.to_wire(request, asked.wire_request or {}, asked.conversion))
        span, headers = None, asked.forward_headers
        if trace is not None:
            # the twin's span: its kind, and the perturbation it carries (the tracer writes the outcome's attributes)
            span, headers = trace.call(f"shadow {kind}", asked, headers, {"toolquake.shadow.kind": kind}, outcome)
        try:
            return await self._send(asked, twin, outcome, wire, headers)
        finally:
            if trace is not None:
                trace.called(span, twin.status, twin.answer, {"toolquake.shadow.error": twin.error})

    async def _send(self, asked: Asked, twin: Twin, outcome: Outcome | None, wire: dict[str, Any],
                    headers: list[tuple[str, str]]) -> Twin:
        st, m, api = self.st, self.st.metrics, asked.api or CHAT
        t0 = time.perf_counter()
        try:
            resp = await st.upstream.send("POST", st.upstream.api_url(api.path), headers, msgspec.json.encode(wire))
            try:
                data = await resp.aread(st.config.server.max_answer_bytes)
            finally:
                await resp.aclose()
        except Exception as exc:  # unreachable, timeout, protocol error, past max_answer_bytes: counted, nothing else
            twin.error = f"upstream: {type(exc).__name__}"
            return twin
        twin.upstream_s = time.perf_counter() - t0
        twin.status = resp.status_code
        if resp.status_code != 200:
            twin.error = f"upstream status {resp.status_code}"
            return twin
        try:
            answer = msgspec.json.decode(data)
        except msgspec.DecodeError:
            twin.error = "upstream answer is not JSON"
            return twin
        if not isinstance(answer, dict):
            twin.error = "upstream answer is not a JSON object"
            return twin
        answer = api.answer_to_internal(answer)
        if outcome is not None and outcome.rewrites_response:
            answer, twin.restore_failed = restore(outcome, answer)
            m.count_restore_failures(twin.restore_failed)
        twin.answer = answer
        return twin

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
