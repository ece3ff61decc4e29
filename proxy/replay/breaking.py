"""Breaking points: where along a grid of intensities a case's verdict turns from right to wrong.

Pure functions of the verdicts seen so far, shared by the sweep (which asks `next_point` what to send next) and the
report (which reads the same verdicts back with `outcome`). Because the next point depends on nothing but the
verdicts already recorded, a sweep killed at any moment resumes exactly where it stopped: the recorded verdicts
replay the same decisions, and only the missing points are sent.

The order of the questions, on a grid of n points (indices 0 … n − 1):

1. the maximum (right there: the case survives the whole range, "censored"), then the minimum (wrong there: it
   breaks at once);
2. bisection between the largest index known right below the smallest index known wrong, and that wrong index,
   until they are neighbours — about log2(n) points;
3. confirmation: the checkpoints at every eighth of the range not yet asked. A wrong checkpoint below the
   boundary moves it down (bisected again: the breaking point is the *first* drop the sweep saw); a right one
   above it marks the case non-monotone (right again after breaking). Neither is hidden.

With n = 201 that is 2 + 8 + at most 7 points, usually 14 or 15.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: confirmation checkpoints at k / CHECKS of the range, k = 1 … CHECKS − 1
CHECKS = 8


def grid(low: float, high: float, step: float, integer: bool) -> list[float]:
    """The intensities low, low + step, …, up to high (high itself always included)."""
    if step <= 0:
        raise ValueError("the resolution must be positive")
    if high < low:
        raise ValueError(f"--max ({high:g}) is below --min ({low:g})")
    count = int(math.floor((high - low) / step + 1e-9))
    points = [low + i * step for i in range(count + 1)]
    if points[-1] < high - 1e-9:
        points.append(high)
    if integer:
        return list(dict.fromkeys(int(round(p)) for p in points))
    return [round(p, 9) for p in points]


def checkpoints(n: int) -> list[int]:
    return sorted({round(k * (n - 1) / CHECKS) for k in range(1, CHECKS)} - {0, n - 1}) if n > 2 else []


def _boundary(known: dict[int, bool]) -> tuple[int | None, int | None]:
    """(largest right index below the smallest wrong one, that smallest wrong index); None where there is none."""
    wrong = min((i for i, ok in known.items() if not ok), default=None)
    right = max((i for i, ok in known.items() if ok and (wrong is None or i < wrong)), default=None)
    return right, wrong


def next_point(n: int, known: dict[int, bool]) -> int | None:
    """The grid index to ask next given the verdicts `known` (index → right), or None when the case is done."""
    if n < 1:
        return None
    for first in (n - 1, 0):
        if first not in known:
            return first
    right, wrong = _boundary(known)
    if right is not None and wrong is not None and wrong - right > 1:
        return (right + wrong) // 2
    return next((c for c in checkpoints(n) if c not in known), None)


@dataclass(frozen=True)
class Outcome:
    """What the verdicts say: the last index right before the first break and the first wrong (None: right even
    at the maximum, or wrong already at the minimum); the indices right again after the break (non-monotone);
    whether the case is finished."""

    last_right: int | None
    first_wrong: int | None
    right_after: tuple[int, ...]
    done: bool

    @property
    def censored(self) -> bool:
        return self.first_wrong is None and self.last_right is not None


def outcome(n: int, known: dict[int, bool]) -> Outcome:
    right, wrong = _boundary(known)
    after = tuple(sorted(i for i, ok in known.items() if ok and wrong is not None and i > wrong))
    return Outcome(right, wrong, after, next_point(n, known) is None)


def verdict(trials: list[bool], rule: str) -> bool:
    """A point's verdict from its trials: `majority` (more than half right) or `all` (every one right)."""
    if rule == "all":
        return all(trials)
    if rule == "majority":
        return 2 * sum(trials) > len(trials)
    raise ValueError(f"unknown rule {rule!r} (majority or all)")


def remedy_moves(remedies: list[str], before: float | None, after: float | None, high: float, unit: str) -> str:
    """The sentence a sweep with a remedy ends on: "with tool_search the median breaking point moves from 40 to 600
    tools" (a median above the grid, more than half the cases right at the maximum, as "above <max>")."""
    def shown(x: float | None) -> str:
        return f"above {high:g}" if x is None else f"{x:g}"

    verb = "stays at" if before == after else "moves from"
    where = shown(after) if before == after else f"{shown(before)} to {shown(after)}"
    return f"with {' + '.join(remedies)} the median breaking point {verb} {where} {unit}".rstrip()
