"""response_lengthening: pads tool responses with look-alike records until the request reaches a token budget."""

from __future__ import annotations

import json
from itertools import cycle
from typing import Any, ClassVar, Iterator

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber, Services
from toolquake.perturbers.helpers.budget import check_position, fit, learned_ratio, slot
from toolquake.perturbers.helpers.records import RecordSource, separators_of

_TOOL_ROLES = ("tool", "function")


class _Target:
    """One tool message being padded: its records (JSON) or prose blocks (plain text)."""

    def __init__(self, index: int, content: str, ctx: PerturbContext, words: str) -> None:
        self.index = index
        self.source: RecordSource | None = None
        self.prose: list[tuple[str, int]] = []
        try:
            value = json.loads(content)
        except ValueError:
            value = None
        if isinstance(value, (dict, list)):
            # LookupError when there is no array of records
            self.source = RecordSource(value, ctx.rng, separators_of(content), words=words)
            self.originals = self.source.original_texts()
        else:
            from toolquake.perturbers.helpers.filler import filler_pool

            self.prose = filler_pool(ctx.services).prose
            self.originals = [content]
        self.units: list[str] = []

    def stream(self, rng: Any) -> Iterator[tuple[str, int]]:
        if self.source is not None:
            return self.source.records()
        order = list(range(len(self.prose)))
        rng.shuffle(order)
        return (self.prose[i] for i in cycle(order))

    def render(self, position: int | float, n: int) -> tuple[str, int]:
        """The content with the first n units drawn, the original(s) after `slot` of them."""
        units = self.units[:n]
        before = slot(position, n)
        ordered = units[:before] + self.originals + units[before:]
        if self.source is not None:
            return self.source.render(ordered), before + 1
        return "\n\n".join(ordered), before + 1


@register
class ResponseLengthening(Perturber):
    """Tool responses padded to `budget_tokens` (whole request), the original record(s) first at `position`."""

    name = "response_lengthening"
    blocking: ClassVar[bool] = True
    budget_tokens: int = 20000
    #: 1-based index of the first original record, or a fraction (0.0 = first, 1.0 = last)
    position: int | float = 1
    #: "last": the last tool message; "all": every tool message (the padding is shared evenly)
    target: str = "last"

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError("budget_tokens must be positive")
        check_position(self.position)
        if self.target not in ("last", "all"):
            raise ValueError("target must be 'last' or 'all'")

    def setup(self, services: Services) -> None:
        from toolquake.perturbers.helpers.filler import filler_pool

        filler_pool(services)  # prose blocks for non-JSON responses, loaded once per process

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        counter = ctx.services.token_counter
        messages = request.messages
        wanted = [
            i for i, m in enumerate(messages) if m.get("role") in _TOOL_ROLES and isinstance(m.get("content"), str)
        ]
        if self.target == "last":
            wanted = wanted[-1:]
        targets, skipped = [], []
        # words for look-alike names: the conversation's own prose
        words = " ".join(
            m["content"] for m in messages if isinstance(m.get("content"), str) and m.get("role") not in _TOOL_ROLES
        )
        for i in wanted:
            try:
                targets.append(_Target(i, messages[i]["content"], ctx, words))
            except (LookupError, OSError, RuntimeError) as exc:  # no array of records; prose without a corpus
                skipped.append({"message": i, "reason": str(exc)[:200]})
        ctx.report.update(counter=counter.source, budget_tokens=self.budget_tokens)
        if not targets:
            ctx.report.update(
                tokens_added=0, reason="no tool message with records or text to pad", skipped_messages=skipped
            )
            return request

        def build(n: int) -> tuple[ChatRequest, list[int]]:
            new = list(messages)
            positions = []
            for k, t in enumerate(targets):
                share = n // len(targets) + (1 if k < n % len(targets) else 0)
                content, pos = t.render(self.position, share)
                new[t.index] = {**messages[t.index], "content": content}
                positions.append(pos)
            return request.replace(messages=new), positions

        base_request, _ = build(0)
        base = counter.count_request(base_request.body)

        def costs() -> Iterator[float]:
            streams = [t.stream(ctx.rng) for t in targets]
            while True:  # round-robin: the padding is shared evenly between the targets
                for t, s in zip(targets, streams):
                    text, cost = next(s)
                    t.units.append(text)
                    yield cost

        result = fit(
            counter,
            self.budget_tokens,
            base,
            costs(),
            lambda n: counter.count_request(build(n)[0].body),
            learned=learned_ratio(ctx.services, counter),
        )
        perturbed, positions = build(result.units)
        ctx.report.update(
            tokens_added=result.total - base,
            tokens_total=result.total,
            units_added=result.units,
            position=positions[-1],
            targets=len(targets),
            counts=result.counts,
        )
        if skipped:
            ctx.report["skipped_messages"] = skipped
        if result.units == 0:
            ctx.report["reason"] = "the request is already at or over the budget"
            return request
        return perturbed
