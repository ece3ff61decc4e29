"""tool_removal: removes the tool the request needs, so the right behaviour becomes "no call" (seed 004
miss_func; BFCL irrelevance)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from toolquake.bfcl.convert import openai_name
from toolquake.perturbers import register
from toolquake.perturbers.base import NO_CALL, ChatRequest, PerturbContext, Perturber
from toolquake.perturbers.helpers.toolkit.tool_pool import tool_name

EXPECTED = "expected"
RANDOM = "random"
_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


def expected_functions(case: Any) -> list[str]:
    """Names of the functions a case's ground truth calls: single-turn `[{name: {...}}]` entries, or
    multi-turn call strings `"name(args)"`, at any nesting."""
    names: list[str] = []

    def walk(item: Any) -> None:
        if isinstance(item, dict):
            names.extend(k for k in item if isinstance(k, str))
        elif isinstance(item, str):
            m = _CALL.match(item)
            if m:
                names.append(m.group(1))
        elif isinstance(item, (list, tuple)):
            for sub in item:
                walk(sub)

    walk(getattr(case, "ground_truth", None))
    return list(dict.fromkeys(names))


def _matches(tool: dict[str, Any], wanted: set[str]) -> bool:
    """OpenAI names have dots replaced by underscores; a wanted name matches in either spelling."""
    return tool_name(tool).replace(".", "_") in {w.replace(".", "_") for w in wanted}


def _expectation(which: str, removed: list[str], case: Any) -> str:
    """What the right answer becomes: `no_call` when a tool the ground truth calls was removed,
    `same_call` when the case is known and it was not, `unknown` without a case."""
    if which == EXPECTED:
        return "no_call"
    if case is None:
        return "unknown"
    wanted = {w.replace(".", "_") for w in expected_functions(case)}
    return "no_call" if any(n.replace(".", "_") in wanted for n in removed) else "same_call"


@register
class ToolRemoval(Perturber):
    """Removes tools from the request: `which="expected"` the ones the case's ground truth calls (the
    case must be known), `"random"` one tool chosen with the request's perturbation seed, or a tool name. What was
    removed is reported, with `expect`: `no_call` when the case's tool is gone (scored as irrelevance)."""

    name = "tool_removal"
    #: `@tool_removal`: the target tool removed (the right answer is no call), or a random one
    preset_profiles: ClassVar[tuple[str, ...]] = ("no-target-tool", "random-tool-removed")
    which: str = EXPECTED

    def __post_init__(self) -> None:
        if not self.which.strip():
            raise ValueError("which must be 'expected', 'random' or a tool name")

    def expected_answer(self, report: dict[str, Any], case: Any) -> str | None:
        """No call, when a tool the case's ground truth calls was removed (or the report does not say what
        was removed: then it was the expected tool, this perturber's default)."""
        removed = report.get("removed")
        if not isinstance(removed, list):
            return NO_CALL
        wanted = set(expected_functions(case))
        wanted |= {openai_name(n) for n in wanted}
        return NO_CALL if any(str(n) in wanted for n in removed) else None

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        tools = list(request.tools)
        if self.which == EXPECTED:
            if ctx.case is None:
                raise LookupError(
                    "which='expected' needs the BFCL case: send X-Toolquake-Case or serve with "
                    "a corpus so the case is resolved"
                )
            wanted = set(expected_functions(ctx.case))
            if not wanted:
                raise LookupError(f"case {getattr(ctx.case, 'id', '?')} has no ground-truth call to remove")
            removed = [t for t in tools if _matches(t, wanted)]
        elif self.which == RANDOM:
            removed = [ctx.rng.choice(tools)] if tools else []
        else:
            removed = [t for t in tools if _matches(t, {self.which})]
        names = [tool_name(t) for t in removed]
        ctx.report.update(
            {
                "which": self.which,
                "removed": names,
                "tools_before": len(tools),
                "tools_after": len(tools) - len(removed),
            }
        )
        if not removed:
            return request
        ctx.report["expect"] = _expectation(self.which, names, ctx.case)
        kept = [t for t in tools if not any(t is r for r in removed)]
        fields: dict[str, Any] = {"tools": kept or None}
        choice = request.body.get("tool_choice")
        if not kept:
            # an empty `tools` list is invalid for OpenAI-compatible servers: drop the tool fields
            fields.update(tool_choice=None, parallel_tool_calls=None)
        elif isinstance(choice, dict) and (choice.get("function") or {}).get("name") in names:
            # the client forced the removed tool: let the model choose instead
            fields["tool_choice"] = "auto"
            ctx.report["tool_choice"] = "auto"
        return request.replace(**fields)
