"""`toolquake report` of sweep results: the JSON shape, the survival curve, its intervals and the median's,
recomputed here independently from the fake's hidden breaking points (scipy for the statistics); two runs overlaid
and compared pairwise; every format; the HTML drawn by headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.report import report_run
from tests.support.sweep import HIDDEN_TOOLS, breaking_file, cases_file, is_wrong, sweep

stats = pytest.importorskip("scipy.stats", reason="scipy recomputes the intervals independently")

# the tools axis adds tools screened with the embedding model
pytestmark = [pytest.mark.processes, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.needs_embeddings]

#: the second model: every case breaks 20 tools earlier (or at once)
HIDDEN_B = {cid: [[max(1, w[0][0] - 20), w[0][1]]] if w else [[181, None]] for cid, w in HIDDEN_TOOLS.items()}


def _truth(wrong: list) -> tuple[int | None, int | None]:
    """(last right, first wrong) on the grid 1..200 — the first break, as the sweep defines it."""
    first = next((x for x in range(1, 201) if is_wrong(x, wrong)), None)
    last = (first - 1 if first and first > 1 else None) if first is not None else 200
    return last, first


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("sweep-report")
    cases = cases_file(list(HIDDEN_TOOLS))
    runs = []
    for name, hidden, model in (("a", HIDDEN_TOOLS, []), ("b", HIDDEN_B, ["--model", "model-b"])):
        fake = start_fake_upstream("--breaking", str(breaking_file(hidden, "tools")))
        try:
            r = sweep("--backend", f"{fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1", "--max",
                      "200", "--out", str(base / name), *model)
        finally:
            fake.stop()
        assert r.returncode == 0, r.stderr
        runs.append(base / name)
    return runs[0], runs[1]


def report(*args: str) -> subprocess.CompletedProcess:
    return report_run(*args)


def _wilson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def test_json_shape_curve_and_intervals_recomputed_independently(two_runs):
    a, _ = two_runs
    r = report(str(a), "--format", "json", "--no-plots")
    assert r.returncode == 0, r.stderr
    axis = json.loads(r.stdout)["sweeps"]["fake-model"]["tools"]
    db = sqlite3.connect(a / "sweep.sqlite")
    spent = dict(db.execute("SELECT case_id, COUNT(*) FROM results GROUP BY case_id").fetchall())
    db.close()
    truths = {cid: _truth(w) for cid, w in HIDDEN_TOOLS.items()}
    assert set(axis["cases"]) == set(HIDDEN_TOOLS)
    for cid, entry in axis["cases"].items():
        assert set(entry) == {"last_right", "first_wrong", "requests"}
        assert (entry["last_right"], entry["first_wrong"]) == truths[cid], cid
        assert entry["requests"] == spent[cid]
    assert axis["censored"] == ["t-never"] and axis["wrong_at_min"] == ["t-at-once"]
    assert list(axis["non_monotone"]) == ["t-window"]
    n = len(truths)
    steps = sorted({1, *(f for _, f in truths.values() if f is not None)})
    assert [p["x"] for p in axis["curve"]] == steps
    for point in axis["curve"]:
        k = sum(1 for last, _ in truths.values() if last is not None and last >= point["x"])
        assert (point["right"], point["n"]) == (k, n)
        assert point["share"] == pytest.approx(k / n)
        assert point["ci"] == pytest.approx(_wilson(k, n), abs=1e-4)  # z = 1.96 here, 1.95996… in scipy
    # the median breaking point: the smallest x where S(x) <= 1/2; its order-statistic interval from scipy's binomial
    firsts = sorted(float("inf") if f is None else f for _, f in truths.values())
    assert axis["median"] == min(p["x"] for p in axis["curve"] if p["share"] <= 0.5) == firsts[(n - 1) // 2]
    j = max([j for j in range(1, n // 2 + 1) if stats.binom.cdf(j - 1, n, 0.5) <= 0.025] or [1])
    lo, hi = firsts[j - 1], firsts[n - j]
    assert axis["median_ci"] == [None if lo == float("inf") else lo, None if hi == float("inf") else hi]
    assert axis["median_ci_level"] == pytest.approx(1 - 2 * stats.binom.cdf(j - 1, n, 0.5), abs=1e-4)
    assert axis["categories"]["sweepfake"]["curve"] == axis["curve"]


def test_two_models_overlaid_and_compared_pairwise(two_runs, tmp_path):
    a, b = two_runs
    r = report(str(a), str(b), "--format", "json", "--no-plots")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data["sweeps"]) == {"fake-model", "model-b"}
    (cmp,) = data["sweep_comparisons"]
    pa = {c: _truth(w)[1] or float("inf") for c, w in HIDDEN_TOOLS.items()}
    pb = {c: _truth(w)[1] or float("inf") for c, w in HIDDEN_B.items()}
    a_later = sum(1 for c in pa if pa[c] > pb[c])
    b_later = sum(1 for c in pa if pb[c] > pa[c])
    assert (cmp["a"], cmp["b"], cmp["n"], cmp["a_later"], cmp["b_later"]) == ("fake-model", "model-b", len(pa),
                                                                               a_later, b_later)
    assert cmp["p_value"] == pytest.approx(stats.binomtest(a_later, a_later + b_later, 0.5).pvalue)
    # one model swept in two directories (two proxies, two settings): each run labelled by its directory
    shutil.copytree(a, tmp_path / "again")
    r = report(str(a), str(tmp_path / "again"), "--format", "json", "--no-plots")
    labels = set(json.loads(r.stdout)["sweeps"])
    assert labels == {f"fake-model ({a.name})", "fake-model (again)"}


def test_every_format_and_the_html_curve_in_chromium(two_runs, tmp_path):
    a, b = two_runs
    md = report(str(a), str(b), "--format", "md", "--out", str(tmp_path / "r.md"))
    assert md.returncode == 0, md.stderr
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("# toolquake sweep report\n") and "replay" not in text.lower()
    assert "Survival along tools" in text and "| fake-model | t-window |" in text and "right again at" in text
    assert (tmp_path / "r-survival-tools.png").stat().st_size > 5000
    csv_out = report(str(a), "--format", "csv")
    lines = csv_out.stdout.splitlines()
    assert lines[0].startswith("Model,Axis,Unit,Case") and len(lines) == 1 + len(HIDDEN_TOOLS)
    assert "fake-model,tools,tools in the request,t-50,sweepfake,50,51," in csv_out.stdout
    html = report(str(a), str(b), "--format", "html", "--out", str(tmp_path / "r.html"))
    assert html.returncode == 0, html.stderr
    page = (tmp_path / "r.html").read_text()
    assert "<title>toolquake sweep report</title>" in page and "<h1>toolquake sweep report</h1>" in page
    assert "replay" not in page.lower()
    assert "survival-tools.svg" in page and "data:image/svg+xml;base64," in page
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium to draw the HTML report")
    shot = tmp_path / "r.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,2400", (tmp_path / "r.html").as_uri()], capture_output=True, timeout=120)
    assert shot.stat().st_size > 50_000  # a page with tables and the plot, not a blank one


def test_the_title_says_what_the_results_hold(two_runs, tmp_path):
    """A report of replays is a replay report, of sweeps a sweep report, of both a replay and sweep report."""
    a, _ = two_runs
    fake = start_fake_upstream()
    try:
        r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", f"{fake.url}/v1",
                            "--cases", str(cases_file(["t-7"])), "--profiles", "off", "--out", str(tmp_path / "rp")],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                           timeout=300)
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr
    for dirs, title in (([tmp_path / "rp"], "toolquake replay report"), ([a], "toolquake sweep report"),
                        ([tmp_path / "rp", a], "toolquake replay and sweep report")):
        md = report(*map(str, dirs), "--no-plots")
        assert md.returncode == 0 and md.stdout.startswith(f"# {title}\n"), md.stdout[:200]
        out = tmp_path / f"{len(dirs)}-{title.split()[1]}.html"
        html = report(*map(str, dirs), "--no-plots", "--format", "html", "--out", str(out))
        assert html.returncode == 0, html.stderr
        assert f"<title>{title}</title>" in out.read_text() and f"<h1>{title}</h1>" in out.read_text()
