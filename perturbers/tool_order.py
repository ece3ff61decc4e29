"""tool_order: reorders the request's `tools` list with the request's seeded RNG."""

from __future__ import annotations

from typing import ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber


@register
class ToolOrder(Perturber):
    """Shuffle the toolkit (`mode="shuffle"`), or reverse it (`mode="reverse"`)."""

    name = "tool_order"
    #: `@tool_order`: order sensitivity, shuffled and reversed
    preset_profiles: ClassVar[tuple[str, ...]] = ("shuffled", "reversed")
    mode: str = "shuffle"

    def __post_init__(self) -> None:
        if self.mode not in ("shuffle", "reverse"):
            raise ValueError("mode must be 'shuffle' or 'reverse'")

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        tools = list(request.tools)
        if len(tools) < 2:
            return request
        if self.mode == "reverse":
            tools.reverse()
        else:
            original = list(tools)
            ctx.rng.shuffle(tools)
            # a shuffle that lands on the original order perturbs nothing: rotate once instead
            if tools == original:
                tools = tools[1:] + tools[:1]
        ctx.report["order"] = [t.get("function", {}).get("name") for t in tools]
        return request.replace(tools=tools)
