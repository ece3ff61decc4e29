"""The live report's anytime-valid intervals (scorers/aggregate.py): checked by simulation as a dashboard uses
them, looked at after every verdict. A 95 % confidence sequence must, in at least 95 % of 1,000 simulated streams,
never exclude the true value at any sample size; the fixed-sample Wilson interval monitored the same way fails
that (which shows the simulation can tell a valid interval from an invalid one)."""

from __future__ import annotations

import math
import random

from toolquake.scorers.aggregate import paired_drop_cs, rate_cs, rate_excess_cs, wilson_ci

STREAMS = 1000


def _ever_excludes(interval: list[float] | None, truth: float) -> bool:
    return interval is not None and not interval[0] <= truth <= interval[1]


def _rate_streams(p: float, length: int, interval, seed: int) -> int:
    """How many of STREAMS Bernoulli(p) streams have `interval(k, n)` exclude p at some n <= length."""
    rng = random.Random(seed)
    missed = 0
    for _ in range(STREAMS):
        k = 0
        for n in range(1, length + 1):
            k += rng.random() < p
            if _ever_excludes(interval(k, n), p):
                missed += 1
                break
    return missed


def test_rate_cs_covers_the_true_rate_at_every_sample_size_in_95_percent_of_streams() -> None:
    for p, seed in ((0.5, 1), (0.8, 2), (0.1, 3)):
        missed = _rate_streams(p, 500, rate_cs, seed)
        assert missed <= 0.05 * STREAMS, (p, missed)


def test_the_fixed_sample_wilson_interval_monitored_after_every_verdict_is_not_valid() -> None:
    # the reason for the confidence sequence: a 95 % Wilson interval read after each of 500 verdicts excludes the
    # true rate at some point in far more than 5 % of the streams
    missed = _rate_streams(0.5, 500, wilson_ci, 1)
    assert missed > 0.15 * STREAMS, missed


def _pair_streams(cells: tuple[float, float, float, float], length: int, seed: int) -> tuple[int, int]:
    """Streams of pairs drawn from (both, valid→invalid, invalid→valid, neither) probabilities: how many have the
    paired-drop sequence exclude the true drop at some point, and how many end with its upper end below 0."""
    rng = random.Random(seed)
    a, b, c, _ = cells
    truth = (a + c) / (a + b) - 1
    edges = (a, a + b, a + b + c)
    missed = detected = 0
    for _ in range(STREAMS):
        counts = [0, 0, 0, 0]
        ci = None
        for _n in range(length):
            u = rng.random()
            counts[0 if u < edges[0] else 1 if u < edges[1] else 2 if u < edges[2] else 3] += 1
            ci = paired_drop_cs(*counts)
            if _ever_excludes(ci, truth):
                missed += 1
                break
        detected += ci is not None and ci[1] < 0
    return missed, detected


def test_paired_drop_cs_covers_the_true_drop_at_every_number_of_pairs() -> None:
    # true drop (0.45 + 0.05) / (0.45 + 0.15) - 1 = -16.7 %
    missed, detected = _pair_streams((0.45, 0.15, 0.05, 0.35), 400, 4)
    assert missed <= 0.05 * STREAMS, missed
    # and it is not vacuous: after 400 pairs most streams have found the arm worse
    assert detected > 0.5 * STREAMS, detected


def test_paired_drop_cs_with_no_drop_rarely_fires() -> None:
    # an arm exactly as good as the baseline: a false alarm (upper end below 0, or lower above 0) at any time is
    # an exclusion of the true drop 0, which must stay under 5 %
    missed, _ = _pair_streams((0.5, 0.1, 0.1, 0.3), 400, 5)
    assert missed <= 0.05 * STREAMS, missed


def test_rate_excess_cs_covers_a_rate_minus_its_floor() -> None:
    rng = random.Random(6)
    p, floor = 0.3, 0.1
    missed = 0
    for _ in range(STREAMS):
        k = n = fk = fn = 0
        for _step in range(300):
            if rng.random() < 0.5:
                n += 1
                k += rng.random() < p
            else:
                fn += 1
                fk += rng.random() < floor
            if _ever_excludes(rate_excess_cs(k, n, fk, fn), p - floor):
                missed += 1
                break
    assert missed <= 0.05 * STREAMS, missed


def test_edges() -> None:
    assert rate_cs(0, 0) is None
    assert paired_drop_cs(0, 0, 0, 0) is None
    assert paired_drop_cs(0, 0, 3, 5) is None  # the baseline never valid: no ratio to take
    lo, hi = paired_drop_cs(1, 0, 0, 0)  # one pair: nothing known yet but the floor of -100 %
    assert lo == -1.0 and hi == math.inf
    # the interval narrows as pairs come in, around the observed drop
    wide = paired_drop_cs(40, 20, 5, 35)
    narrow = paired_drop_cs(400, 200, 50, 350)
    assert wide[0] < narrow[0] < -0.15 < narrow[1] < wide[1]
    assert rate_excess_cs(5, 10, 0, 0) == rate_cs(5, 10)
