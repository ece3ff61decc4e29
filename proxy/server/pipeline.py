"""Running a profile's perturbers over one request, fail-open, and restoring the answer.

The seed of a request is the `X-Toolquake-Seed` header, else a hash of the body: the same request
perturbs the same way every time. Each step gets its own RNG derived from (seed, position, name),
so adding a step never changes what the others do.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import structlog

from toolquake.perturbers import ChatRequest, PerturbContext, Perturber, Services
from toolquake.proxy.server.profiles import Profile

log = structlog.get_logger("toolquake.pipeline")


def seed_for(header: str | None, body: bytes) -> int:
    if header:
        try:
            return int(header)
        except ValueError:
            pass
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "big")


@dataclass
class Applied:
    """One step that ran: its name, parameters and report, and the perturber itself (for grading hooks)."""

    name: str
    params: dict[str, Any]
    report: dict[str, Any]
    perturber: Perturber | None = field(default=None, repr=False, compare=False)


@dataclass
class Outcome:
    """What a profile did to one request."""

    request: ChatRequest
    changed: bool = False
    applied: list[Applied] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    restorers: list[tuple[Perturber, PerturbContext]] = field(default_factory=list)

    @property
    def rewrites_response(self) -> bool:
        return bool(self.restorers)


class PerturbationFailed(Exception):
    """Raised only for strict profiles: a perturber failed and the request must not be served."""

    def __init__(self, perturber: str, cause: BaseException) -> None:
        super().__init__(f"perturber {perturber!r} failed: {type(cause).__name__}: {cause}")
        self.perturber = perturber


async def _call(perturber: Perturber, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
    if perturber.blocking:
        result = await asyncio.to_thread(perturber.apply, request, ctx)
    else:
        result = perturber.apply(request, ctx)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, ChatRequest):
        raise TypeError(f"{perturber.name}.apply returned {type(result).__name__}, not ChatRequest")
    return result


async def run_profile(profile: Profile, request: ChatRequest, seed: int, services: Services,
                      case: Any = None) -> Outcome:
    """Apply each step with its probability; a step that raises is skipped (counted in `failed`)."""
    outcome = Outcome(request=request)
    current = request
    for i, step in enumerate(profile.steps):
        p = step.perturber
        rng = random.Random(f"{seed}:{i}:{p.name}")
        if step.probability < 1.0 and rng.random() >= step.probability:
            outcome.skipped.append(p.name)
            continue
        ctx = PerturbContext(seed=seed, rng=rng, services=services, case=case)
        try:
            current = await _call(p, current, ctx)
        except Exception as exc:  # fail-open boundary: nothing a perturber does may break the request
            outcome.failed.append(p.name)
            log.warning("perturber_failed", perturber=p.name, error_type=type(exc).__name__,
                        error=str(exc)[:300])
            if profile.spec.strict:
                raise PerturbationFailed(p.name, exc) from exc
            continue
        outcome.applied.append(Applied(p.name, p.params(), dict(ctx.report), p))
        if p.rewrites_response:
            outcome.restorers.append((p, ctx))
    outcome.request = current
    outcome.changed = current is not request
    return outcome


def restore(outcome: Outcome, response: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Undo response-shape changes, last perturber first. Failures leave the answer as it was."""
    failed: list[str] = []
    for perturber, ctx in reversed(outcome.restorers):
        try:
            response = perturber.restore(response, ctx)
        except Exception as exc:  # fail-open: the client gets the upstream's answer unrestored
            failed.append(perturber.name)
            log.warning("restore_failed", perturber=perturber.name, error_type=type(exc).__name__,
                        error=str(exc)[:300])
    return response, failed
