"""A perturber that adds one fixed tool the client never sent, loaded as a plugin (`[server] plugins`), to
test what the proxy does when a model calls a tool the proxy invented (no embeddings or corpus needed)."""

from typing import Any

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber

ADDED = {"type": "function", "function": {"name": "zz_lookup_archive", "description": "Looks up the archive.",
                                          "parameters": {"type": "object", "properties": {}}}}


@register
class AddsTool(Perturber):
    """Puts `zz_lookup_archive` first in the request's tools."""

    name = "test_adds_tool"

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        tools: list[Any] = [ADDED, *request.tools]
        return request.replace(tools=tools)
