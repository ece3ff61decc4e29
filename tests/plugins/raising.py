"""A perturber that always raises, loaded as a plugin (`[server] plugins`) to prove fail-open."""

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber


@register
class AlwaysRaises(Perturber):
    """Raises on every request."""

    name = "test_always_raises"

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        raise RuntimeError("this perturber always fails")
