"""Aggregating verdicts into leaderboard numbers: rates and the relative drop against a baseline arm."""

from __future__ import annotations


def ratio(num: int, den: int) -> float | None:
    """num / den, or None when there is nothing to divide by."""
    return num / den if den else None


def relative_drop(acc: float | None, base: float | None) -> float | None:
    """(acc - base) / base, seed 001 Table 2's bracketed figure; None without a (non-zero) baseline."""
    if acc is None or not base:
        return None
    return (acc - base) / base
