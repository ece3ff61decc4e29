"""Remedies for tests only, loaded as a plugin (`[server] plugins`): a tool filter that keeps the first (or last) k
tools and says which it dropped, one that always raises, one with an operator-only parameter."""

from __future__ import annotations

from typing import Any, ClassVar

from toolquake.remedies import register
from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy


@register
class KeepTools(Remedy):
    """Keeps the first `k` tools of the request it is given (the last `k` with `from_end`)."""

    name = "test_keep_tools"
    k: int = 1
    from_end: bool = False

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        tools = request.tools[::-1] if self.from_end else request.tools
        kept, dropped = tools[:self.k], tools[self.k:]
        if self.from_end:
            kept = kept[::-1]
        ctx.report.update(kept=len(kept), dropped=[str((t.get("function") or {}).get("name")) for t in dropped],
                          k=self.k, draw=ctx.rng.random())
        return request.replace(tools=list(kept))

    def dropped_tools(self, report: dict[str, Any]) -> list[str]:
        return [str(n) for n in report.get("dropped") or []]


@register
class RemedyRaises(Remedy):
    """Raises on every request."""

    name = "test_remedy_raises"

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        raise RuntimeError("this remedy always fails")


@register
class RemedyWithHost(Remedy):
    """A remedy with an operator-only parameter (a host), changing nothing."""

    name = "test_remedy_host"
    operator_only: ClassVar[frozenset[str]] = frozenset({"url"})
    url: str = ""

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request
