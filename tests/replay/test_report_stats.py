"""Intervals and the paired test in `toolquake report` (#18).

`wilson` and `mcnemar` are checked against scipy.stats; the paired drop interval against scipy's paired
bootstrap; the report against numbers recomputed here from verdicts this file chose. The HTML report is
opened in headless Chromium.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import shutil
import subprocess

import pytest

from tests.support import ROOT
from tests.support.browser import chromium, console, open_page
from tests.support.report import report_run
from toolquake.proxy.replay.report import render_markdown, summarize_db
from toolquake.proxy.replay.store import Record, ResultsFile
from toolquake.scorers.aggregate import mcnemar, paired_drop_ci, wilson, wilson_ci

stats = pytest.importorskip("scipy.stats")
Z = float(stats.norm.ppf(0.975))


# ---------------------------------------------------------------------------------------------
# the statistics


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (0, 7), (7, 7), (3, 10), (5, 8), (50, 80), (1, 300), (250, 400)])
def test_wilson_matches_scipy(k, n):
    want = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson(k, n, z=Z)
    assert lo == pytest.approx(want.low, abs=1e-12) and hi == pytest.approx(want.high, abs=1e-12)
    assert lo <= k / n <= hi


def test_wilson_by_hand_and_edges():
    # 5 of 10, z = 1.96: centre 0.5, half-width 1.96 / (1 + 1.96²/10) * sqrt(0.025 + 1.96²/400)
    lo, hi = wilson(5, 10)
    half = 1.96 / 1.38416 * math.sqrt(0.025 + 0.009604)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert round(lo, 4) == 0.2366 and round(hi, 4) == 0.7634
    assert wilson(0, 0) == (0.0, 1.0) and wilson_ci(0, 0) is None
    assert wilson_ci(3, 4) == list(wilson(3, 4))
    with pytest.raises(ValueError):
        wilson(5, 4)


@pytest.mark.parametrize("b,c", [(1, 0), (0, 5), (5, 2), (3, 3), (10, 10), (2, 9), (17, 4), (40, 25), (0, 60)])
def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_pairs(b, c):
    assert mcnemar(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)


def test_mcnemar_by_hand():
    assert mcnemar(0, 0) == 1.0
    assert mcnemar(0, 5) == pytest.approx(2 / 32)  # both tails of 5 coin flips all one way
    assert mcnemar(1, 5) == pytest.approx(2 * (1 + 6) / 64)
    assert mcnemar(4, 4) == 1.0


def test_paired_drop_ci_by_hand():
    # a=8 b=2 c=0 d=0, plus 0.5 per cell: R = (8.5 + 0.5) / (8.5 + 2.5) = 9/11, var ln R = 3 / (11 * 9)
    lo, hi = paired_drop_ci(8, 2, 0, 0)
    r, se = 9 / 11, math.sqrt(3 / 99)
    assert lo == pytest.approx(r * math.exp(-1.96 * se) - 1) and hi == pytest.approx(r * math.exp(1.96 * se) - 1)
    assert paired_drop_ci(0, 0, 3, 5) is None  # the baseline never valid: no ratio


@pytest.mark.parametrize("cells", [(0, 5, 0, 0), (0, 3, 0, 7), (1, 20, 0, 0), (0, 1, 0, 0)])
def test_paired_drop_ci_holds_its_estimate_when_every_baseline_success_is_lost(cells):
    a, b, c, d = cells
    lo, hi = paired_drop_ci(a, b, c, d)
    point = (a + c) / (a + b) - 1
    smoothed_lo = (a + c + 1) / (a + b + 1) * math.exp(-1.96 * math.sqrt((b + c + 1) / ((a + b + 1) * (a + c + 1))))
    assert lo <= point <= hi
    assert lo == pytest.approx(min(point, smoothed_lo - 1))


@pytest.mark.parametrize("cells", [(120, 30, 10, 40), (60, 12, 4, 24), (150, 5, 5, 40), (35, 20, 2, 43)])
def test_paired_drop_ci_agrees_with_a_paired_bootstrap(cells):
    import numpy as np

    a, b, c, d = cells
    base = np.array([1] * a + [1] * b + [0] * c + [0] * d)
    arm = np.array([1] * a + [0] * b + [1] * c + [0] * d)
    boot = stats.bootstrap((base, arm), lambda x, y: y.mean() / x.mean() - 1, paired=True, vectorized=False,
                           n_resamples=4000, method="percentile", rng=np.random.default_rng(1))
    lo, hi = paired_drop_ci(a, b, c, d)
    point = (a + c) / (a + b) - 1
    assert lo < point < hi
    assert lo == pytest.approx(boot.confidence_interval.low, abs=0.025)
    assert hi == pytest.approx(boot.confidence_interval.high, abs=0.025)


# ---------------------------------------------------------------------------------------------
# a report from verdicts chosen here

N_CASES = 60
PROFILES = {
    "off": {"mode": "off", "perturbers": []},
    "shuffled": {"mode": "perturb", "perturbers": [{"name": "tool_order", "params": {"mode": "shuffle"},
                                                      "probability": 1.0}]},
    "renamed": {"mode": "perturb", "perturbers": [{"name": "param_rename", "params": {"style": "camel"},
                                                     "probability": 1.0}]},
}


#: what each perturber reports having done to case i (stored with the pair, shown in the per-case diffs)
REPORTS = {"tool_order": lambda i: {"order": [f"t{(i + k) % 3}" for k in range(3)]},
           "param_rename": lambda i: {"renamed": {"x": "xValue"}} if i % 2 else {}}


def case_id(i: int) -> str:
    return f"simple_python_{i}" if i < 40 else f"multiple_{i - 40}"


def verdict(profile: str, i: int) -> bool | None:
    """valid / invalid, or None for a pair that failed (no verdict)."""
    off = i % 5 != 0  # 48 of 60
    if profile == "off":
        return off
    if profile == "shuffled":  # loses i % 4 == 1 among the valid ones (12), gains 0, 20, 40; 7 failed
        if i == 7:
            return None
        return (off and i % 4 != 1) or i % 20 == 0
    return off if i not in (3, 4, 5) else not off  # renamed: two lost (3, 4), one gained (5)


def _answer(name: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": '{"x": 1}'}}]}}]}


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    f = ResultsFile(root / "replay.sqlite")
    f.claim("m1", "http://backend/v1")
    f.register_arms(PROFILES)
    for p, spec in PROFILES.items():
        for i in range(N_CASES):
            v = verdict(p, i)
            cid, cat = case_id(i), ("simple_python" if i < 40 else "multiple")
            if v is None:
                f.record(Record(cid, p, cat, "error", error_code="timeout"))
                continue
            applied = [{"name": x["name"], "params": x["params"], "report": REPORTS[x["name"]](i)}
                       for x in spec["perturbers"]]
            f.record(Record(cid, p, cat, "scored", valid=v, taxonomy=None if v else
                            ("wrong_function" if i % 3 else "wrong_param_value"),
                            answer=_answer(f"call_{p}_{i}"),
                            perturbers={"applied": applied, "skipped": [], "failed": []}))
    f.close()
    return root


def report(*args: str) -> subprocess.CompletedProcess:
    r = report_run(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _independent(profile: str, category: str | None = None) -> dict:
    cases = [i for i in range(N_CASES) if category is None or (i < 40) == (category == "simple_python")]
    mine = {i: verdict(profile, i) for i in cases if verdict(profile, i) is not None}
    valid = sum(mine.values())
    ci = stats.binomtest(valid, len(mine)).proportion_ci(method="wilson")
    out = {"n": len(mine), "accuracy": valid / len(mine), "ci": [ci.low, ci.high]}
    if profile != "off":
        both = [i for i in mine if verdict("off", i) is not None]
        lost = [case_id(i) for i in both if verdict("off", i) and not mine[i]]
        gained = [case_id(i) for i in both if not verdict("off", i) and mine[i]]
        out["lost"], out["gained"], out["paired_n"] = lost, gained, len(both)
        out["p"] = stats.binomtest(len(lost), len(lost) + len(gained), 0.5).pvalue if lost or gained else 1.0
    return out


def test_json_report_has_the_intervals_and_the_paired_test(replay_dir):
    data = json.loads(report(str(replay_dir), "--format", "json").stdout)
    arms = data["arms"]
    for p in PROFILES:
        want = _independent(p)
        arm = arms[p]
        assert arm["n"] == want["n"] and arm["accuracy"] == pytest.approx(want["accuracy"])
        assert arm["accuracy_ci"] == pytest.approx(want["ci"], abs=1e-4)  # z = 1.96 vs scipy's 1.959964
        for cat in ("simple_python", "multiple"):
            assert arm["by_category"][cat]["accuracy_ci"] == pytest.approx(_independent(p, cat)["ci"], abs=1e-4)
        failures = want["n"] - round(want["accuracy"] * want["n"])
        for kind, count in arm["errors"].items():
            share = stats.binomtest(count, failures).proportion_ci(method="wilson")
            assert arm["errors_ci"][kind] == pytest.approx([share.low, share.high], abs=1e-4)
    assert arms["off"]["paired"] is None and arms["off"]["drop_vs_off_ci"] is None
    # shuffled: 12 cases lost, 3 gained (0, 20, 40 are off-invalid, valid here), case 7 failed so unpaired
    sh = _independent("shuffled")
    assert (len(sh["lost"]), len(sh["gained"]), sh["paired_n"]) == (12, 3, 59)
    cmp = arms["shuffled"]["paired"]
    assert (cmp["valid_to_invalid"], cmp["invalid_to_valid"], cmp["n"]) == (12, 3, 59)
    # by hand: 2 * P(X <= 3), X ~ Bin(15, 1/2) = 2 * (1 + 15 + 105 + 455) / 2**15
    assert cmp["p_value"] == pytest.approx(sh["p"]) == pytest.approx(2 * 576 / 2**15)
    assert cmp["p_value"] < 0.05 and cmp["significant"] is True
    lo, hi = arms["shuffled"]["drop_vs_off_ci"]
    assert lo < arms["shuffled"]["drop_vs_off"] < hi < 0
    rn = arms["renamed"]["paired"]
    assert (rn["valid_to_invalid"], rn["invalid_to_valid"]) == (2, 1)
    assert rn["p_value"] == pytest.approx(1.0) and rn["significant"] is False
    lo, hi = arms["renamed"]["drop_vs_off_ci"]
    assert lo < 0 < hi
    # flips: exactly the discordant cases, with what was applied and the calls made
    got = {(f["profile"], f["case_id"], f["direction"]) for f in data["flips"]}
    want_flips = {("shuffled", c, "valid_to_invalid") for c in sh["lost"]}
    want_flips |= {("shuffled", c, "invalid_to_valid") for c in sh["gained"]}
    want_flips |= {("renamed", case_id(3), "valid_to_invalid"), ("renamed", case_id(4), "valid_to_invalid"),
                   ("renamed", case_id(5), "invalid_to_valid")}
    assert got == want_flips
    f = next(f for f in data["flips"] if f["profile"] == "renamed" and f["case_id"] == case_id(4))
    assert f["perturbation"] == 'param_rename({"style": "camel"})'  # case 4 reported nothing
    assert f["perturbation_steps"] == [{"name": "param_rename", "params": {"style": "camel"}, "report": {}}]
    g3 = next(f for f in data["flips"] if f["profile"] == "renamed" and f["case_id"] == case_id(3))
    assert g3["perturbation"] == 'param_rename({"style": "camel"}) → {"renamed": {"x": "xValue"}}'
    assert f["calls"] == 'call_renamed_4({"x": 1})' and f["baseline_calls"] == 'call_off_4({"x": 1})'
    assert f["error_type"] == "wrong_function"
    g = next(f for f in data["flips"] if f["profile"] == "renamed" and f["case_id"] == case_id(5))
    assert g["error_type"] == "wrong_function"  # the baseline's error (5 % 3 != 0), the arm was valid
    from toolquake.bfcl import corpus

    if corpus.is_present():
        gt = corpus.load_case(case_id(4)).ground_truth
        assert json.loads(f["expected"]) == gt
    else:
        assert f["expected"] is None


def test_markdown_leads_with_the_summary_and_lists_the_flipped_cases(replay_dir, tmp_path):
    out = tmp_path / "r.md"
    report(str(replay_dir), "--out", str(out))
    text = out.read_text()
    summary_at = text.index("## Summary: which perturbations hurt most")
    assert summary_at < text.index("## AST accuracy per arm")
    rows = [line for line in text[summary_at:].splitlines()[4:6]]
    assert rows[0].startswith("| m1 | shuffled |") and rows[1].startswith("| m1 | renamed |")  # largest drop first
    sh = _independent("shuffled")
    lo, hi = sh["ci"]
    assert f"{sh['accuracy'] * 100:.1f} % [{lo * 100:.1f}, {hi * 100:.1f}]" in rows[0]
    assert rows[0].endswith(f"| 59 | 12 | 3 | {sh['p']:.2g} | yes |") and rows[1].endswith("| 1 | no |")
    assert f"| {case_id(4)} | valid → invalid | wrong_function |" in text
    png = (tmp_path / "r-accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG") and "](r-accuracy.png)" in text


def test_csv_stats_columns(replay_dir):
    plain = list(csv.reader(io.StringIO(report(str(replay_dir), "--format", "csv").stdout)))
    table = list(csv.reader(io.StringIO(report(str(replay_dir), "--format", "csv", "--csv-stats").stdout)))
    assert table[0][: len(plain[0])] == plain[0] and [r[: len(plain[0])] for r in table] == plain
    row = {h: v for h, v in zip(table[0], next(r for r in table if r[3] == "shuffled"))}
    sh = _independent("shuffled")
    assert row["Overall Acc CI Low"] == f"{sh['ci'][0] * 100:.2f}%"
    assert (row["Valid to Invalid"], row["Invalid to Valid"], row["Significant"]) == ("12", "3", "True")
    assert float(row["McNemar p"]) == pytest.approx(sh["p"], rel=1e-5)


def test_csv_cases_are_the_per_case_diffs_of_the_json(replay_dir):
    flipped = json.loads(report(str(replay_dir), "--format", "json").stdout)["flips"]
    table = list(csv.reader(io.StringIO(report(str(replay_dir), "--format", "csv", "--csv-cases").stdout)))
    assert table[0][:6] == ["Model", "Profile", "Case", "Category", "Direction", "Error Type"]
    assert len(table) - 1 == len(flipped) == 18
    for row, f in zip(table[1:], flipped):
        assert row == [f["model"], f["profile"], f["case_id"], f["category"], f["direction"], f["error_type"],
                       f["perturbation"], f["expected"] or "", f["calls"], f["baseline_calls"]]


def test_live_summary_has_intervals_and_the_paired_test(tmp_path):
    from toolquake.proxy.live import results

    store = results.ResultsStore(tmp_path / "live.sqlite")
    n = 0
    for p in ("off", "shuffled"):
        for i in range(N_CASES):
            v = verdict(p, i)
            if v is None:
                continue
            n += 1
            store.append(results.Row(request_id=f"r{n}", profile=p, mode="perturb", arm="live", model="m",
                                     stream=False, status=200, case_id=case_id(i),
                                     category="simple_python" if i < 40 else "multiple", valid=v,
                                     taxonomy=None if v else "wrong_function"))
    for i, agree in enumerate(["true"] * 7 + ["semantic", "false", "false"]):
        store.append(results.Row(request_id=f"t{i}", profile="sh", mode="shadow", arm="twin", model="m",
                                 stream=False, status=200, agree=agree))
    store.close()
    s = summarize_db(tmp_path / "live.sqlite")
    sh = _independent("shuffled")
    assert s["arms"]["shuffled"]["accuracy_ci"] == pytest.approx(sh["ci"], abs=1e-4)
    cmp = s["arms"]["shuffled"]["paired"]
    assert (cmp["valid_to_invalid"], cmp["invalid_to_valid"], cmp["n"]) == (12, 3, 59)
    assert cmp["p_value"] == pytest.approx(sh["p"])
    consistent = stats.binomtest(8, 10).proportion_ci(method="wilson")
    assert s["consistency_ci"]["sh"]["rate_semantic"] == pytest.approx([consistent.low, consistent.high], abs=1e-4)
    text = render_markdown(s)
    lo, hi = sh["ci"]
    assert f"[{lo * 100:.1f}, {hi * 100:.1f}]" in text and f"| 59 | 12 | 3 | {sh['p']:.2g} | yes |" in text
    assert f"| 80.0 % [{consistent.low * 100:.1f}, {consistent.high * 100:.1f}] |" in text


# ---------------------------------------------------------------------------------------------
# the HTML report in a real browser


@pytest.mark.processes
def test_chromium_checks_catch_console_errors_and_network_requests(tmp_path):
    """The two checks below can fail: a page with a script error and a remote image trips both."""
    browser = chromium()
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><p>x</p><img src='http://192.0.2.1/x.png'><script>nope();</script>")
    r, requests = open_page(browser, tmp_path, bad.as_uri(), "--dump-dom")
    assert any("nope is not defined" in line for line in console(r.stderr))
    assert requests == ["http://192.0.2.1/x.png"]


@pytest.mark.processes
def test_html_report_in_headless_chromium(replay_dir, tmp_path):
    browser = chromium()
    page = tmp_path / "report.html"
    report(str(replay_dir), "--format", "html", "--out", str(page))
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", text)  # one self-contained file
    assert text.count("data:image/svg+xml;base64,") == 1  # the accuracy plot
    r, requests = open_page(browser, tmp_path, page.as_uri(), "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    html = r.stdout
    assert "<section id=\"summary\">" in html and "which perturbations hurt most" in html
    order = [html.index(s) for s in ("id=\"summary\"", "id=\"tables\"", "AST accuracy per arm", "id=\"plots\"",
                                     "id=\"cases\"")]
    assert order == sorted(order)
    assert html.count("<details class=\"arm\">") == 2
    assert f"<td>{case_id(4)}</td>" in html and "param_rename" in html
    # the filter script ran: every flipped case counted (12 + 3 shuffled, 2 + 1 renamed)
    assert "18 of 18 flipped cases shown" in html
    # expected | this arm's calls | the baseline's calls, side by side in one row
    row = re.search(rf"<tr class=\"valid_to_invalid\"[^>]*><td>{case_id(4)}</td>.*?</tr>", html, re.S).group(0)
    assert row.index("call_renamed_4") < row.index("call_off_4")

    # a #q= address filters the rows in the browser: one case left, its arm opened
    r, requests = open_page(browser, tmp_path, page.as_uri() + f"#q={case_id(4)}", "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    shown = re.findall(r"<tr class=\"(?:valid_to_invalid|invalid_to_valid)\" data-direction=\"\w+\">", r.stdout)
    assert len(shown) == 1 and "1 of 18 flipped cases shown" in r.stdout  # case 4 flipped in `renamed` only
    assert "<details class=\"arm\" open=\"\">" in r.stdout

    shot = tmp_path / "report.png"
    r, requests = open_page(browser, tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1400,1800")
    assert console(r.stderr) == [] and requests == []
    from PIL import Image

    with Image.open(shot) as img:
        assert img.format == "PNG" and img.size == (1400, 1800)
        gray = img.convert("L")
        dark = sum(gray.histogram()[:128])  # text, table rules, plot marks
        assert dark > 0.005 * 1400 * 1800 and len(gray.getcolors(256) or []) > 20  # not blank
    keep = ROOT / ".pytest_cache" / "report-screenshot.png"  # for a person to look at
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)


@pytest.mark.processes
def test_html_report_with_hundreds_of_flipped_cases_stays_one_filterable_page(tmp_path):
    browser = chromium()
    n = 600
    f = ResultsFile(tmp_path / "big" / "replay.sqlite")
    f.claim("m1", "http://backend/v1")
    f.register_arms({p: PROFILES[p] for p in ("off", "shuffled")})
    lost = set()
    for i in range(n):
        cid = f"multiple_{i}"
        f.record(Record(cid, "off", "multiple", "scored", valid=True, answer=_answer(f"call_off_{i}")))
        broke = i % 3 != 0  # the perturbation breaks two cases in three: 400 flipped
        if broke:
            lost.add(cid)
        f.record(Record(cid, "shuffled", "multiple", "scored", valid=not broke, taxonomy="wrong_function" if broke
                        else None, answer=_answer(f"call_shuffled_{i}"),
                        perturbers={"applied": [{"name": "tool_order", "params": {"mode": "shuffle"},
                                                 "report": REPORTS["tool_order"](i)}], "skipped": [], "failed": []}))
    f.close()
    page = tmp_path / "big.html"
    report(str(tmp_path / "big"), "--format", "html", "--out", str(page))
    r, requests = open_page(browser, tmp_path, page.as_uri(), "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    assert f"{len(lost)} of {len(lost)} flipped cases shown" in r.stdout
    assert r.stdout.count("data-direction=\"valid_to_invalid\"") == len(lost) == 400
    assert "<details class=\"arm\">" in r.stdout  # collapsed until asked
    # filtering by a case id finds exactly that case (multiple_5 also matches multiple_50..59, 500..599)
    r, _ = open_page(browser, tmp_path, page.as_uri() + "#q=multiple_5", "--dump-dom")
    want = sum(1 for c in lost if c.startswith("multiple_5"))
    assert f"{want} of {len(lost)} flipped cases shown" in r.stdout


def test_perturbation_text_leaves_out_empty_parameters_but_keeps_zero_and_false() -> None:
    from toolquake.proxy.replay.report import perturbation_text

    stored = {"applied": [{"name": "toolkit_expansion", "params": {"k": 3, "generator_url": "", "cache_dir": None,
                                                                      "band": [0.5, 0.75], "seed": 0, "strict": False},
                           "report": {"added": ["a"]}}]}
    text = perturbation_text(stored)
    assert text == ('toolkit_expansion({"k": 3, "band": [0.5, 0.75], "seed": 0, "strict": false}) '
                    '→ {"added": ["a"]}')
