"""`toolquake report`: seed 001 Table 2's error breakdown over the failures a perturbation caused, and the
toolkit expansion's similarity distribution, recomputed here from the verdicts written to a results file."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter

import pytest

from tests.support.report import report
from tests.support.results import write_results
from toolquake.proxy.replay.store import Record

NINE = ["wrong_syntax", "wrong_function", "wrong_count", "wrong_param_value", "missing_param", "unexpected_param",
        "wrong_type", "irrelevance_violation", "relevance_miss"]
# the paper's four classes, written out here from seed 001 §3 rather than read from the code
FOUR = {"wrong_syntax": "syntax", "wrong_function": "function", "wrong_count": "number of functions",
        "relevance_miss": "number of functions", "irrelevance_violation": "number of functions",
        "wrong_param_value": "parameter assignment", "missing_param": "parameter assignment",
        "unexpected_param": "parameter assignment", "wrong_type": "parameter assignment"}
ARMS = {"off": {"mode": "off", "perturbers": []},
        "expanded": {"mode": "perturb", "perturbers": [{"name": "toolkit_expansion", "params": {"k": 3},
                                                         "probability": 1.0}]},
        "rephrased": {"mode": "perturb", "perturbers": [{"name": "paraphrase", "params": {}, "probability": 1.0}]}}


def report_json(path) -> dict:
    out = report(str(path), "--format", "json").stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """120 cases × 3 arms with random verdicts; each expanded pair records what toolkit_expansion reported."""
    rng = random.Random(11)
    path = tmp_path_factory.mktemp("paper") / "replay.sqlite"
    records = []
    for i in range(120):
        case = f"multiple_{i}"
        for p in ARMS:
            if rng.random() < 0.05:
                records.append(Record(case, p, "multiple", "error", error_code="timeout"))
                continue
            valid = rng.random() < (0.75 if p == "off" else 0.55)
            perturbers = None
            if p == "expanded":
                report = {"source": rng.choice(["retrieval", "generate"]),
                          "max_cosine_to_original": [round(rng.uniform(0.3, 0.8), 4) for _ in range(3)],
                          "twins_skipped": rng.randint(0, 3), "below_band": rng.randint(0, 1)}
                perturbers = {"applied": [{"name": "toolkit_expansion", "params": {"k": 3}, "report": report}]}
            records.append(Record(case, p, "multiple", "scored", valid=valid,
                                  taxonomy=None if valid else rng.choice(NINE), perturbers=perturbers))
    write_results(path, ARMS, records)
    return path, records


def test_error_shares_count_only_the_failures_the_perturbation_caused(run) -> None:
    path, records = run
    caused = report_json(path)["caused_errors"]["m1"]
    base = {r.case_id: r.valid for r in records if r.profile == "off" and r.status == "scored"}
    for arm in ("expanded", "rephrased"):
        mine = [r.taxonomy for r in records if r.profile == arm and r.status == "scored" and r.valid is False
                and base.get(r.case_id) is True]
        all_failures = [r for r in records if r.profile == arm and r.status == "scored" and not r.valid]
        assert 0 < len(mine) < len(all_failures)  # the draw has failures the baseline shared: they must not count
        got = caused[arm]
        assert got["n"] == len(mine)
        fine = Counter(mine)
        four = Counter(FOUR[t] for t in mine)
        for t in NINE:
            assert got["fine"][t] == pytest.approx(fine[t] / len(mine))
        for c in set(FOUR.values()):
            assert got["classes"][c] == pytest.approx(four[c] / len(mine))
        assert sum(got["classes"].values()) == pytest.approx(1.0)
    assert "off" not in caused


def test_the_markdown_report_shows_the_four_classes_and_the_expansion_distribution(run) -> None:
    path, records = run
    md = report(str(path)).stdout
    assert "Seed 001 Table 2 (right)" in md
    for c in ("wrong syntax", "wrong function", "wrong number of functions", "wrong parameter assignment"):
        assert c in md
    assert "Toolkit expansion: source of the added tools" in md


def test_expansion_distribution_is_read_from_what_each_request_reported(run) -> None:
    path, records = run
    got = report_json(path)["expansion"]["m1"]["expanded"]
    reports = [r.perturbers["applied"][0]["report"] for r in records
               if r.profile == "expanded" and r.status == "scored"]
    cosines = [c for rep in reports for c in rep["max_cosine_to_original"]]
    assert got["requests"] == len(reports)
    assert got["sources"] == dict(Counter(rep["source"] for rep in reports))
    assert got["tools_added"] == len(cosines)
    assert got["cosine"]["median"] == pytest.approx(statistics.median(cosines), abs=1e-4)
    assert got["cosine"]["min"] == pytest.approx(min(cosines), abs=1e-4)
    assert got["cosine"]["max"] == pytest.approx(max(cosines), abs=1e-4)
    assert got["cosine"]["p25"] == pytest.approx(statistics.quantiles(cosines, n=4, method="inclusive")[0], abs=1e-4)
    assert got["twins_skipped"] == sum(rep["twins_skipped"] for rep in reports)
    assert got["below_band"] == sum(rep["below_band"] for rep in reports)


def _pad(budget: int, position: float) -> dict:
    return {"mode": "perturb", "perturbers": [{"name": "catalog_padding", "params": {"budget_tokens": budget,
                                                                                     "position": position},
                                               "probability": 1.0}]}


def _fmt(ret: str) -> dict:
    return {"mode": "perturb", "perturbers": [{"name": "format_rewrite", "params": {"return_format": ret},
                                               "probability": 1.0}]}


def test_seed_003_extremes_and_bfcl_format_statistics_are_recomputed_from_the_verdicts(tmp_path) -> None:
    rng = random.Random(5)
    arms = {"off": {"mode": "off", "perturbers": []}, "pad-8k-p10": _pad(8192, 0.1), "pad-8k-p90": _pad(8192, 0.9),
            "pad-32k-p50": _pad(32768, 0.5), "fmt-a": _fmt("python"), "fmt-b": _fmt("json"),
            "fmt-c": _fmt("verbose_xml")}
    records = [Record(f"{cat}_{i}", p, cat, "scored", valid=rng.random() < 0.3 + 0.1 * j,
                      taxonomy=None)
               for cat in ("simple_python", "multiple") for i in range(25) for j, p in enumerate(arms)]
    for r in records:
        r.taxonomy = None if r.valid else "wrong_function"
    path = tmp_path / "replay.sqlite"
    write_results(path, arms, records)
    got = report_json(path)

    def acc(profile: str, cat: str | None = None) -> float:
        mine = [r.valid for r in records if r.profile == profile and (cat is None or r.category == cat)]
        return sum(mine) / len(mine)

    pads = [p for p in arms if p.startswith("pad-")]
    for cat in ("simple_python", "multiple"):
        values = {p: acc(p, cat) for p in pads}
        e = got["padding_extremes"]["m1"][cat]
        assert e["max"] == pytest.approx(max(values.values())) and e["min"] == pytest.approx(min(values.values()))
        assert values[e["max_arm"]] == pytest.approx(e["max"]) and values[e["min_arm"]] == pytest.approx(e["min"])
        assert e["deg"] == pytest.approx(round((max(values.values()) - min(values.values())) * 100, 2))
    fmts = [acc(p) for p in ("fmt-a", "fmt-b", "fmt-c")]
    fs = got["format_sensitivity"]["m1"]
    assert fs["configs"] == 3
    assert fs["max_delta"] == pytest.approx(round((max(fmts) - min(fmts)) * 100, 2))
    assert fs["std"] == pytest.approx(round(statistics.stdev(fmts) * 100, 2))


@pytest.mark.needs_corpus
def test_format_sensitivity_selects_bfcls_200_cases_in_bfcls_order() -> None:
    from toolquake.bfcl import corpus
    from toolquake.proxy.replay.selection import select_cases

    if not corpus.is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    listed = json.loads((corpus.data_dir() / "BFCL_v4_format_sensitivity.json").read_text())
    cases = select_cases(["format_sensitivity"], None, None)
    assert len(cases) == sum(len(v) for v in listed.values()) == 200
    expected = [c.id for cat, ids in listed.items() for c in corpus.load_category(cat) if c.id in set(ids)]
    assert [c.id for c in cases] == expected  # key order, then file order within a category
    assert [c.id for c in select_cases(["format_sensitivity"], None, (1, 4))] == expected[1::4]
