"""Aggregating verdicts into leaderboard numbers: rates and the relative drop against a baseline arm."""

from __future__ import annotations

import math


def ratio(num: int, den: int) -> float | None:
    """num / den, or None when there is nothing to divide by."""
    return num / den if den else None


def relative_drop(acc: float | None, base: float | None) -> float | None:
    """(acc - base) / base, seed 001 Table 2's bracketed figure; None without a (non-zero) baseline."""
    if acc is None or not base:
        return None
    return (acc - base) / base


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (95 % with z = 1.96); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # clamp the rounding noise at the ends (k = 0 gives exactly 0, k = n exactly 1)
    return max(0.0, centre - half) if k else 0.0, min(1.0, centre + half) if k < n else 1.0


def wilson_ci(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """`wilson` as a JSON-friendly [lo, hi], or None when there is nothing to estimate (n = 0)."""
    return list(wilson(k, n, z)) if n > 0 else None


def mcnemar(b: int, c: int) -> float:
    """McNemar's exact test: two-sided binomial p-value of b vs c discordant pairs under p = 1/2.

    b = pairs valid in the baseline and invalid in the arm, c = the reverse. 1.0 with no discordant pair.
    """
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_drop_ci(both: int, base_only: int, arm_only: int, neither: int,
                   z: float = 1.96) -> tuple[float, float] | None:
    """Approximate 95 % interval for the relative drop acc_arm / acc_base - 1 on paired cases.

    Counts: `both` valid in both arms, `base_only` valid in the baseline only (valid→invalid),
    `arm_only` valid in the arm only (invalid→valid), `neither`. Delta method on the log of the ratio
    of paired proportions, Var ln R ≈ (b + c) / ((a + b)(a + c)), with 0.5 added to each of the four
    cells (so that no flip, or an arm that is never valid, still gives an interval of honest width).
    None when the baseline is never valid on these cases (no ratio to take). At the edges the smoothed
    interval can miss the raw estimate (every baseline success lost: −100 %, or none lost: +0 %); the
    interval is then widened to hold it, so a reported drop always lies inside its own interval.
    """
    if both + base_only == 0:
        return None
    a, b, c = (x + 0.5 for x in (both, base_only, arm_only))  # `neither` does not enter the ratio
    log_ratio = math.log((a + c) / (a + b))
    se = math.sqrt((b + c) / ((a + b) * (a + c)))
    raw = (both + arm_only) / (both + base_only) - 1
    return min(math.exp(log_ratio - z * se) - 1, raw), max(math.exp(log_ratio + z * se) - 1, raw)


def pass_hat_k(counts: list[tuple[int, int]], k: int) -> float | None:
    """tau-bench's pass^k: the chance that k trials drawn without replacement from a case's n are all right,
    averaged over cases — mean of C(c, k) / C(n, k) over `counts` [(n trials, c right), ...]. Cases with
    fewer than k trials are left out; None when none is left."""
    usable = [(n, c) for n, c in counts if n >= k]
    if k < 1 or not usable:
        return None
    return sum(math.comb(c, k) / math.comb(n, k) for n, c in usable) / len(usable)


def pass_at_k(counts: list[tuple[int, int]], k: int) -> float | None:
    """pass@k: the chance that at least one of k trials drawn from a case's n is right, averaged over
    cases — mean of 1 - C(n - c, k) / C(n, k). Same conventions as `pass_hat_k`."""
    usable = [(n, c) for n, c in counts if n >= k]
    if k < 1 or not usable:
        return None
    return sum(1 - math.comb(n - c, k) / math.comb(n, k) for n, c in usable) / len(usable)


def spread(values: list[float]) -> dict[str, float | None]:
    """mean, sample standard deviation (n - 1), min and max of `values` (None where undefined)."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}
