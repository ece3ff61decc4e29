"""One report for live traffic and replays: the same verdicts through `toolquake serve --results-db` (the proxy as a
process, live scoring, the fake upstream as the model) and through `toolquake replay` (the same fake) give the same
numbers, by the same code, in every format; a live store and a replay directory reported together; the live HTML
report in headless Chromium.

The fake upstream is an oracle (tests/replay/test_replay.py): its script answers each case with its ground truth,
except a few cases answered with another function; `X-Fake-Answer-By-First-Tool` answers with a text (no call)
when the request's first tool is the last tool of one of a few other cases, so the `reversed` profile (tools in
reverse order) breaks exactly those. The expected verdicts are known before either run.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.support import ROOT, scraped, start_fake_upstream, start_proxy, wait_for
from tests.support.browser import chromium, console, open_page
from tests.support.replay import oracle_script, replay
from tests.support.report import SAME, report

pytestmark = [pytest.mark.processes, pytest.mark.needs_corpus]

N_CASES = 12
WRONG = (0, 5)  # answered with another function under every profile
BROKEN = (2, 3, 7, 9, 11)  # answered with a text when their tools come in reverse order
PROFILES = ("off", "reversed")


def _name(function: dict) -> str:
    from toolquake.bfcl.convert import openai_name

    return openai_name(function["name"])


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same cases under off and reversed, through a live proxy (its store) and through a replay (its dir)."""
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.bfcl.corpus import case_request, load_category

    cases = load_category("multiple")[:N_CASES]
    firsts = {_name(c.functions[0]) for c in cases}
    broken = {_name(cases[i].functions[-1]): {"text": "I cannot help with that."} for i in BROKEN}
    assert not set(broken) & firsts, "a broken case's last tool must be no case's first"
    header = json.dumps(broken, separators=(",", ":"))
    script = oracle_script(cases, {cases[i].id for i in WRONG})
    fake = start_fake_upstream("--script", str(script))
    tmp = tmp_path_factory.mktemp("live-report")
    db, runs = tmp / "live.sqlite", tmp / "runs"
    proxy = start_proxy(fake.url, None, None, "--results-db", str(db), "--store-contents")
    try:
        for profile in PROFILES:
            client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-live", max_retries=0)
            for case in cases:
                body = case_request(case)
                assert [t["function"]["name"] for t in body["tools"]] == [
                    t["function"]["name"] for t in to_openai_tools(case.functions)[0]]
                client.chat.completions.create(
                    model="fake-model", messages=body["messages"], tools=body["tools"],
                    extra_headers={"X-Toolquake-Case": case.id, "X-Fake-Answer-By-First-Tool": header})
        wait_for(lambda: scraped(proxy, "toolquake_scored_total") == 2 * N_CASES, what="every answer scored")
        r = replay("--backend", f"{fake.url}/v1", "--profiles", ",".join(PROFILES), "--categories", "multiple",
                   "--limit", str(N_CASES), "--header", f"X-Fake-Answer-By-First-Tool: {header}", "--out", str(runs))
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        proxy.stop()
        fake.stop()
        script.unlink()
    yield cases, db, runs


def test_live_traffic_and_a_replay_of_the_same_verdicts_give_the_same_report(both):
    cases, db, runs = both
    live = json.loads(report("--db", str(db), "--format", "json").stdout)
    replayed = json.loads(report(str(runs), "--format", "json").stdout)
    # the expected verdicts: off loses WRONG; reversed loses WRONG and BROKEN; the paired drop is over all cases
    off_right = N_CASES - len(WRONG)
    lost = set(BROKEN) - set(WRONG)
    for summary in (live, replayed):
        off, rev = summary["arms"]["off"], summary["arms"]["reversed"]
        assert (off["n"], rev["n"]) == (N_CASES, N_CASES)
        assert off["accuracy"] == pytest.approx(off_right / N_CASES)
        assert rev["accuracy"] == pytest.approx((off_right - len(lost)) / N_CASES)
        assert rev["paired"]["n"] == N_CASES and rev["paired"]["valid_to_invalid"] == len(lost)
        assert rev["drop_vs_off"] == pytest.approx(-len(lost) / off_right)
        lo, hi = rev["drop_vs_off_ci"]
        assert lo <= rev["drop_vs_off"] <= hi
        lo, hi = rev["drop_vs_off_cs"]
        assert lo <= rev["drop_vs_off"] <= (float("inf") if hi is None else hi)
        assert rev["anytime_pairs"] == N_CASES
        assert {(f["profile"], f["case_id"], f["direction"]) for f in summary["flips"]} == {
            ("reversed", cases[i].id, "valid_to_invalid") for i in lost}
    # one definition of each statistic: the same numbers, the same keys, each arm saying where it came from
    for p in PROFILES:
        a, b = live["arms"][p], replayed["arms"][p]
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, p
        assert set(a) == set(b)
        assert (a["source"], b["source"]) == ("live", "replay")
    assert set(live) - set(replayed) == {"db", "rows", "consistency", "consistency_ci", "noise", "noise_ci",
                                         "conformance"}
    assert set(replayed) <= set(live)
    assert list(live["models"]) == ["live"] and live["rows"] == 2 * N_CASES
    # the per-case diffs of live traffic: what was applied, the arm's answer and off's (store_contents)
    [flip] = [f for f in live["flips"] if f["case_id"] == cases[BROKEN[0]].id]
    assert flip["perturbation"].startswith("tool_order(") and "I cannot help" in flip["calls"]
    assert flip["baseline_calls"].startswith(_name({"name": next(iter(cases[BROKEN[0]].ground_truth[0]))}) + "(")
    # every format, every table
    md = report("--db", str(db), "--no-plots").stdout
    for title in ("## Summary: which perturbations hurt most", "## AST accuracy per arm", "## Per category: live",
                  "## Live results store", "## Fixed-sample and anytime-valid 95% intervals",
                  "## Per-case diffs against off"):
        assert title in md, title
    csv = report("--db", str(db), "--format", "csv", "--csv-stats").stdout.splitlines()
    assert csv[0].startswith("Rank,Overall Acc,Model,Profile") and any(",live,reversed," in line for line in csv)
    cases_csv = report("--db", str(db), "--format", "csv", "--csv-cases").stdout.splitlines()
    assert len(cases_csv) == 1 + len(lost)
    # the CLI's JSON is the report package's, for both sources
    from toolquake.proxy.replay.report import load, summarize, summarize_db

    assert live == json.loads(json.dumps(summarize_db(db)))
    assert replayed == json.loads(json.dumps({**summarize(load([runs])), "flips": replayed["flips"]}))


def test_a_live_store_and_a_replay_directory_in_one_report(both, tmp_path):
    _, db, runs = both
    together = json.loads(report("--db", str(db), str(runs), "--format", "json").stdout)
    assert together["arms"]["reversed [live]"]["source"] == "live"
    from toolquake.proxy.replay.report import load, summarize, summarize_db

    live, replayed = summarize_db(db), summarize(load([runs]))
    [model] = replayed["models"]
    assert list(together["models"]) == ["live", model]
    assert together["sources"] == [str(db), *replayed["sources"]]
    for p in PROFILES:
        assert together["arms"][f"{p} [live]"]["source"] == "live"
        assert together["arms"][f"{p} [{model}]"]["source"] == "replay"
        for k in SAME:
            assert together["models"]["live"]["arms"][p][k] == json.loads(json.dumps(live["arms"][p][k])), k
            assert together["models"][model]["arms"][p][k] == json.loads(json.dumps(replayed["arms"][p][k])), k
    # each source's cases are paired within the source only: live off is not a baseline for the replay's arms
    assert {(f["model"], f["profile"]) for f in together["flips"]} == {("live", "reversed"), (model, "reversed")}
    md = report("--db", str(db), str(runs), "--no-plots").stdout
    assert md.startswith("# toolquake live and replay report")
    assert "| live | reversed |" in md and f"| {model} | reversed |" in md


def test_the_live_html_report_in_headless_chromium(both, tmp_path):
    browser = chromium()
    _, db, _ = both
    page = tmp_path / "live.html"
    report("--db", str(db), "--format", "html", "--out", str(page))
    r, requests = open_page(browser, tmp_path, page.as_uri(), "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    html = r.stdout
    order = [html.index(s) for s in ("id=\"summary\"", "id=\"tables\"", "Fixed-sample and anytime-valid",
                                     "id=\"plots\"", "id=\"cases\"")]
    assert order == sorted(order)
    lost = len(set(BROKEN) - set(WRONG))
    assert f"{lost} of {lost} flipped cases shown" in html  # the filter script ran over live traffic's diffs
    shot = tmp_path / "live.png"
    r, requests = open_page(browser, tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1400,2400")
    assert console(r.stderr) == [] and requests == []
    from PIL import Image

    with Image.open(shot) as img:
        gray = img.convert("L")
        assert img.size == (1400, 2400) and sum(gray.histogram()[:128]) > 0.005 * 1400 * 2400  # not blank
    keep = ROOT / ".pytest_cache" / "live-report-screenshot.png"  # for a person to look at
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)

