"""Report outputs escape what clients and models chose (#28): model, profile and tool names, case ids,
categories, error texts and calls reach the Markdown, HTML, CSV and JSON reports as text, never as markup,
formulas or hidden characters; the results files are 0600.

The results are written through the replay's own writer (`ResultsFile`) or produced by a real `toolquake
replay` against the fake upstream (a model name comes from `--model`); the reports are built by
`report.build` (the function `toolquake report` calls) or by the CLI as a process.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import ROOT
from tests.support.browser import chromium, console, open_page
from tests.support.report import report_run
from toolquake.proxy.escape import FORMULA_STARTS
from toolquake.proxy.replay import report
from toolquake.proxy.replay.report import render_markdown, summarize_db
from toolquake.proxy.replay.store import Record, ResultsFile

#: what an attacker would put in a name
SEEDS = ["<svg onload=alert(1)>", "</script><script>alert(1)</script>", "=HYPERLINK(\"http://evil\",\"x\")",
         "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\tq", "\r=1", "a|b|c", "`code`", "*bold* _em_ ~s~",
         "[link](javascript:alert(1))", "![img](http://evil/x.png)", "&lt;&#60;", "$\\frac{1}{0}$", "\u202egnp.exe",
         "\x00nul", "\u2066iso\u2069", "zero\u200bwidth", "\ufeffbom", "tag\U000e0041", "\\|\\`", "#h", "\n\n| x |",
         "   ", "\u2028\u2029", "\x7f\x85\x9b", "-0.25", "'quoted'", "\"dq\""]
_CHARS = "<>&|`*_[]()!#~$\\\"'=+-@ \t\r\n\x00\x1b\u202e\u2066\u200b\ufeffa1"

hostile = st.one_of(
    st.sampled_from(SEEDS),
    st.text(alphabet=st.sampled_from(list(_CHARS)), min_size=1, max_size=40),
    st.lists(st.sampled_from(SEEDS), min_size=1, max_size=4).map("".join),
    st.tuples(st.sampled_from(SEEDS), st.integers(1, 200)).map(lambda t: t[0] * t[1]),
    st.integers(1, 300).map(lambda n: "[" * n + "(" * n + "<" * n),  # deep nesting
    st.integers(1, 2000).map(lambda n: " " * n + "x"),  # a long whitespace run
    st.text(min_size=1, max_size=30),
)


def write(path: Path, *, model: str, profile: str, case: str, tool: str, error: str, category: str) -> None:
    """Two arms over three cases through the replay's writer: `off` right everywhere, `profile` wrong on two
    cases (flips, with the hostile tool name in the calls and the hostile error text as the error type)."""
    f = ResultsFile(path)
    f.claim(model, "http://backend/v1")
    spec = {"mode": "perturb", "perturbers": [{"name": "tool_order", "params": {"mode": tool}, "probability": 1.0}]}
    f.register_arms({"off": {"mode": "off", "perturbers": []}, profile: spec})
    for i in range(3):
        cid = f"{case}{i}"
        call = {"id": "c1", "type": "function", "function": {"name": tool, "arguments": json.dumps({"q": error})}}
        answer = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
        f.record(Record(cid, "off", category, "scored", valid=True, answer=answer))
        applied = [{"name": "tool_order", "params": {"mode": tool}, "report": {"order": [tool, error]}}]
        f.record(Record(cid, profile, category, "scored", valid=i == 0, taxonomy=None if i == 0 else error,
                        answer=answer, perturbers={"applied": applied, "skipped": [], "failed": []}))
    f.record(Record(f"{case}x", profile, category, "error", error_code=error, error=error))
    f.close()


def names(draw_one) -> dict[str, str]:
    return {k: draw_one() for k in ("model", "profile", "case", "tool", "error", "category")}


def render_all(path: Path) -> dict[str, str]:
    out = {fmt: report.build([path], fmt, None, plots=False)[0] for fmt in ("md", "html", "json")}
    out["csv"] = report.build([path], "csv", None, plots=False, csv_stats=True)[0]
    out["csv_cases"] = report.build([path], "csv", None, plots=False, csv_cases=True)[0]
    out["csv_tables"] = report.build([path], "csv", None, plots=False, csv_tables=True)[0]
    return out


# ---------------------------------------------------------------------------------------------
# what each output may contain

_HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def hidden_chars(text: str, allowed: str) -> list[str]:
    """Control, format (bidi, zero-width), separator and surrogate characters in `text`, beside `allowed`."""
    return [f"U+{ord(c):04X}" for c in text if c not in allowed and c != "\u200d"
            and unicodedata.category(c) in _HIDDEN]


def md_cells(line: str) -> int:
    """Cell separators of a Markdown table row: `|` not escaped by a backslash."""
    n, i = 0, 0
    while i < len(line):
        if line[i] == "\\":
            i += 2
            continue
        n += line[i] == "|"
        i += 1
    return n


def check_markdown(md: str) -> None:
    assert "<" not in md  # nothing the renderer writes needs it; every name's `<` is &lt;
    assert not hidden_chars(md, "\n")
    # every table keeps its shape: no name adds or removes a cell
    for block in re.split(r"\n(?!\|)", md):
        rows = [line for line in block.split("\n") if line.startswith("|")]
        assert len({md_cells(r) for r in rows}) <= 1, rows[:3]
    # no link or image can close: every `](` / `][` is escaped
    assert not re.search(r"(?<!\\)\][(\[]", md)


_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?%?")


def check_csv(text: str) -> list[list[str]]:
    rows = list(csv.reader(io.StringIO(text)))
    assert len({len(r) for r in rows}) == 1  # rectangular
    for row in rows:
        for cell in row:
            if cell and cell[0] in FORMULA_STARTS:
                assert _NUMBER.fullmatch(cell), cell  # only numbers start with a formula character
            assert not hidden_chars(cell, "\n\t")
    return rows


def check_html(page: str) -> None:
    assert not hidden_chars(page, "\n\t")
    low = page.lower()
    assert "<svg" not in low and "<img" not in low  # no plots asked for: any such tag came from a name
    assert low.count("<script") == 1 and low.count("</script") == 1  # the page's own filter script
    assert all(a.startswith("<a href='#") for a in re.findall(r"<a\b[^>]*>", page))  # only the page's own links
    # every tag is one the renderer writes
    tags = set(re.findall(r"<\s*/?\s*([a-zA-Z][a-zA-Z0-9-]*)", page))
    assert tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "nav", "a", "section",
                    "ul", "li", "table", "thead", "tbody", "tr", "th", "td", "details", "summary", "span", "div",
                    "label", "input", "select", "option", "code", "dl", "dt", "dd", "script"}, tags


# ---------------------------------------------------------------------------------------------
# properties


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_report_escapes_hostile_names_and_texts(data):
    n = names(lambda: data.draw(hostile))
    if n["profile"] == "off":
        n["profile"] += "!"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.sqlite"
        write(path, **n)
        out = render_all(path)
    check_markdown(out["md"])
    check_html(out["html"])
    for kind in ("csv", "csv_cases", "csv_tables"):
        check_csv(out[kind])
    # the cases CSV keeps every flipped case, one row each, with the names readable after the neutralising quote
    rows = check_csv(out["csv_cases"])
    assert len(rows) == 1 + 2
    want = report_visible(n["model"])
    if not _NUMBER.fullmatch(n["model"]) and want[:1] in FORMULA_STARTS:
        want = "'" + want
    assert [row[0] for row in rows[1:]] == [want] * 2
    # JSON keeps the values exactly (a reader escapes for its own display)
    summary = json.loads(out["json"])
    assert [f["model"] for f in summary["flips"]] == [n["model"]] * 2
    assert {f["case_id"] for f in summary["flips"]} == {n["case"] + "1", n["case"] + "2"}


def report_visible(text: str) -> str:
    from toolquake.proxy.escape import visible

    return visible(text, "\n\t")


def test_markdown_and_csv_by_hand(tmp_path):
    """The shapes a reader sees, for the names of the issue."""
    path = tmp_path / "replay.sqlite"
    write(path, model="<svg onload=alert(1)>", profile="=HYPERLINK(\"http://evil\",\"x\")", case="c|`x`_\u202e",
          tool="get\u202eweather", error="-0.25", category="simple")
    out = render_all(path)
    md, page = out["md"], out["html"]
    assert "&lt;svg onload=alert(1)>" in md and "<svg" not in md
    assert "=HYPERLINK(\"http://evil\",\"x\")" in md  # text in Markdown: no formula there
    assert "c\\|\\`x\\`\\_\\u202e1" in md  # the case id: cell separator, backticks, emphasis, bidi all literal
    assert "get\\u202eweather" in md
    assert "&lt;svg onload=alert(1)&gt;" in page and "<span class='ctl' title='U+202E'>\\u202e</span>" in page
    cases = list(csv.DictReader(io.StringIO(out["csv_cases"])))
    assert {c["Profile"] for c in cases} == {"'=HYPERLINK(\"http://evil\",\"x\")"}
    assert {c["Error Type"] for c in cases} == {"-0.25"}  # a number stays a number
    assert all("get\\u202eweather" in c["Calls"] for c in cases)
    board = list(csv.DictReader(io.StringIO(out["csv"])))
    drop = next(r for r in board if r["Profile"].startswith("'="))["Drop vs Baseline"]
    assert drop == "-66.67%"  # a negative number keeps its sign, unquoted


# ---------------------------------------------------------------------------------------------
# time grows linearly


def _big(size: int) -> str:
    unit = "<svg onload=alert(1)>|`*_[](x)\u202e\x00 =HYPERLINK(1) \t\n" + " " * 40 + "((((]]]]"
    return (unit * (size // len(unit) + 1))[:size]


def _build_time(tmp: Path, size: int, attempts: int) -> float:
    best = float("inf")
    for attempt in range(attempts):
        path = tmp / f"r{size}-{attempt}.sqlite"
        text = _big(size)
        write(path, model=text, profile="p<svg>|", case=text, tool=text, error=text, category="c\u202e|")
        t0 = time.process_time()
        out = render_all(path)
        best = min(best, time.process_time() - t0)
        assert "<" not in out["md"] and "\u202e" not in out["html"] and "<svg" not in out["html"]
    return best


def test_report_time_grows_linearly_with_the_names(tmp_path):
    """64 KiB and 1 MiB model names, case ids, tool names and error texts: the cost per KiB at 1 MiB stays within a
    few times the cost at 64 KiB (quadratic code would be 16 times; the bound is wide for a loaded machine), and the
    1 MiB report takes under 30 s of CPU (a ratio and a coarse bound: no sub-second threshold)."""
    small, big = 64 * 1024, 1024 * 1024
    t_small = _build_time(tmp_path, small, 2)
    t_big = _build_time(tmp_path, big, 1)
    per_kib_small, per_kib_big = t_small / 64, t_big / 1024
    assert t_big < 30, f"{t_big:.1f} s of CPU for 1 MiB"
    assert per_kib_big < 5 * per_kib_small + 2e-3, (t_small, t_big)


# ---------------------------------------------------------------------------------------------
# the live results store's summary


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_live_results_summary_escapes_names(data):
    from toolquake.proxy.live import results

    n = names(lambda: data.draw(hostile))
    with tempfile.TemporaryDirectory() as tmp:
        store = results.ResultsStore(Path(tmp) / "live.sqlite")
        for i in range(4):
            for profile in ("off", n["profile"] + "!"):
                store.append(results.Row(request_id=f"{profile}{i}", profile=profile, mode="perturb", arm="main",
                                         model=n["model"], stream=False, status=200, case_id=f"case{i}",
                                         category=n["category"], valid=profile == "off" or i == 0,
                                         taxonomy=None if profile == "off" or i == 0 else n["error"]))
        store.close()
        check_markdown(render_markdown(summarize_db(Path(tmp) / "live.sqlite")))


# ---------------------------------------------------------------------------------------------
# a real replay with a hostile --model, the report from the CLI, and the page in a browser

HOSTILE_MODEL = "=HYPERLINK(\"http://evil\")<svg onload=alert(1)></script>\u202egnp.exe"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from toolquake.bfcl.corpus import is_present

    if not is_present():
        pytest.skip("needs the BFCL corpus (make corpus)")
    from tests.support import start_fake_upstream

    out = tmp_path_factory.mktemp("hostile") / "run"
    fake = start_fake_upstream()
    try:
        old = os.umask(0o022)  # what a shell gives: the file must be 0600 anyway
        try:
            r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend",
                                f"{fake.url}/v1", "--model", HOSTILE_MODEL, "--categories", "simple_python",
                                "--profiles", "off,shuffled", "--limit", "3", "--out", str(out)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                               timeout=300)
        finally:
            os.umask(old)
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        fake.stop()
    return out


def cli_report(*args: str) -> str:
    r = report_run(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_replay_with_a_hostile_model_name_reports_it_as_text(replayed, tmp_path):
    files = sorted(replayed.glob("replay*.sqlite*"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), \
        [(f.name, oct(f.stat().st_mode)) for f in files]
    md = cli_report(str(replayed), "--no-plots")
    check_markdown(md)
    assert "=HYPERLINK(\"http://evil\")&lt;svg onload=alert(1)>&lt;/script>\\u202egnp.exe" in md
    page = tmp_path / "r.html"
    cli_report(str(replayed), "--format", "html", "--no-plots", "--out", str(page))
    check_html(page.read_text())
    rows = check_csv(cli_report(str(replayed), "--format", "csv"))
    assert {r[2] for r in rows[1:]} == {"'" + report_visible(HOSTILE_MODEL)}


@pytest.mark.processes
def test_html_report_with_hostile_names_in_headless_chromium(tmp_path):
    """The page with a hostile model, profile, case id and tool name: no element of theirs, no script error,
    the filter script still runs, and the bidi override shows as text. The screenshot is kept for a person."""
    browser = chromium()
    path = tmp_path / "replay.sqlite"
    write(path, model="<svg onload=alert(1)>", profile="</script><script>alert(2)</script>",
          case="case\u202e1gnp.", tool="get\u202eweather\x00", error="<img src=x onerror=alert(3)>",
          category="simple")
    page = tmp_path / "report.html"
    cli_report(str(path), "--format", "html", "--no-plots", "--out", str(page))
    r, requests = open_page(browser, tmp_path, page.as_uri(), "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    dom = r.stdout
    assert "<svg" not in dom and "<img" not in dom and dom.count("<script") == 1  # the DOM has no element of theirs
    assert "2 of 2 flipped cases shown" in dom  # the page's script ran to the end
    assert "&lt;svg onload=alert(1)&gt;" in dom and "\u202e" not in dom and "\\u202e" in dom
    shot = tmp_path / "report.png"
    r, _ = open_page(browser, tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1400,1000")
    assert shot.stat().st_size > 0, r.stderr[-2000:]
    keep = ROOT / ".pytest_cache" / "report-hostile-screenshot.png"  # for a person to look at
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)


# ---------------------------------------------------------------------------------------------
# the results files are 0600


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_results_files_are_created_0600_whatever_the_umask(tmp_path, umask):
    from toolquake.proxy.live import results

    old = os.umask(umask)
    try:
        store = results.ResultsStore(tmp_path / "live" / "live.sqlite", store_contents=True)
        store.append(results.Row(request_id="r", profile="off", mode="off", arm="main", model="m", stream=False,
                                 status=200, request_body={"messages": [{"role": "user", "content": "secret"}]}))
        replay = ResultsFile(tmp_path / "replay" / "replay.sqlite")
        replay.record(Record("c", "off", "simple", "scored", valid=True))
        # while open: the -wal and -shm files are there (they are removed on close)
        modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode))
                 for f in (*(tmp_path / "live").iterdir(), *(tmp_path / "replay").iterdir())}
        store.close()
        replay.close()
    finally:
        os.umask(old)
    assert set(modes) >= {"live.sqlite", "live.sqlite-wal", "live.sqlite-shm", "replay.sqlite", "replay.sqlite-wal"}
    assert modes == {name: "0o600" for name in modes}


def test_an_older_results_file_that_stores_contents_is_made_private(tmp_path):
    from toolquake.proxy.live import results

    path = tmp_path / "live.sqlite"
    results.ResultsStore(path).close()
    os.chmod(path, 0o644)  # as a toolquake before 0600 left it
    results.ResultsStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # without contents it is left as the operator set it
    results.ResultsStore(path, store_contents=True).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
