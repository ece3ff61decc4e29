"""Running a profile's perturbers over one request, fail-open, and restoring the answer.

The perturbation seed of a request is the `X-Toolquake-Seed` header, else its conversation, else a hash of
the body: the same request perturbs the same way every time. Each step gets its own RNG derived from
(perturbation seed, position, name), so adding a step never changes what the others do. (Not the sampling
seed, the `seed` a request body may send the model: the proxy relays that untouched.)
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from toolquake.perturbers import ChatRequest, PerturbContext, Perturber, Services
from toolquake.proxy.server.profiles import Profile

log = structlog.get_logger("toolquake.pipeline")


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def conversation_key(request: ChatRequest) -> bytes | None:
    """What stays fixed across the turns of one agent run: its first user message and its tool names
    (sorted); None when the request has no user message (then the body decides)."""
    for message in request.messages:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            text = content if isinstance(content, str) else msgspec.json.encode(content).decode()
            names = sorted(str((t.get("function") or {}).get("name")) for t in request.tools if isinstance(t, dict))
            return msgspec.json.encode([text, names])
    return None


def perturbation_seed_for(header: str | None, body: bytes, *, conversation: str | None = None,
                          request: ChatRequest | None = None) -> int:
    """The request's perturbation seed: an integer `X-Toolquake-Seed`; else the conversation —
    `X-Toolquake-Conversation` when sent, else the conversation key of the request — so every turn of one
    conversation perturbs the same way; else a hash of the body."""
    if header:
        try:
            return int(header)
        except ValueError:
            pass
    if conversation:
        return _hash(b"conversation:" + conversation.encode("utf-8", "replace"))
    key = conversation_key(request) if request is not None else None
    return _hash(b"key:" + key) if key is not None else _hash(body)


@dataclass
class Applied:
    """One step that ran: its name, parameters and report, and the perturber itself (for grading hooks)."""

    name: str
    params: dict[str, Any]
    report: dict[str, Any]
    perturber: Perturber | None = field(default=None, repr=False, compare=False)
    #: names of tools this step added to the request (tools the client never offered)
    added_tools: list[str] = field(default_factory=list)


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

    @property
    def injected(self) -> dict[str, str]:
        """Tools in the perturbed request that the client did not send: name → the step that added it."""
        out: dict[str, str] = {}
        for a in self.applied:
            for name in a.added_tools:
                out.setdefault(name, a.name)
        return out


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


async def run_profile(profile: Profile, request: ChatRequest, perturbation_seed: int, services: Services,
                      case: Any = None) -> Outcome:
    """Apply each step with its probability; a step that raises is skipped (counted in `failed`)."""
    outcome = Outcome(request=request)
    current = request
    for i, step in enumerate(profile.steps):
        p = step.perturber
        rng = random.Random(f"{perturbation_seed}:{i}:{p.name}")
        if step.probability < 1.0 and rng.random() >= step.probability:
            outcome.skipped.append(p.name)
            continue
        ctx = PerturbContext(perturbation_seed=perturbation_seed, rng=rng, services=services, case=case)
        before = current
        try:
            current = await _call(p, current, ctx)
        except Exception as exc:  # fail-open boundary: nothing a perturber does may break the request
            outcome.failed.append(p.name)
            log.warning("perturber_failed", perturber=p.name, error_type=type(exc).__name__,
                        error=str(exc)[:300])
            if profile.spec.strict:
                raise PerturbationFailed(p.name, exc) from exc
            continue
        added = [] if current.tools is before.tools else sorted(tool_names(current) - tool_names(before))
        outcome.applied.append(Applied(p.name, p.params(), dict(ctx.report), p, added))
        if p.rewrites_response:
            outcome.restorers.append((p, ctx))
    outcome.request = current
    outcome.changed = current is not request
    return outcome


def tool_names(request: ChatRequest) -> set[str]:
    return {str((t.get("function") or {}).get("name")) for t in request.tools if isinstance(t, dict)}


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
