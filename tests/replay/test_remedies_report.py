"""The report's `remedies` section (#49) and its statistic, in-process: results files written here in the shape
replay writes (a remedied arm's spec holds its `remedies`, its rows' applied steps a `"kind": "remedy"` step), every
expected figure counted by hand from the rows this file writes."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from toolquake.proxy.replay.report import build, load, summarize
from toolquake.proxy.replay.report.remedies import NO_LOSS, NO_TWIN
from toolquake.proxy.replay.store import Record, ResultsFile
from toolquake.scorers.aggregate import loss_won_back

N = 60
PAD = {"name": "catalog_padding", "params": {"budget_tokens": 32768, "position": 0.5}, "probability": 1.0}
SEARCH = {"name": "tool_search", "params": {"k": 8, "method": "bm25"}}


def valid(profile: str, i: int) -> bool:
    if profile == "off":
        return i % 10 != 0  # 54 of 60
    if profile == "pad-32k-p50":
        return i % 3 == 0  # the padding breaks most cases
    if profile == "search-pad-32k-p50":
        return i % 5 != 1 and i % 10 != 0 or i == 30  # wins most back, loses some, one off-wrong case right
    if profile == "search-only":
        return i % 10 != 0 and i != 7
    return i % 2 == 0  # search-pad-8k: no twin in these results


def tokens(profile: str, i: int) -> int:
    return {"pad-32k-p50": 32000 + i, "off": 300 + i}.get(profile, 900 + 2 * i)


def dropped(i: int) -> list[str]:
    return ["needed_fn"] if i % 12 == 5 else []


ARMS = {
    "off": {"mode": "off", "perturbers": []},
    "pad-32k-p50": {"mode": "perturb", "perturbers": [PAD]},
    "search-pad-32k-p50": {"mode": "perturb", "perturbers": [PAD], "remedies": [SEARCH]},
    "search-only": {"mode": "perturb", "perturbers": [], "remedies": [SEARCH]},
    "search-pad-8k": {"mode": "perturb", "perturbers": [{**PAD, "params": {"budget_tokens": 8192, "position": 0.5}}],
                      "remedies": [SEARCH]},
}


def applied(profile: str, i: int) -> dict:
    steps = [{"name": s["name"], "params": s["params"], "report": {"tokens_total": 32768}}
             for s in ARMS[profile]["perturbers"]]
    steps += [{**SEARCH, "report": {"kept": 8, "dropped": ["x"], "k": 8, "method": "bm25",
                                    "dropped_needed": dropped(i)}, "kind": "remedy"}
              for _ in ARMS[profile].get("remedies", [])]
    return {"applied": steps, "skipped": [], "failed": []}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("remedies")
    f = ResultsFile(root / "replay.sqlite")
    f.claim("m1", "http://backend/v1")
    f.register_arms(ARMS)
    for i in range(N):
        for p in ARMS:
            f.record(Record(f"multiple_{i}", p, "multiple", "scored", valid=valid(p, i), prompt_tokens=tokens(p, i),
                            perturbers=applied(p, i)))
    f.close()
    return root


def by_hand(remedied: str, twin: str) -> dict:
    """The figures of one remedied arm counted from the verdicts this file wrote."""
    off = [valid("off", i) for i in range(N)]
    pert = [valid(twin, i) for i in range(N)]
    rem = [valid(remedied, i) for i in range(N)]
    return {"off": sum(off) / N, "pert": sum(pert) / N, "rem": sum(rem) / N,
            "won": sum(1 for i in range(N) if rem[i] and not pert[i]),
            "lost": sum(1 for i in range(N) if pert[i] and not rem[i]),
            "share": (sum(rem) - sum(pert)) / (sum(off) - sum(pert)) if sum(off) > sum(pert) else None,
            "saved": sum(tokens(twin, i) - tokens(remedied, i) for i in range(N)) / N,
            "dropped": sum(1 for i in range(N) if dropped(i))}


def test_the_remedies_section_pairs_each_remedied_arm_with_its_twin_and_off(results):
    summary = summarize(load([results]))
    entries = {e["profile"]: e for e in summary["remedies"]}
    assert set(entries) == {"search-pad-32k-p50", "search-only", "search-pad-8k"}
    e, hand = entries["search-pad-32k-p50"], by_hand("search-pad-32k-p50", "pad-32k-p50")
    assert e["twin"] == "pad-32k-p50" and e["baseline"] == "off" and e["n"] == N
    assert e["remedies"] == ["tool_search"] and e["perturbation"] == ["catalog_padding"]
    assert e["accuracy_off"] == pytest.approx(hand["off"])
    assert e["accuracy_perturbed"] == pytest.approx(hand["pert"])
    assert e["accuracy_remedied"] == pytest.approx(hand["rem"])
    assert (e["cases_won"], e["cases_lost"]) == (hand["won"], hand["lost"]) and hand["won"] > 10 and hand["lost"] > 0
    assert e["won_back"] == pytest.approx(hand["share"])
    lo, hi = e["won_back_ci"]
    assert lo < hand["share"] < hi
    assert e["p_value"] == pytest.approx(2 * sum(math.comb(hand["won"] + hand["lost"], k) for k in
                                                 range(hand["lost"] + 1)) / 2 ** (hand["won"] + hand["lost"]))
    assert e["significant"] is True
    assert e["tokens_saved"] == pytest.approx(hand["saved"]) and e["tokens_saved_cases"] == N
    assert (e["needed_dropped"], e["needed_dropped_known"]) == (hand["dropped"], N)
    # a profile of remedies only: its twin is `off`, which lost nothing, so nothing is won back: said, not a number
    only = entries["search-only"]
    assert only["twin"] == "off" and only["won_back"] is None and only["won_back_note"] == NO_LOSS
    assert only["cases_lost"] == 1 and only["cases_won"] == 0
    # no unremedied arm with the same padding: no pairing at all
    none = entries["search-pad-8k"]
    assert none["twin"] is None and none["n"] == 0 and none["won_back_note"] == NO_TWIN
    # the arm is labelled as remedied in the arm's own entry
    assert summary["arms"]["search-pad-32k-p50"]["remedies"] == [SEARCH]
    assert summary["arms"]["pad-32k-p50"]["remedies"] == []


def test_every_format_shows_the_remedies(results):
    hand = by_hand("search-pad-32k-p50", "pad-32k-p50")
    text, _ = build([results], "json", None, plots=False)
    data = json.loads(text)["remedies"]
    assert {"model", "profile", "remedies", "twin", "n", "accuracy_off", "accuracy_off_ci", "accuracy_perturbed",
            "accuracy_perturbed_ci", "accuracy_remedied", "accuracy_remedied_ci", "won_back", "won_back_ci",
            "won_back_note", "cases_won", "cases_lost", "p_value", "significant", "tokens_saved",
            "needed_dropped", "needed_dropped_known"} <= set(data[0])
    md, _ = build([results], "md", None, plots=False)
    assert "## Remedies: accuracy on the same cases" in md
    row = next(line for line in md.splitlines() if line.startswith("| m1 | tool_search | search-pad-32k-p50 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "pad-32k-p50" and cells[4] == str(N)
    assert cells[7].startswith(f"{hand['rem'] * 100:.1f} %") and cells[8].startswith(f"{hand['share'] * 100:.0f} %")
    assert (cells[9], cells[10]) == (str(hand["won"]), str(hand["lost"]))
    assert "undefined (no loss)" in md and "+ remedy tool_search(" in md  # the summary table labels the arm
    html, _ = build([results], "html", None, plots=False)
    assert "Remedies: accuracy on the same cases" in html and "undefined (no loss)" in html
    table, _ = build([results], "csv", None, plots=False)
    rows = {r["Profile"]: r for r in csv.DictReader(io.StringIO(table))}
    assert rows["search-pad-32k-p50"]["Loss Won Back"] == f"{hand['share'] * 100:.2f}%"
    assert rows["search-pad-32k-p50"]["Cases Won"] == str(hand["won"])
    assert rows["search-pad-32k-p50"]["Tokens Saved"] == f"{hand['saved']:.1f}"
    assert rows["pad-32k-p50"]["Remedy"] == "N/A"


def _fieller_by_hand(cases):
    """The defining property of Fieller's ends: θ where (x̄ − θȳ)² = z² · var(x − θy) / n, the variance of the
    per-case differences taken directly (not through the covariances)."""
    n = len(cases)
    z2 = 1.96 ** 2

    def gap(theta):
        d = [(int(r) - int(p)) - theta * (int(o) - int(p)) for o, p, r in cases]
        mean = sum(d) / n
        return mean * mean - z2 * sum((x - mean) ** 2 for x in d) / (n - 1) / n

    return gap


def test_loss_won_back_by_hand():
    # 10 cases broken by the perturbation (off right, perturbed wrong), 6 of them right again with the remedy:
    # share 0.6, and with ȳ constant the interval is 0.6 ± 1.96 · sd(x) / √n
    cases = [(True, False, i < 6) for i in range(10)]
    share, (lo, hi) = loss_won_back(cases)
    half = 1.96 * math.sqrt(0.24 * 10 / 9 / 10)
    assert share == pytest.approx(0.6) and (lo, hi) == (pytest.approx(0.6 - half), pytest.approx(0.6 + half))
    # a mixed table: both ends solve Fieller's equation, the estimate lies between them
    mixed = ([(True, False, True)] * 14 + [(True, False, False)] * 6 + [(True, True, True)] * 20
             + [(True, True, False)] * 3 + [(False, False, True)] * 2 + [(False, False, False)] * 5)
    share, (lo, hi) = loss_won_back(mixed)
    assert share == pytest.approx((16 + 20 - 20 - 3) / (43 - 23))
    gap = _fieller_by_hand(mixed)
    assert lo < share < hi and gap(lo) == pytest.approx(0, abs=1e-12) and gap(hi) == pytest.approx(0, abs=1e-12)
    assert gap(share) < 0 and gap(lo - 0.01) > 0 and gap(hi + 0.01) > 0


def test_loss_won_back_undefined_without_a_loss_and_unbounded_without_a_clear_one():
    assert loss_won_back([]) == (None, None)
    # the perturbation lost nothing: no share at all (not 0, not infinity)
    assert loss_won_back([(True, True, False), (False, False, True), (True, True, True)]) == (None, None)
    assert loss_won_back([(True, False, True), (False, True, True)]) == (None, None)  # one lost, one gained
    # a loss of one case in forty: a share, but Fieller's set is unbounded (the loss is not distinguishable from 0)
    share, ci = loss_won_back([(True, False, True)] + [(True, True, True)] * 39)
    assert share == pytest.approx(1.0) and ci is None


def test_the_remedies_presets_pair_each_perturbation_with_its_remedied_twin():
    from toolquake.proxy.cli import build_parser
    from toolquake.proxy.replay.selection import default_categories, expand_profiles
    from toolquake.proxy.server.config import load_config

    config = load_config(None, env={})
    known = ["off", *config.profiles]
    for preset, remedy, categories in (("@remedies", "tool_search", ["simple_python", "live_simple", "multiple"]),
                                       ("@remedies-responses", "response_trim", ["multi_turn_base"])):
        arms = expand_profiles(preset, known)
        assert arms[0] == "off" and len(arms) in (5, 7) and default_categories(preset) == categories
        for plain, remedied in zip(arms[1::2], arms[2::2]):
            a, b = config.profiles[plain], config.profiles[remedied]
            assert not a.remedies and [r.name for r in b.remedies] == [remedy]
            assert [(s.name, s.params) for s in a.perturbers] == [(s.name, s.params) for s in b.perturbers]
    assert {s.params["budget_tokens"] for p in expand_profiles("@remedies", known)[1:]
            for s in config.profiles[p].perturbers} == {8192, 32768, 120000}
    assert all(r.params == {"k": 8} for p in expand_profiles("@remedies", known)[2::2]
               for r in config.profiles[p].remedies)
    # the seed grids stay the seed grids: no remedied arm matches pad-* or resp-*
    assert not any(config.profiles[p].remedies for p in expand_profiles("@seed003,@seed003-responses", known)[1:])
    help_text = next(a for a in build_parser()._subparsers._group_actions[0].choices["replay"]._actions
                     if "--profiles" in a.option_strings).help
    assert "'@remedies'" in help_text and "'@remedies-responses'" in help_text


def test_remedied_arms_stay_out_of_the_papers_tables_and_keep_their_own_section(results):
    """A remedied arm measures the remedy, not the model under the perturbation: seed 003's grids and tables (Max/Min
    over the padding arms, the heatmap's cells, the positions and budgets) and seed 001's caused failures are those
    of the unremedied arms alone; the remedied arms are in the remedies section."""
    summary = summarize(load([results]))
    remedied = {p for p, spec in ARMS.items() if spec.get("remedies")}
    for key in ("padding_extremes", "padding_same_position", "padding_same_budget", "caused_errors"):
        shown = json.dumps(summary[key])
        assert "pad-32k-p50" in shown, key  # the unremedied padding arm is there
        assert not [p for p in remedied if f'"{p}"' in shown], (key, shown)
    [extremes] = summary["padding_extremes"]["m1"].values()
    assert extremes["arms"] == 1  # one padding arm: pad-32k-p50 (the two remedied padding arms left out)
    assert {e["profile"] for e in summary["remedies"]} == remedied
