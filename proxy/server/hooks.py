"""The one interface the request path traces through (`[tracing]`, docs/tracing.md): `Tracer`, the server's
(`ProxyState.tracing`), and `TraceHooks`, one request's trace (`Served.trace`). Both do nothing here: a server no
tracer was attached to keeps this `Tracer`, whose `begin` gives no trace. The tracing wing
(`toolquake.proxy.tracing`, attached as an extension: `create_app(config, extensions=[tracing.attach, ...])`)
subclasses them; the server, live scoring and shadow twins call these methods and never import the wing.

A request's trace: `begin` when it arrives, `sending` for the headers that carry its context upstream, the answer's
attributes (`answered`, `relayed`, `checked`, `client_got`, `tools_answered`, `conformance`), `finish` at its last
byte; what is judged after that byte (a check, a verdict, a twin) `hold`s it and `release`s it, and the last
release ends it. Every method fails open: it never raises into the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served


class TraceHooks:
    """One request's trace, as the request path sees it (no-op). `sampled`: its span records (the answer's
    attributes are read only then)."""

    __slots__ = ()
    sampled = False

    def sending(self, asked: Asked, served: Served, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The request goes upstream: the headers to send (carrying the upstream call's context)."""
        return headers

    def answered(self, asked: Asked, served: Served, answer: dict[str, Any] | None) -> None:
        """The final answer (chat-shaped), as the client got it."""

    def relayed(self, asked: Asked, data: bytes) -> None:
        """The answer's bytes as relayed to the client (a request passed through)."""

    def checked(self, asked: Asked, data: bytes) -> Any:
        """A whole answer's bytes (passed through), read in the proxy's check that they are a JSON object: the
        decode the check looks at (None: the check decodes them itself)."""
        return None

    def client_got(self, wire: dict[str, Any]) -> None:
        """A rewritten answer in the client's wire form (the response id the client sees)."""

    def tools_answered(self, calls: list[dict[str, Any]]) -> None:
        """Calls to tools the proxy added, answered by the proxy itself."""

    def conformance(self, rules: list[str]) -> None:
        """The answer was checked (after its last byte): the rules it broke."""

    def call(self, name: str, asked: Asked, headers: Iterable[tuple[str, str]], attributes: dict[str, Any],
             outcome: Any = None) -> tuple[Any, list[tuple[str, str]]]:
        """A call the proxy makes upstream for this request (a follow-up, a shadow twin carrying the perturbation
        `outcome`): a handle for `called`, and the headers that carry its context to the backend."""
        return None, list(headers)

    def called(self, span: Any, status: int, answer: dict[str, Any] | None = None,
               attributes: dict[str, Any] | None = None) -> None:
        """`call`'s answer came back (or failed: status 0)."""

    def scored(self, name: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        """A verdict (from the scoring thread), with its perf_counter() times."""

    def note(self, attributes: dict[str, Any]) -> None:
        """Attributes judged after the last byte; from any thread."""

    def finish(self, asked: Asked, served: Served) -> None:
        """The request's last byte was sent (or it was refused)."""

    def hold(self) -> None:
        """Something will still add to this trace after the last byte (a check, a verdict, a twin)."""

    def release(self) -> None:
        """What held the trace is done with it."""


class Tracer:
    """The server's tracer, as the request path sees it (no-op: no request is traced). `contents`: spans carry
    prompts and answers (the request is then decoded, and the answer read whole)."""

    contents = False

    def begin(self, headers: list[tuple[str, str]], t0: float) -> TraceHooks | None:
        """The trace of a model request that just arrived (its headers, its perf_counter() arrival), or None."""
        return None

    def use_redactor(self, redact: Callable[[Any], Any]) -> None:
        """How contents are redacted before they are exported (set by live scoring, which owns the redactor)."""
