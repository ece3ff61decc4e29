"""conversation_lengthening: earlier turns from other corpus cases until the request reaches a token budget.

With `fact` = "user_turn" / "tool_response" (seed 003 challenge 3, settings 1 and 2) the filler goes after the
turn of the earlier message that holds what the answer needs, so the model must recall it across the filler."""

from __future__ import annotations

import string
from typing import Any, ClassVar, Iterator

from toolquake.perturbers import register
from toolquake.perturbers.base import NOT_PERTURBED, ChatRequest, NumericAxis, PerturbContext, Perturber, Services
from toolquake.perturbers.helpers.lengthening.budget import check_position, fit, learned_ratio, slot
from toolquake.perturbers.helpers.lengthening.facts import FACT_KINDS, NEEDLE_SCOPES, Fact, filler_text, locate
from toolquake.perturbers.helpers.lengthening.filler import SETTINGS, FillerItem, filler_pool
from toolquake.perturbers.helpers.tokens import counter_label

_LEADING = ("system", "developer")


@register
class ConversationLengthening(Perturber):
    """Filler turns before the last user message; the conversation's own history starts at `position`, or with
    `fact`, the filler follows the earlier user turn / tool response that holds what the answer needs."""

    name = "conversation_lengthening"
    experiment = "conversation_size"
    axes = ("budget_tokens", "setting", "fact")
    #: the filler turns come from one seeded stream, taken from its start: a larger budget keeps the turns of a
    #: smaller one, in the same order, and adds more after them
    numeric_axes: ClassVar[dict[str, NumericAxis]] = {
        "conversation_tokens": NumericAxis("budget_tokens", "tokens in the request", default_min=0,
                                           default_max=80000, default_step=1000),
    }
    blocking: ClassVar[bool] = True
    budget_tokens: int = 20000
    #: "unstructured": user/assistant prose turns; "structured": assistant tool calls with tool results
    setting: str = "unstructured"
    #: where the request's own earlier turns (the informative ones) sit among the filler turns:
    #: 1-based index, or a fraction (0.0 = first, 1.0 = just before the last user message)
    position: int | float = 1
    #: "any": the history kept together at `position`; "user_turn" / "tool_response": the filler right after the
    #: earlier user message / tool response that holds a value of the expected calls (seed 003 settings 1 / 2)
    fact: str = "any"
    #: with `fact`, whose values the fact must hold: "turn" (any ground-truth call of the request's turn) or
    #: "next_call" (for a multi-turn case, the turn's first ground-truth call: the call seed 003 grades)
    needles: str = "turn"

    def fills_token_budget(self) -> bool:
        return True

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError("budget_tokens must be positive")
        if self.setting not in SETTINGS:
            raise ValueError(f"setting must be one of {', '.join(SETTINGS)}")
        if self.fact not in FACT_KINDS:
            raise ValueError(f"fact must be one of {', '.join(FACT_KINDS)}")
        if self.needles not in NEEDLE_SCOPES:
            raise ValueError(f"needles must be one of {', '.join(NEEDLE_SCOPES)}")
        check_position(self.position)
        if self.fact != "any" and self.position != 1:
            raise ValueError("position applies to fact 'any' only: with a fact the filler follows the fact message")

    def setup(self, services: Services) -> None:
        filler_pool(services)  # corpus filler turns, loaded once per process

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        counter = ctx.services.token_counter
        messages = request.messages
        last_user = request.last_user_index()
        ctx.report.update(counter=counter_label(counter), budget_tokens=self.budget_tokens, setting=self.setting)
        if self.fact != "any":
            ctx.report["fact_kind"] = self.fact
        if last_user is None:
            ctx.report.update(tokens_added=0, reason="no user message")
            if self.fact != "any":
                ctx.report[NOT_PERTURBED] = "no user message"
            return request
        fact = self._fact(ctx, messages, last_user)
        if isinstance(fact, str):
            ctx.report.update(tokens_added=0, reason=fact)
            ctx.report[NOT_PERTURBED] = fact
            return request
        turns = _Turns(self.setting, self.position, fact, _filler(ctx, messages, last_user, fact),
                       _id_tag(ctx, messages), *_split(messages, last_user, fact))
        base = counter.count_request(request.body)
        result = fit(counter, self.budget_tokens, base, turns.costs(ctx.rng),
                     lambda n: counter.count_request(request.replace(messages=turns.render(n)).body),
                     learned=learned_ratio(ctx.services, counter))
        ctx.report.update(tokens_added=result.total - base, tokens_total=result.total, turns_added=result.units,
                          counts=result.counts,
                          position=(slot(self.position, result.units) + 1) if turns.history and fact is None else None)
        out = request.replace(messages=turns.render(result.units)) if result.units else request
        if fact is not None:  # the final query sits as far after the fact as the filler and the rest of the history
            between = out.messages[fact.index + 1: len(out.messages) - len(turns.tail)]
            ctx.report["tokens_between"] = counter.count_request({"messages": between}) if between else 0
        if result.units == 0:
            ctx.report["reason"] = "the request is already at or over the budget"
        return out

    def _fact(self, ctx: PerturbContext, messages: list[dict[str, Any]], last_user: int) -> Fact | str | None:
        """The earlier message that holds what the answer needs (`fact` other than "any"), or why there is none."""
        if self.fact == "any":
            return None
        fact = locate(self.fact, ctx.case, messages, last_user, next_call=self.needles == "next_call")
        if isinstance(fact, str):
            return fact
        ctx.report.update(fact_located=fact.located, fact_message=fact.index)
        if fact.located == "ground_truth":
            ctx.report["needles_found"] = [str(v)[:80] for v in fact.found[:5]]
        if fact.turn is not None:
            ctx.report["turn"] = fact.turn
        return fact


def _split(messages: list[dict[str, Any]], last_user: int, fact: Fact | None
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(head, history, tail): the leading system/developer messages (with a fact: up to the end of the fact's
    turn), the earlier turns the filler is placed among, the last user message and what follows it."""
    lead = 0
    while lead < last_user and messages[lead].get("role") in _LEADING:
        lead += 1
    head, history, tail = messages[:lead], messages[lead:last_user], messages[last_user:]
    if fact is not None:  # the fact's whole turn (its replies, calls and results) first, then the filler:
        # the filler starts at the next user message, so roles keep alternating as in the original
        cut = fact.index + 1
        while cut < last_user and messages[cut].get("role") != "user":
            cut += 1
        head, history = messages[:cut], messages[cut:last_user]
    return head, history, tail


def _filler(ctx: PerturbContext, messages: list[dict[str, Any]], last_user: int, fact: Fact | None
            ) -> list[FillerItem]:
    """The corpus turns that may pad this request: none from its own case or with its final query, none holding
    what the answer needs."""
    pool = filler_pool(ctx.services)
    final_query = messages[last_user].get("content")
    case_id = getattr(ctx.case, "id", None)
    items = [it for it in pool.items if it.query != final_query and it.case_id != case_id]
    if fact is not None and fact.needles:  # no filler turn may hold what the answer needs
        items = [it for it in items if not fact.needles.found_in(filler_text(it))]
    return items


class _Turns:
    """The filler as `fit` sees it: turns drawn from the items (a fresh shuffle each time they run out), and the
    conversation with the first n of them placed among its own turns."""

    def __init__(self, setting: str, position: int | float, fact: Fact | None, items: list[FillerItem], tag: str,
                 head: list[dict[str, Any]], history: list[dict[str, Any]], tail: list[dict[str, Any]]) -> None:
        self.setting, self.position, self.fact, self.items, self.tag = setting, position, fact, items, tag
        self.head, self.history, self.tail = head, history, tail
        self.units: list[FillerItem] = []

    def costs(self, rng: Any) -> Iterator[float]:
        items, setting_index = self.items, SETTINGS.index(self.setting)
        order = list(range(len(items)))
        while True:
            rng.shuffle(order)
            for i in order:
                self.units.append(items[i])
                yield items[i].costs[setting_index]

    def render(self, n: int) -> list[dict[str, Any]]:
        turns, serial = [], 0
        for item in self.units[:n]:
            ids = [f"call_{self.tag}{serial + j:06d}" for j in range(len(item.calls))]
            serial += len(item.calls)
            turns.append(item.messages(self.setting, ids))
        before = slot(self.position, n) if self.history and self.fact is None else n
        out = list(self.head)
        for turn in turns[:before]:
            out += turn
        out += self.history
        for turn in turns[before:]:
            out += turn
        return out + self.tail


def _id_tag(ctx: PerturbContext, messages: list[dict[str, Any]]) -> str:
    """Four letters for this request's filler tool_call ids, clashing with no id already there."""
    existing = {str(c.get("id")) for m in messages for c in (m.get("tool_calls") or []) if isinstance(c, dict)}
    existing |= {str(m.get("tool_call_id")) for m in messages if m.get("tool_call_id")}
    while True:
        tag = "".join(ctx.rng.choice(string.ascii_lowercase) for _ in range(4))
        if not any(e.startswith(f"call_{tag}") for e in existing):
            return tag
