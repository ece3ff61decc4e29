"""The perturber interface: a typed request in, a new request out, an optional restore.

A perturber is a msgspec Struct whose public fields are its parameters (decoded from a profile's
`params` table, unknown keys rejected). It never sees HTTP. It must not mutate the request it is
given: it builds a new one with `request.replace(...)` and shallow copies of what it changes.

Everything the rest of toolquake relies on about a perturber is declared on `Perturber` below:
how `apply` runs (plain, `blocking` in a worker thread, or `async def`), whether it rewrites the
answer (`rewrites_response` + `restore`), how it changes the expected answer (`expected_answer`),
what grading should read instead of the restored answer (`answer_decodes`), which experiment of the
report its arms belong to (`experiment`, `axes`), which profiles replay's preset of its name selects
(`preset_profiles`), and whether a generator model writes what it adds (`generates_text`). Nothing outside
this package asks for a perturber by name.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, ClassVar

import msgspec

#: `Perturber.expected_answer`: the right answer to the case is now no tool call at all
NO_CALL = "no_call"
#: report key: this step left the request as it was on purpose (e.g. a rephrasing rejected by the value check),
#: with the reason as value; a pair on which every applied step says so is "not perturbed": reports count it
#: apart and keep it out of the arm's accuracy
NOT_PERTURBED = "not_perturbed"


class ChatRequest(msgspec.Struct, frozen=True):
    """A chat-completions request body as decoded JSON; every field the client sent is kept.

    `messages` and `tools` are lists of OpenAI-shaped dicts. Never mutate them in place: copy,
    change the copy, and return `request.replace(messages=..., tools=...)`.
    """

    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages") or []

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.body.get("tools") or []

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def replace(self, **fields: Any) -> ChatRequest:
        """A new request with the given top-level fields set (a value of `None` removes the key)."""
        body = dict(self.body)
        for key, value in fields.items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return ChatRequest(body)

    def last_user_index(self) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].get("role") == "user":
                return i
        return None

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body)


@dataclass
class Services:
    """Shared, process-wide helpers that perturbers may use (filled in lazily by later parts).

    `token_counter` counts tokens of a request (see perturbers/helpers/tokens.py); `extra` holds other
    named services (tool pool, embedding index, corpus) created once at start-up or on first use.
    """

    token_counter: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def get(self, name: str, factory: Any = None) -> Any:
        """Return the named service, creating it once with `factory()` when it is missing (thread-safe:
        blocking perturbers run in worker threads, and two of them may ask at once)."""
        if name in self.extra:
            return self.extra[name]
        if factory is None:
            raise LookupError(f"service {name!r} is not available")
        with self._lock:
            if name not in self.extra:
                self.extra[name] = factory()
            return self.extra[name]


@dataclass
class PerturbContext:
    """What a perturber may know besides the request: its seeded RNG, the case, the services."""

    #: the request's perturbation seed (X-Toolquake-Seed, else the conversation, else the body); `rng` is seeded
    #: from it, the step's position and name
    perturbation_seed: int
    rng: random.Random
    services: Services
    case: Any = None
    #: facts a perturber reports about what it did (e.g. tokens_added), keyed by fact name
    report: dict[str, Any] = field(default_factory=dict)
    #: state a perturber keeps between apply() and restore() of the same request
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        """`perturbation_seed` under its old name, for perturbers written before it was renamed."""
        return self.perturbation_seed


@dataclass(frozen=True)
class NumericAxis:
    """One parameter of a perturber declared sweepable (`Perturber.numeric_axes`).

    The sweep sets `param` to the intensity x (rounded to an integer when `integer`) and `fixed`'s parameters to
    their values; below `low` the step is left out (the request as the client sent it). `default_min`,
    `default_max` and `default_step` are the sweep's `--min`, `--max`, `--resolution` when not given; `unit`
    says what x counts, for reports."""

    param: str
    unit: str
    integer: bool = True
    low: float = 1
    default_min: float = 0
    default_max: float = 200
    default_step: float = 1
    fixed: dict[str, Any] = field(default_factory=dict)
    #: what a case must hold for the axis to grow anything: "tool_response" (a tool message, or a multi-turn
    #: conversation, whose steps have them), or "" (any case); a sweep whose cases all lack it is refused
    needs: str = ""


class Perturber(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base class. Subclasses set `name`, declare their parameters as fields, implement `apply`."""

    name: ClassVar[str] = ""
    #: True when `restore` must rewrite the upstream's answer (streams are then rebuilt)
    rewrites_response: ClassVar[bool] = False
    #: True when `apply` blocks (CPU-heavy work, synchronous HTTP): it then runs in a worker thread
    blocking: ClassVar[bool] = False
    #: True when `restore` only turns answer text into calls, so a streamed answer's plain text may reach the
    #: client as it arrives (up to what `stream_release` allows) instead of after the whole answer
    streams_text: ClassVar[bool] = False
    #: parameters only the operator may set (the config file, or the environment through their defaults): those
    #: naming a host, URL, path, directory, file, environment variable, key or token, or that widen whose data a
    #: step may use. The admin API refuses a profile that sets one to anything but its default (or the value the
    #: operator configured for that step); a test fails for a parameter with such a name left undeclared.
    operator_only: ClassVar[frozenset[str]] = frozenset()
    #: the experiment this step's arms belong to in reports (e.g. "catalog_size"): the arms of one experiment form
    #: its grid or its family; "" for none. Reports find their arms by this, never by a perturber's name.
    experiment: ClassVar[str] = ""
    #: the parameters that place an arm in its experiment: a grid's axes, or a family's kind
    axes: ClassVar[tuple[str, ...]] = ()
    #: the profiles (names or shell patterns of the config's profiles) that `toolquake replay --profiles @<name>`
    #: selects after `off`, <name> being this perturber's: the arms of its family; empty: no preset of its name
    preset_profiles: ClassVar[tuple[str, ...]] = ()
    #: the parameters `toolquake sweep` may grow, by axis name (`--axis NAME`, or `--axis <perturber>.<param>`):
    #: each one promises prefix-stable growth — the content at a larger value holds the content at a smaller one,
    #: the same additions in the same order, grown — so that a verdict along it means something (docs/sweep.md)
    numeric_axes: ClassVar[dict[str, NumericAxis]] = {}

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest | Awaitable[ChatRequest]:
        """Return the perturbed request. May be `async def` (the pipeline awaits what it returns)."""
        raise NotImplementedError  # pragma: no cover

    def stream_release(self, text: str, ctx: PerturbContext) -> int:
        """With `streams_text`: how many leading characters of the answer text streamed so far are plain text
        the client may see now (text that can no longer become part of a call)."""
        return 0

    def expected_answer(self, report: dict[str, Any], case: Any) -> str | None:
        """How this step changed the right answer to `case`, judged from what it reported when it ran:
        None when the ground truth still holds, `NO_CALL` when the right answer is now no call."""
        return None

    def answer_decodes(self, ctx: PerturbContext) -> tuple[Any, Any] | None:
        """For perturbers that turn the model's text back into calls: the (strict, lenient) decodes of the
        first choice, each with `ok`, `calls`, `error`, `detail`; grading reads them instead of the
        restored `tool_calls` (strict for BFCL's verdict, lenient for `fair`). None otherwise."""
        return None

    def injected_failures(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Tool results this step replaced with a failure, judged from its report: one {"index": message index,
        "kind": failure kind} each; the answer that follows is scored for recovery. Empty for most steps."""
        return []

    def generates_text(self) -> bool:
        """True when what this step, with its parameters, puts into the request is written by a generator model (its
        `generator_model` parameter, else the model under test itself): replay refuses such an arm with no fixed
        generator model unless `--self-rephrase`, so that every model compared sees the same text."""
        return False

    def fills_token_budget(self) -> bool:
        """True when this step grows the request to a token budget counted by the proxy's token counter (catalog
        padding by `budget_tokens`, the lengthening steps): replay and sweep refuse such arms on the estimate
        counter unless asked (`--allow-estimate`), since the estimate over-counts a model's tokens."""
        return False

    @classmethod
    def affects_grading(cls) -> bool:
        """True when grading an answer needs what this perturber did (its expected answer or its decodes)."""
        return (cls.expected_answer is not Perturber.expected_answer
                or cls.answer_decodes is not Perturber.answer_decodes)

    def restore(self, response: dict[str, Any], ctx: PerturbContext) -> dict[str, Any]:
        """Turn the upstream's complete (non-stream) response back into what the client expects."""
        return response

    def setup(self, services: Services) -> None:
        """Prepare shared resources once, when a profile using this perturber is loaded."""

    def params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
