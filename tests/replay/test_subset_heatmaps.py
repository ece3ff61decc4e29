"""Seed 003 challenge 1: one heatmap per subset, a panel per model, as the paper's Figs. 3, 6 and 7 (#31).

Two models' catalog-padding arms (2 budgets × 2 positions) over three subsets, verdicts drawn at random and
written by the replay's own writer; each subset's cells are recomputed here from the draws.
"""

from __future__ import annotations

import random

import pytest

from tests.support.report import report
from toolquake.proxy.replay.store import Record, ResultsFile

BUDGETS = [8192, 32768]
POSITIONS = [0.1, 0.9]
SUBSETS = ["multiple", "simple_python", "live_simple"]  # written in this order; the paper's is live_simple first
MODELS = ["model-a", "model-b"]


def _specs() -> dict[str, dict]:
    specs = {"off": {"mode": "off", "perturbers": []}}
    for b in BUDGETS:
        for p in POSITIONS:
            specs[f"pad-{b}-{p}"] = {"mode": "perturb", "perturbers": [
                {"name": "catalog_padding", "params": {"budget_tokens": b, "position": p}, "probability": 1.0}]}
    return specs


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    rng = random.Random(31)
    root = tmp_path_factory.mktemp("subsets")
    records: dict[str, list[Record]] = {}
    for m, model in enumerate(MODELS):
        f = ResultsFile(root / model / "replay.sqlite")
        f.claim(model, "http://backend/v1")
        f.register_arms(_specs())
        records[model] = []
        for profile in _specs():
            for s, subset in enumerate(SUBSETS):
                for i in range(6 + 2 * s):
                    # accuracy falls with the budget, differently per subset and model
                    p_valid = 0.9 - (0.25 + 0.2 * s + 0.1 * m) * ("32768" in profile)
                    rec = Record(f"{subset}_{i}", profile, subset, "scored", valid=rng.random() < p_valid)
                    f.record(rec)
                    records[model].append(rec)
        f.close()
    return root, records


def _cells(records: list[Record], subset: str) -> dict[tuple[int, float], tuple[int, int]]:
    out = {}
    for b in BUDGETS:
        for p in POSITIONS:
            mine = [r for r in records if r.profile == f"pad-{b}-{p}" and r.category == subset]
            out[(b, p)] = (sum(1 for r in mine if r.valid), len(mine))
    return out


def test_each_subset_gets_its_own_heatmap_cells(written):
    from toolquake.proxy.replay.report import load, padding_counts, padding_grid, summarize
    from toolquake.proxy.replay.report.paper_tables import catalog_categories

    root, records = written
    summary = summarize(load([root / m for m in MODELS]))
    assert catalog_categories(summary) == ["live_simple", "simple_python", "multiple"]  # Figs. 3, 6, 7
    for model in MODELS:
        for subset in SUBSETS:
            want = _cells(records[model], subset)
            assert padding_counts(summary, model, subset) == want
            budgets, positions, cells = padding_grid(summary, model, subset)
            assert (budgets, positions) == (BUDGETS, POSITIONS)
            assert cells == {k: pytest.approx(v / n) for k, (v, n) in want.items()}
        # pooled, as before: every subset's pairs together
        pooled = {k: tuple(map(sum, zip(*(_cells(records[model], s)[k] for s in SUBSETS)))) for k in _cells(
            records[model], SUBSETS[0])}
        assert padding_counts(summary, model) == pooled


def test_the_reports_draw_one_heatmap_per_subset(written, tmp_path):
    root, _ = written
    out = tmp_path / "r.md"
    report(*(str(root / m) for m in MODELS), "--out", str(out))
    text = out.read_text()
    names = ["r-heatmap-catalog.png", *(f"r-heatmap-catalog-{s}.png" for s in ("live_simple", "simple_python",
                                                                               "multiple"))]
    for name in names:
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
        assert f"]({name})" in text
    assert [text.index(f"]({n})") for n in names] == sorted(text.index(f"]({n})") for n in names)
    html = report(*(str(root / m) for m in MODELS), "--format", "html").stdout
    for subset in ("live_simple", "simple_python", "multiple"):
        assert f"<h3>heatmap-catalog-{subset}.png</h3>" in html


def test_a_category_name_becomes_a_safe_file_name():
    from toolquake.proxy.replay.report.plots import file_part

    assert file_part("simple_python") == "simple_python"
    assert file_part("../../etc/passwd") == "_.._etc_passwd"
    assert file_part("my cases/é") == "my_cases__"
    assert file_part("") == "_" and file_part("..") == "_"
