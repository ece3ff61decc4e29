"""Where the fact a request's answer needs sits in its history (seed 003, challenge 3, settings 1 and 2).

A *needle* is an argument value of the calls the current request should produce, taken from the case's
ground truth: for a BFCL multi-turn case the calls of the turn the request is at, for a single-turn or
user case every acceptable value of every argument. A message *holds* a needle when its text contains
it: strings trimmed and compared case-insensitively as substrings, numbers by value against every
number written in the text (`5` matches `5.0`, not `15`). Lists and objects count by their leaves;
booleans, None and empty strings are no needles. Values the final user message already holds are
dropped: the answer must need the earlier message, not the question.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

#: conversation_lengthening's `fact`: which earlier message holds what the answer needs
FACT_KINDS = ("any", "user_turn", "tool_response")
#: conversation_lengthening's `needles`: the ground-truth calls whose values the fact must hold
NEEDLE_SCOPES = ("turn", "next_call")
_ROLE = {"user_turn": "user", "tool_response": "tool"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Needles:
    texts: frozenset[str] = frozenset()       # lower-cased, trimmed strings
    numbers: frozenset[float] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.texts or self.numbers)

    def found_in(self, text: str) -> list[Any]:
        """The needles `text` holds (strings first, sorted, then numbers)."""
        low = text.lower()
        hits: list[Any] = sorted(t for t in self.texts if t in low)
        if self.numbers:
            written = {float(x) for x in _NUMBER.findall(text)}
            hits += sorted(n for n in self.numbers if n in written)
        return hits

    def without(self, text: str) -> Needles:
        """These needles less the ones `text` holds."""
        held = set(self.found_in(text))
        return Needles(frozenset(t for t in self.texts if t not in held),
                       frozenset(n for n in self.numbers if n not in held))


@dataclass
class Fact:
    index: int                        # the fact message's index in the request
    located: str                      # "ground_truth" or "first_of_kind"
    needles: Needles = field(default_factory=Needles)
    found: list[Any] = field(default_factory=list)  # the needles the fact message holds
    turn: int | None = None           # the multi-turn turn the request is at


def message_text(message: dict[str, Any]) -> str:
    """A message's text as a needle search sees it; JSON content also by its decoded leaves (no escapes)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        return ""
    if content and content[0] in "[{\"":
        try:
            decoded = json.loads(content)
        except ValueError:
            return content
        return content + "\n" + "\n".join(str(v) for v in _leaves(decoded))
    return content


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None:
        yield value


def needles_of(values: Iterable[Any]) -> Needles:
    texts, numbers = set(), set()
    for v in _leaves(list(values)):
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            numbers.add(float(v))
        elif isinstance(v, str) and v.strip():
            texts.add(v.strip().lower())
    return Needles(frozenset(texts), frozenset(numbers))


def turn_of(case: Any, messages: list[dict[str, Any]], last_user: int) -> int | None:
    """The turn of a multi-turn case that a request is at: the turn whose user message is the request's last
    one (when exactly one turn has that text), else the count of user messages so far (a miss_func turn that
    reveals functions has no message of its own in the corpus and one user message in the request)."""
    users_per_turn = [sum(1 for m in turn if m.get("role") == "user") or 1 for turn in case.turns]
    last = messages[last_user].get("content")
    same = [t for t, turn in enumerate(case.turns)
            if any(m.get("role") == "user" and m.get("content") == last for m in turn)]
    if len(same) == 1:
        return same[0]
    seen = sum(1 for m in messages[: last_user + 1] if m.get("role") == "user")
    total = 0
    for t, n in enumerate(users_per_turn):
        total += n
        if seen <= total:
            return t
    return None


def expected_values(case: Any, messages: list[dict[str, Any]], last_user: int, next_call: bool = False
                    ) -> tuple[list[Any], int | None] | None:
    """(argument values of the calls this request should produce, its turn) from the case's ground truth;
    None when the case has no call ground truth (live traffic, agentic cases) or the turn cannot be told.
    `next_call`: for a multi-turn case, the values of the turn's first ground-truth call only (the call seed 003
    grades), not of all its calls."""
    gt = getattr(case, "ground_truth", None)
    if not isinstance(gt, list) or not gt:
        return None
    if all(isinstance(t, list) for t in gt):  # multi-turn: call strings per turn
        turn = turn_of(case, messages, last_user)
        if turn is None or turn >= len(gt):
            return None
        values: list[Any] = []
        for text in gt[turn][:1] if next_call else gt[turn]:
            call = _parse(text)
            if call is not None:
                values += [*call.args, *call.kwargs.values()]
        return values, turn
    if all(isinstance(c, dict) for c in gt):  # single-turn: [{name: {param: [acceptable values]}}]
        return [alt for call in gt for params in call.values() if isinstance(params, dict)
                for options in params.values() for alt in (options if isinstance(options, list) else [options])], None
    return None


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Any:
    from toolquake.bfcl.simulators import parse_call

    try:
        return parse_call(text)
    except ValueError:
        return None


def locate(kind: str, case: Any, messages: list[dict[str, Any]], last_user: int, next_call: bool = False
           ) -> Fact | str:
    """The fact message of `kind` ("user_turn" / "tool_response") before the last user message, or why there is
    none. With call ground truth: the earliest such message holding a needle (`next_call`: of the turn's first
    call, `expected_values`); without: the first of that kind."""
    role = _ROLE[kind]
    expected = expected_values(case, messages, last_user, next_call) if case is not None else None
    if expected is None:
        first = next((i for i in range(last_user) if messages[i].get("role") == role), None)
        if first is None:
            return f"no earlier {role} message"
        return Fact(first, "first_of_kind")
    values, turn = expected
    calls = "the expected next call" if next_call and turn is not None else "the expected calls"
    needles = needles_of(values).without(message_text(messages[last_user]))
    if not needles:
        return f"no value of {calls} that the final user message does not already hold"
    for i in range(last_user):
        if messages[i].get("role") == role:
            found = needles.found_in(message_text(messages[i]))
            if found:
                return Fact(i, "ground_truth", needles, found, turn)
    return f"no earlier {role} message holds a value of {calls}"


@functools.lru_cache(maxsize=None)
def filler_text(item: Any) -> str:
    """Everything a filler item writes in either setting (query, calls, results, prose), for the needle check."""
    return "\n".join([item.query, item.said, *(f"{name} {args}" for name, args in item.calls), *item.results])
