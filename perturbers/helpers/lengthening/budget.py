"""Fitting filler to a token budget: how many filler units bring a request to `budget` tokens.

Every filler unit comes with its cost under the `estimate` counter, measured the way that counter
sees it inside the request (JSON-escaped, with its separator). That counter is additive over JSON
pieces, so for it the sum of the unit costs *is* the request's count: one pass, no recount. Any
other counter (a backend's tokenizer) uses those costs as weights: the whole request is counted,
the weights are rescaled by what the counter said, and the number of units is corrected until the
count is within `tolerance` of the budget (a few counts at most).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import msgspec

from toolquake.perturbers.helpers.tokens import EstimateCounter

_ESTIMATE = EstimateCounter()
_encode = msgspec.json.encode


def escaped(text: str) -> str:
    """`text` as it appears inside a JSON string (what a counter of the encoded request sees)."""
    return _encode(text).decode()[1:-1]


def text_cost(text: str) -> int:
    """Estimate-counter tokens of `text` once it is embedded in a JSON string of the request."""
    return _ESTIMATE.count_text(escaped(text))


def messages_cost(messages: list[dict[str, Any]]) -> int:
    """Estimate-counter tokens that inserting these messages into a request's list adds (the comma
    joining them to their neighbours included)."""
    return _ESTIMATE.count_text(_encode(messages).decode()[1:-1]) + 1


def is_additive(counter: Any) -> bool:
    """True for the counter whose count of a request is exactly the sum of the estimated unit costs."""
    return getattr(counter, "source", None) == "estimate"


@dataclass
class Fit:
    units: int          # how many filler units were used
    total: int          # the request's token count with them, by the counter used
    base: int           # the count without them
    counts: int         # how many full-request counts it took (0 for the estimate counter)


class _Prefix:
    """Cumulative costs of a lazily drawn unit stream."""

    def __init__(self, costs: Iterator[float]) -> None:
        self._costs = costs
        self.sums: list[float] = [0.0]
        self.exhausted = False

    def _grow(self) -> bool:
        if self.exhausted:
            return False
        try:
            self.sums.append(self.sums[-1] + next(self._costs))
            return True
        except StopIteration:
            self.exhausted = True
            return False

    def units_for(self, need: float, scale: float) -> int:
        """The number of units whose scaled cost is closest to `need`."""
        target = need / scale
        while self.sums[-1] < target and self._grow():
            pass
        n = bisect.bisect_left(self.sums, target)
        if n >= len(self.sums):
            return len(self.sums) - 1
        if n > 0 and target - self.sums[n - 1] < self.sums[n] - target:
            n -= 1
        return n


#: how far from its budget a lengthened request may land, as a share of the budget
TOLERANCE = 0.02


def within_budget(total: int, budget: int) -> bool:
    """A request of `total` tokens holds a budget of `budget` (within `TOLERANCE`)."""
    return abs(total - budget) <= TOLERANCE * budget


def fit(counter: Any, budget: int, base: int, costs: Iterator[float], measure: Callable[[int], int],
        tolerance: float = TOLERANCE, max_counts: int = 5, learned: dict[str, float] | None = None) -> Fit:
    """Choose how many units (taken in stream order) bring the request to `budget` tokens.

    `base` is the request's count without filler, by `counter`; `costs` yields each unit's
    estimate cost; `measure(n)` counts the whole request built with the first n units (called
    only for counters that are not additive). The stream may end early: then every unit is used.
    `learned` keeps the counter's ratio to the estimate between calls (see `learned_ratio`), so
    the first count usually lands within tolerance.
    """
    need = budget - base
    if need <= 0:
        return Fit(0, base, base, 0)
    prefix = _Prefix(costs)
    n = prefix.units_for(need, 1.0)
    if is_additive(counter):
        return Fit(n, base + round(prefix.sums[n]), base, 0)
    total, counts, best = base, 0, (abs(need), 0, base)
    scale = learned.get("scale", 1.0) if learned is not None else 1.0
    n = prefix.units_for(need, scale)
    while counts < max_counts:
        total = measure(n)
        counts += 1
        best = min(best, (abs(total - budget), n, total))
        if n > 0 and learned is not None:
            learned["scale"] = max((total - base) / prefix.sums[n], 1e-6)
        if abs(total - budget) <= tolerance * budget or n == 0:
            break
        scale = max((total - base) / prefix.sums[n], 1e-6)
        nxt = prefix.units_for(need, scale)
        if nxt == n:
            break
        n = nxt
    _, n, total = best
    return Fit(n, total, base, counts)


def check_position(position: int | float) -> None:
    """ValueError unless `position` is a 1-based index (int >= 1) or a fraction (float in [0, 1])."""
    if isinstance(position, float):
        if not 0.0 <= position <= 1.0:
            raise ValueError(f"position as a fraction must be between 0 and 1, got {position}")
    elif position < 1:
        raise ValueError(f"position as an index is 1-based, got {position}")


def slot(position: int | float, fillers: int) -> int:
    """How many filler units go before the informative one: a 1-based index (clamped to what the
    budget allows) or a fraction of the filler units."""
    if isinstance(position, float):
        return round(position * fillers)
    return min(position - 1, fillers)


def learned_ratio(services: Any, counter: Any) -> dict[str, float]:
    """A per-process memory of how `counter` compares with the estimate (shared by all requests)."""
    return services.get(f"budget_ratio:{getattr(counter, 'key', counter.source)}", dict)
