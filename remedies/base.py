"""The remedy interface: a step a profile applies after its perturbations, to win accuracy back.

A remedy is what a team would put in front of its model to make it robust (keep only the tools related to the
conversation, trim a long tool response, render the tools in the format the model reads best). It has the
perturbers' shape (`perturbers/base.py`): a msgspec Struct whose public fields are its parameters (decoded from
a profile's `remedies = [{ name, params }]`, unknown keys rejected, validated when the profile loads), an `apply`
that builds a new request from the one it is given (never mutating it), seeded by `ctx.rng`, optionally `blocking`
or `async def`, and an optional `restore` of the answer (`rewrites_response`), e.g. tool names it shortened.
It runs after every perturbation step of its profile and before the request goes upstream, fail-open like them:
a remedy that raises is skipped and counted, the request goes on as the perturbations left it.

What a remedy adds to the perturber's interface is declared here: `dropped_tools` (the client's tools it took out
of the request, judged from its report, so that a needed tool it dropped is counted when the case's ground truth
is known). Nothing outside this package asks for a remedy by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber, Services

__all__ = ["ChatRequest", "PerturbContext", "Remedy", "Services"]


class Remedy(Perturber, kw_only=True, forbid_unknown_fields=True):
    """Base class. Subclasses set `name`, declare their parameters as fields, implement `apply`.

    The perturber hooks keep their meaning (`blocking`, `rewrites_response` + `restore`, `answer_decodes`,
    `streams_text`, `setup`); `experiment`, `axes` and `numeric_axes` are the perturbers' and stay empty."""

    #: what this step is in reports and metrics (a perturbation step has none)
    kind: ClassVar[str] = "remedy"

    def dropped_tools(self, report: dict[str, Any]) -> list[str]:
        """Names of the tools of the request this step received that it left out of the request it sent,
        judged from what it reported when it ran (`ctx.report`); empty for a remedy that drops none."""
        return []
