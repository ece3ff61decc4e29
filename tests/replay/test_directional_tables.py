"""Seed 003 Tables 1 and 5 (#47): the paper's % degradation is directional — from the shortest catalog to the
longest, (first − last) / first, negative when accuracy rose (Table 5 prints −20.88 for GPT-4o on live_simple) —
not (Max − Min) / Max, which is never negative. A hand-made results file, every expected figure worked out by hand
below from that definition."""

from __future__ import annotations

import csv
import io
import json

import pytest

from tests.support.report import report_text as report
from tests.support.results import perturb_arm, write_results
from toolquake.proxy.replay.store import Record

#: valid answers out of 10 per (category, budget, position)
VALID = {
    ("live_simple", 8192, 0.1): 6, ("live_simple", 8192, 0.9): 8,
    ("live_simple", 32768, 0.1): 5, ("live_simple", 32768, 0.9): 7,
    ("live_simple", 65536, 0.1): 8, ("live_simple", 65536, 0.9): 9,
    ("simple_python", 8192, 0.1): 10, ("simple_python", 8192, 0.9): 9,
    ("simple_python", 32768, 0.1): 7, ("simple_python", 32768, 0.9): 8,
    ("simple_python", 65536, 0.1): 4, ("simple_python", 65536, 0.9): 6,
}
N = 10

# worked out by hand:
# Table 5 (position 0.1), live_simple: 8K 6/10 = 0.6 → 64K 8/10 = 0.8: (0.6 − 0.8) / 0.6 = −33.33 %, −20 points;
#   Max 0.8, Min 0.5 (32K): Max − Min = 30 points, (Max − Min) / Max = 37.5 %
# Table 5, simple_python: 1.0 → 0.4: 60 %, 60 points; Max 1.0, Min 0.4
# Table 1 (every position, each budget's positions pooled), live_simple: 8K (6 + 8) / 20 = 0.7 → 64K (8 + 9) / 20
#   = 0.85: (0.7 − 0.85) / 0.7 = −21.43 %, −15 points; Max 0.9 (64K, 0.9), Min 0.5 (32K, 0.1)
# Table 1, simple_python: 8K 19/20 = 0.95 → 64K 10/20 = 0.5: 0.45 / 0.95 = 47.37 %, 45 points; Max 1.0, Min 0.4
EXPECTED = {
    "padding_same_position": {"live_simple": (-33.33, -20.0, 0.8, 0.5), "simple_python": (60.0, 60.0, 1.0, 0.4)},
    "padding_extremes": {"live_simple": (-21.43, -15.0, 0.9, 0.5), "simple_python": (47.37, 45.0, 1.0, 0.4)},
}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    arms = {"off": {"mode": "off", "perturbers": []}}
    names = {}
    for j, (b, p) in enumerate(sorted({(b, p) for _, b, p in VALID})):
        names[(b, p)] = f"cell-{j}"
        arms[f"cell-{j}"] = perturb_arm("catalog_padding", budget_tokens=b, position=p)
    records = []
    for (cat, b, p), valid in VALID.items():
        for i in range(N):
            records.append(Record(f"{cat}_{i}", names[(b, p)], cat, "scored", valid=i < valid,
                                  taxonomy=None if i < valid else "wrong_function"))
            if (b, p) == (8192, 0.1):
                records.append(Record(f"{cat}_{i}", "off", cat, "scored", valid=True))
    path = tmp_path_factory.mktemp("directional") / "replay.sqlite"
    write_results(path, arms, records)
    return path


def test_tables_1_and_5_give_the_paper_s_directional_drop_negative_when_accuracy_rose(grid):
    data = json.loads(report(grid, "--format", "json"))
    for table, cats in EXPECTED.items():
        for cat, (relative, points, hi, lo) in cats.items():
            e = data[table]["m1"][cat]
            assert (e["drop"]["relative"], e["drop"]["points"]) == (pytest.approx(relative), pytest.approx(points))
            assert (e["drop"]["from_budget"], e["drop"]["to_budget"]) == (8192, 65536)
            assert (e["max"], e["min"]) == (pytest.approx(hi), pytest.approx(lo))
            assert e["deg"] == pytest.approx((hi - lo) * 100)  # Max − Min stays beside it, never negative
    assert data["padding_same_position"]["m1"]["live_simple"]["deg_relative"] == pytest.approx(37.5)
    # Table 6 (positions at the largest catalog) is (Max − Min) / Max, as the paper's: no directional drop
    assert "drop" not in data["padding_same_budget"]["m1"]["live_simple"]

    md = report(grid, "--no-plots")
    assert "| m1 | live_simple | 0.1 | 0.800 | cell-4 | 0.500 | cell-2 | -33.33 (8K → 64K) | -20.00 | 30.00 | 37.50 |" \
        in md
    assert "| m1 | simple_python | 0.950" not in md  # Max is an arm's accuracy, not a pooled budget's
    assert "| m1 | live_simple | 0.900 | cell-5 | 0.500 | cell-2 | -21.43 (8K → 64K) | -15.00 |" in md
    rows = list(csv.DictReader(io.StringIO(report(grid, "--format", "csv", "--csv-tables"))))
    t5 = {r["Statistic"]: r for r in rows if r["Table"] == "seed 003 Table 5" and r["Group"] == "live_simple"}
    assert float(t5["% Deg. (relative)"]["Value"]) == pytest.approx(-33.33)
    assert float(t5["% Deg. (points)"]["Value"]) == pytest.approx(-20.0)
    assert float(t5["(Max − Min) / Max"]["Value"]) == pytest.approx(37.5)
    t1 = {r["Statistic"]: r for r in rows if r["Table"] == "seed 003 Table 1" and r["Group"] == "simple_python"}
    assert float(t1["% Deg. (relative)"]["Value"]) == pytest.approx(47.37)
