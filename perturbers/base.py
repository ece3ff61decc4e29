"""The perturber interface: a typed request in, a new request out, an optional restore.

A perturber is a msgspec Struct whose public fields are its parameters (decoded from a profile's
`params` table, unknown keys rejected). It never sees HTTP. It must not mutate the request it is
given: it builds a new one with `request.replace(...)` and shallow copies of what it changes.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec


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

    `token_counter` counts tokens of a request (see perturbers/tokens.py); `extra` holds other
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

    seed: int
    rng: random.Random
    services: Services
    case: Any = None
    #: facts a perturber reports about what it did (e.g. tokens_added), keyed by fact name
    report: dict[str, Any] = field(default_factory=dict)
    #: state a perturber keeps between apply() and restore() of the same request
    state: dict[str, Any] = field(default_factory=dict)


class Perturber(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base class. Subclasses set `name`, declare their parameters as fields, implement `apply`."""

    name: ClassVar[str] = ""
    #: True when `restore` must rewrite the upstream's answer (streams are then rebuilt)
    rewrites_response: ClassVar[bool] = False

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:  # pragma: no cover
        raise NotImplementedError

    def restore(self, response: dict[str, Any], ctx: PerturbContext) -> dict[str, Any]:
        """Turn the upstream's complete (non-stream) response back into what the client expects."""
        return response

    def setup(self, services: Services) -> None:
        """Prepare shared resources once, when a profile using this perturber is loaded."""

    def params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
