"""Running a profile's perturbers, then its remedies, over one request, fail-open, and restoring the answer.

The perturbation seed of a request is the `X-Toolquake-Seed` header, else its conversation, else a hash of
the body: the same request perturbs the same way every time. Each step gets its own RNG derived from
(perturbation seed, position, name), each remedy from (perturbation seed, "remedy", position, name), so adding a
step never changes what the others do. (Not the sampling seed, the `seed` a request body may send the model: the
proxy relays that untouched.)

A remedy runs after every perturbation step; it is recorded as an `Applied` with `kind = "remedy"` (stored as
`{"name", "params", "report", "kind": "remedy"}`) and counted as a remedy, never as a perturbation. When the
request's case is known, the ground-truth tools a remedy left out are in its report as `dropped_needed`.
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

from toolquake.bfcl.convert import openai_name
from toolquake.perturbers import ChatRequest, PerturbContext, Perturber, Services, shown_params
from toolquake.perturbers.tool_removal import expected_functions
from toolquake.proxy.server.profiles import Profile
from toolquake.remedies import Remedy

log = structlog.get_logger("toolquake.pipeline")
#: `Applied.kind` of a remedy (a perturbation step's kind is "")
REMEDY = "remedy"
#: the key of a remedy's report naming the ground-truth tools it left out (only when the case is known)
DROPPED_NEEDED = "dropped_needed"


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
    #: names of tools this step added to the request (tools the client never offered); a remedy adds none
    added_tools: list[str] = field(default_factory=list)
    #: REMEDY for a remedy (remedies/), "" for a perturbation step
    kind: str = ""

    @property
    def is_remedy(self) -> bool:
        return self.kind == REMEDY

    def stored(self, report: dict[str, Any] | None = None) -> dict[str, Any]:
        """The step as results files and stores keep it: {"name", "params", "report"} (params as shown outside the
        operator's configuration), plus "kind": "remedy" for a remedy; `report` in place of its own when given."""
        out = {"name": self.name, "params": shown_params(self.params), "report": self.report if report is None
               else report}
        if self.kind:
            out["kind"] = self.kind
        return out


@dataclass
class Outcome:
    """What a profile did to one request."""

    request: ChatRequest
    changed: bool = False
    applied: list[Applied] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: perturbers that raised
    failed: list[str] = field(default_factory=list)
    #: remedies that raised (the request went on as the steps before left it)
    remedies_failed: list[str] = field(default_factory=list)
    restorers: list[tuple[Perturber, PerturbContext]] = field(default_factory=list)

    @property
    def rewrites_response(self) -> bool:
        return bool(self.restorers)

    @property
    def perturbations(self) -> list[Applied]:
        """The perturbation steps applied (not the remedies)."""
        return [a for a in self.applied if not a.is_remedy]

    @property
    def remedies(self) -> list[Applied]:
        """The remedies applied."""
        return [a for a in self.applied if a.is_remedy]

    @property
    def injected(self) -> dict[str, str]:
        """Tools in the perturbed request that the client did not send: name → the step that added it."""
        out: dict[str, str] = {}
        for a in self.applied:
            for name in a.added_tools:
                out.setdefault(name, a.name)
        return out


class PerturbationFailed(Exception):
    """Raised only for strict profiles: a perturber (or a remedy: `kind`) failed and the request must not be
    served."""

    def __init__(self, perturber: str, cause: BaseException, kind: str = "") -> None:
        super().__init__(f"{kind or 'perturber'} {perturber!r} failed: {type(cause).__name__}: {cause}")
        self.perturber = perturber
        self.kind = kind


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
    """Apply each step with its probability, then each remedy; a step that raises is skipped (counted in `failed`,
    a remedy in `remedies_failed`)."""
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
    for i, remedy in enumerate(profile.remedies):
        current = await _remedy(profile, i, remedy, current, outcome, perturbation_seed, services, case)
    outcome.request = current
    outcome.changed = current is not request
    return outcome


async def _remedy(profile: Profile, i: int, remedy: Remedy, current: ChatRequest, outcome: Outcome,
                  perturbation_seed: int, services: Services, case: Any) -> ChatRequest:
    """Apply remedy `i` of the profile to `current`; the request it sent, or `current` when it raised."""
    rng = random.Random(f"{perturbation_seed}:{REMEDY}:{i}:{remedy.name}")
    ctx = PerturbContext(perturbation_seed=perturbation_seed, rng=rng, services=services, case=case)
    try:
        result = await _call(remedy, current, ctx)
    except Exception as exc:  # fail-open boundary: the request goes on as the perturbations left it
        outcome.remedies_failed.append(remedy.name)
        log.warning("remedy_failed", remedy=remedy.name, error_type=type(exc).__name__, error=str(exc)[:300])
        if profile.spec.strict:
            raise PerturbationFailed(remedy.name, exc, REMEDY) from exc
        return current
    report = dict(ctx.report)
    if getattr(case, "ground_truth", None) is not None:  # the case is known, with the tools it needs
        try:
            report[DROPPED_NEEDED] = dropped_needed(remedy, report, case)
        except Exception as exc:  # fail-open: the count is lost, the request is not
            log.warning("dropped_needed_failed", remedy=remedy.name, error_type=type(exc).__name__)
    outcome.applied.append(Applied(remedy.name, remedy.params(), report, remedy, kind=REMEDY))
    if remedy.rewrites_response:
        outcome.restorers.append((remedy, ctx))
    return result


def dropped_needed(remedy: Remedy, report: dict[str, Any], case: Any) -> list[str]:
    """The tools the case's ground truth calls that the remedy left out of the request (as the request named
    them; a BFCL name matches in its dotted and its OpenAI spelling)."""
    wanted = set(expected_functions(case))
    wanted |= {openai_name(n) for n in wanted}
    return [name for name in dict.fromkeys(remedy.dropped_tools(report)) if name in wanted]


def tool_names(request: ChatRequest) -> set[str]:
    return {str((t.get("function") or {}).get("name")) for t in request.tools if isinstance(t, dict)}


def restore(outcome: Outcome, response: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Undo response-shape changes, last step first (the remedies before the perturbers). Failures leave the
    answer as it was."""
    failed: list[str] = []
    for perturber, ctx in reversed(outcome.restorers):
        try:
            response = perturber.restore(response, ctx)
        except Exception as exc:  # fail-open: the client gets the upstream's answer unrestored
            failed.append(perturber.name)
            log.warning("restore_failed", perturber=perturber.name, error_type=type(exc).__name__,
                        error=str(exc)[:300])
    return response, failed
