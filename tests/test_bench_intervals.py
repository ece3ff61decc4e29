"""The benchmarks' interval for a median of paired rounds (tests/bench/tracing_overhead.py `median_interval`)."""

from __future__ import annotations

import random
from fractions import Fraction
from math import comb

from tests.bench.tracing_overhead import median_interval


def _coverage(n: int, k: int) -> Fraction:
    """P(the k-th smallest of n continuous values <= their median <= the k-th largest), exactly."""
    below = sum(Fraction(comb(n, j), 2 ** n) for j in range(k))  # fewer than k values below the median
    return 1 - 2 * below


def test_the_interval_is_the_tightest_pair_of_order_statistics_that_covers_95_percent():
    for n in range(6, 41):
        values = [float(v) for v in random.Random(n).sample(range(1000), n)]
        lo, hi = median_interval(values)
        ordered = sorted(values)
        k = ordered.index(lo) + 1
        assert hi == ordered[n - k], n  # symmetric
        assert _coverage(n, k) >= Fraction(95, 100), (n, k)
        assert _coverage(n, k + 1) < Fraction(95, 100), (n, k)  # one step in would not cover


def test_too_few_rounds_give_no_interval():
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 5 values: even min..max covers only 93.75 %
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)


def test_it_covers_the_median_of_skewed_noise_at_least_95_percent_of_the_time():
    rng = random.Random(7)
    for n in (7, 15):
        trials, hit = 4000, 0
        for _ in range(trials):  # exponential noise around a true median of ln 2
            lo, hi = median_interval([rng.expovariate(1.0) for _ in range(n)])
            hit += lo <= 0.6931471805599453 <= hi
        assert hit / trials >= 0.94, (n, hit / trials)
