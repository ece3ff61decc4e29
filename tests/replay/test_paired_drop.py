"""Seed 001's bracketed relative drop is paired (#31): both arms' accuracy over the same cases.

The rephrasing arm leaves some cases unperturbed on purpose (the rephrasing lost a value: `not_perturbed`);
they are out of the arm, so the baseline must be read on the cases the arm kept. Here the baseline fails
exactly on the cases the arm left out, so comparing with the whole baseline would show a drop where the
paired comparison shows none; the expected figures are recomputed from the rows this file writes.
"""

from __future__ import annotations

import json

import pytest

from tests.support.report import report
from toolquake.proxy.replay.store import Record, ResultsFile

N = 40
REPHRASE = {"name": "rephrase", "params": {"style": "paraphrase"}}


def _kept(i: int) -> bool:
    return i % 4 != 0  # every 4th case: the rephrasing was rejected, the request went out unchanged


def _valid(profile: str, i: int) -> bool:
    if profile == "off":
        return _kept(i) and i % 10 != 1  # wrong on every case the arm leaves out, and on 1, 11, 21, 31
    return i % 5 != 2  # rephrased: wrong on 2, 7, 12, ...


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    f = ResultsFile(root / "replay.sqlite")
    f.claim("m1", "http://backend/v1")
    f.register_arms({"off": {"mode": "off", "perturbers": []}, "rephrased": {"mode": "perturb",
                                                                             "perturbers": [REPHRASE]}})
    rows = []
    for i in range(N):
        cat = "simple_python" if i < N // 2 else "multiple"
        rows.append(Record(f"{cat}_{i}", "off", cat, "scored", valid=_valid("off", i)))
        report = {} if _kept(i) else {"not_perturbed": "the rephrasing lost a value"}
        rows.append(Record(f"{cat}_{i}", "rephrased", cat, "scored", valid=_valid("rephrased", i),
                           perturbers={"applied": [{**REPHRASE, "report": report}], "skipped": [], "failed": []}))
    for r in rows:
        f.record(r)
    f.close()
    return root, rows


def _drop(rows: list[Record], category: str | None = None) -> tuple[float, float]:
    """(paired drop, the unpaired figure against the whole baseline) recomputed from the written rows."""
    def mine(p: str) -> dict[str, bool]:
        return {r.case_id: bool(r.valid) for r in rows if r.profile == p and (category is None or
                                                                             r.category == category)
                and (p == "off" or not (r.perturbers or {})["applied"][0]["report"])}
    off, arm = mine("off"), mine("rephrased")
    acc = sum(arm.values()) / len(arm)
    acc_off_same = sum(off[c] for c in arm) / len(arm)
    return (acc - acc_off_same) / acc_off_same, (acc - sum(off.values()) / len(off)) / (sum(off.values()) / len(off))


def test_the_rephrasing_arm_is_compared_with_the_baseline_on_the_cases_it_perturbed(results, tmp_path):
    root, rows = results
    out = report(str(root), "--format", "json").stdout
    arm = json.loads(out)["arms"]["rephrased"]
    paired, unpaired = _drop(rows)
    assert arm["not_perturbed"] == N // 4 and arm["n"] == N - N // 4
    assert arm["drop_vs_off"] == pytest.approx(paired) and arm["paired"]["drop"] == pytest.approx(paired)
    assert abs(paired - unpaired) > 0.1  # the unpaired figure would tell another story
    kept = [r for r in rows if r.profile == "off" and _kept(int(r.case_id.split("_")[-1]))]
    assert arm["paired"]["baseline_accuracy"] == pytest.approx(sum(r.valid for r in kept) / len(kept))
    for cat in ("simple_python", "multiple"):
        assert arm["by_category"][cat]["drop_vs_off"] == pytest.approx(_drop(rows, cat)[0])
    # seed 001 Table 2 in Markdown: the arm's accuracy with the paired drop in brackets
    md = report(str(root)).stdout
    off = json.loads(out)["arms"]["off"]["accuracy"]
    assert f"| m1 | {off:.3f} | {arm['accuracy']:.3f} ({round(paired * 100):+d}%) |" in md
