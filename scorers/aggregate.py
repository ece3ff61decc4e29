"""Aggregating verdicts into leaderboard numbers: rates and the relative drop against a baseline arm."""

from __future__ import annotations

import functools
import math

#: the error rate of every interval and test of the reports, live and replayed (95 % intervals)
ALPHA = 0.05


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


def loss_won_back(cases: list[tuple[bool, bool, bool]], z: float = 1.96
                  ) -> tuple[float | None, tuple[float, float] | None]:
    """The share of the accuracy a perturbation lost that a remedy won back, paired over cases, with Fieller's
    95 % interval: (share, (lo, hi)).

    `cases` holds one (valid off, valid perturbed, valid remedied) per case, each case scored in all three arms.
    share = (acc_remedied − acc_perturbed) / (acc_off − acc_perturbed): 1 = the whole loss won back, 0 = none,
    below 0 = the remedy lost more, above 1 = the remedied arm beat `off`. The ratio of two paired means
    x̄ / ȳ with x = remedied − perturbed and y = off − perturbed per case (each −1, 0 or 1); Fieller's interval
    is the set of θ with (x̄ − θȳ)² ≤ z² Var(x̄ − θȳ), Var from the cases' sample covariances (x and y are
    correlated: the same cases, the same perturbed verdict).

    share None: the perturbation lost nothing on these cases (acc_off ≤ acc_perturbed) — there is no loss to win
    back, and no number says so honestly. Interval None: the loss itself is not distinguishable from 0 at this
    level (ȳ² ≤ z² Var(ȳ)), so Fieller's set is unbounded; with fewer than 2 cases there is no variance either."""
    n = len(cases)
    xs = [int(r) - int(p) for _, p, r in cases]
    ys = [int(o) - int(p) for o, p, _ in cases]
    if not n or sum(ys) <= 0:
        return None, None
    mx, my = sum(xs) / n, sum(ys) / n
    share = mx / my
    if n < 2:
        return share, None
    sxx = sum((x - mx) ** 2 for x in xs) / (n - 1) / n  # variances and covariance of the two means
    syy = sum((y - my) ** 2 for y in ys) / (n - 1) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (n - 1) / n
    z2 = z * z
    a = my * my - z2 * syy
    if a <= 0:
        return share, None
    b = mx * my - z2 * sxy
    c = mx * mx - z2 * sxx
    root = math.sqrt(max(0.0, b * b - a * c))
    return share, ((b - root) / a, (b + root) / a)


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


# Anytime-valid intervals (confidence sequences) for live traffic, which is watched continuously: an interval that
# holds at a fixed sample size fails far more often than 5 % when looked at after every verdict and acted on the
# first time it excludes a value. Robbins' normal mixture (Robbins 1970; Howard, Ramdas, McAuliffe & Sekhon 2021,
# "Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 49(2), the normal-mixture
# boundary for sub-Gaussian observations): for observations in an interval of width w (sub-Gaussian with variance
# proxy w²/4) with mean mu, with probability at least 1 - alpha, for every n at once,
#     |S_n - n mu| <= sqrt((v n + rho) ln((v n + rho) / (rho alpha²)))
# (Ville's inequality on the mixture martingale). rho only decides at which n the boundary is tightest; any fixed
# choice is valid.

#: the number of observations at which the confidence sequences are tightest (their rho is tuned for it)
CS_TUNED_FOR = 100


@functools.lru_cache(maxsize=64)
def _mixture_rho(var: float, alpha: float, tuned_for: int) -> float:
    """The rho that makes the normal-mixture boundary tightest at `tuned_for` observations: rho = v t / u, with u
    the root of u = 2 ln(1/alpha) + ln(1 + u) (the boundary's derivative in rho set to zero)."""
    c = 2.0 * math.log(1.0 / alpha)
    u = c + 1.0
    for _ in range(60):  # a contraction (slope 1/(1+u) < 1/6): converged long before
        u = c + math.log1p(u)
    return var * tuned_for / u


def mixture_radius(n: int, var: float, alpha: float, tuned_for: int = CS_TUNED_FOR) -> float:
    """Half-width around the running mean of n observations of the two-sided normal-mixture confidence sequence
    (variance proxy `var`), valid at every n at once with probability 1 - alpha."""
    rho = _mixture_rho(var, alpha, tuned_for)
    v = var * n + rho
    return math.sqrt(v * math.log(v / (rho * alpha * alpha))) / n


def rate_cs(k: int, n: int, alpha: float = 0.05) -> list[float] | None:
    """Anytime-valid interval [lo, hi] for a rate after k successes in n trials (variance proxy 1/4, the widest a
    0/1 observation has); None when n is 0. Looked at after every trial, it excludes the true rate at any time with
    probability at most alpha."""
    if n <= 0:
        return None
    if not 0 <= k <= n:
        raise ValueError(f"rate_cs: need 0 <= k <= n, got k={k}, n={n}")
    r = mixture_radius(n, 0.25, alpha)
    return [max(0.0, k / n - r), min(1.0, k / n + r)]


def paired_drop_cs(both: int, base_only: int, arm_only: int, neither: int,
                   alpha: float = 0.05) -> list[float] | None:
    """Anytime-valid interval for the relative drop acc_arm / acc_base - 1 on paired cases (the counts of
    `paired_drop_ci`), valid at every number of pairs at once. With D the chance that a pair is discordant and q
    the chance that a discordant pair is one the arm lost (valid→invalid), the drop is D (1 - 2q) / acc_base:
    its sign is q's side of 1/2, read from the discordant pairs alone as McNemar's test reads it (concordant
    pairs say nothing about it). Confidence sequences for q (alpha/2, over the discordant pairs), D and acc_base
    (alpha/4 each, over all pairs), combined by the union bound. The upper end is `math.inf` while the baseline's
    accuracy may still be 0. None before the first pair, or while the baseline has no success (no ratio)."""
    n = both + base_only + arm_only + neither
    if n <= 0 or both + base_only == 0:
        return None
    q_lo, q_hi = rate_cs(base_only, base_only + arm_only, alpha / 2) or [0.0, 1.0]
    s_lo, s_hi = 1.0 - 2.0 * q_hi, 1.0 - 2.0 * q_lo  # the sign factor 1 - 2q
    d_lo, d_hi = rate_cs(base_only + arm_only, n, alpha / 4) or [0.0, 1.0]
    b_lo, b_hi = rate_cs(both + base_only, n, alpha / 4) or [0.0, 1.0]
    num_lo = s_lo * (d_hi if s_lo < 0 else d_lo)  # the arm's accuracy minus the baseline's
    num_hi = s_hi * (d_lo if s_hi < 0 else d_hi)
    if num_lo < 0:
        lo = -1.0 if b_lo <= 0 else num_lo / b_lo
    else:
        lo = num_lo / b_hi
    if num_hi > 0:
        hi = math.inf if b_lo <= 0 else num_hi / b_lo
    else:
        hi = num_hi / b_hi
    return [max(-1.0, lo), hi]


def rate_excess_cs(k: int, n: int, floor_k: int, floor_n: int, alpha: float = 0.05) -> list[float] | None:
    """Anytime-valid interval for a rate minus a floor rate measured on other trials (a shadow profile's
    disagreement minus the model's own, from its noise twins): confidence sequences at alpha/2 for each, their
    difference's extremes (union bound). Without floor trials, the rate's own interval (the floor taken as 0).
    None when n is 0."""
    if n <= 0:
        return None
    if floor_n <= 0:
        return rate_cs(k, n, alpha)
    lo, hi = rate_cs(k, n, alpha / 2) or [0.0, 1.0]
    f_lo, f_hi = rate_cs(floor_k, floor_n, alpha / 2) or [0.0, 1.0]
    return [lo - f_hi, hi - f_lo]
