"""Remedies measured as arms, end to end (#49): `toolquake replay` as a process (its in-process proxy) against the
fake upstream in its own process, in its remedy modes — `--hidden-tools` (a model right only while the request holds
at most its case's number of tools, the needed one among them) and `--needle` (right only when the needed record
ends within the first N tokens of the last tool message) — then `toolquake report`; every expected figure is counted
here from the fake's own record of what reached it and from the hidden numbers this file wrote.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream

pytestmark = [pytest.mark.processes, pytest.mark.needs_corpus, pytest.mark.needs_embeddings,
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: tools cases: a distinctive word per case names its tool and fills its question (what a search can find)
WORDS = ["zorblat", "quillfen", "marnox", "tessivar", "glombur", "drevik", "ospreth", "vantrel", "kelmora", "fizzbane",
         "trombul", "yaxifer", "plenwick", "sordane", "wumbrel", "caldrix", "nebrosk", "halvine", "jostrum", "ruvelt"]
#: a model that reads any number of tools (these cases survive the padding)
ROBUST = {"glombur", "kelmora"}
#: a case with twelve tools of its own (its model reads twelve) whose question names nine others: the search keeps
#: those and drops the needed one
MISLEADING = "ruvelt"
OTHERS = WORDS[:11]
K = 8
#: the last tool response grown to 20K tokens, the original records (the needle among them) last
LENGTHEN = '{ budget_tokens = 20000, position = 1.0, budget_scope = "response", records = "auto", target = "last" }'
CONFIG = f"""
[profiles.pad-32k]
mode = "perturb"
perturbers = [{{ name = "catalog_padding", params = {{ budget_tokens = 32768, position = 0.5 }} }}]

[profiles.search-pad-32k]
mode = "perturb"
perturbers = [{{ name = "catalog_padding", params = {{ budget_tokens = 32768, position = 0.5 }} }}]
remedies = [{{ name = "tool_search", params = {{ k = {K}, method = "bm25" }} }}]

[profiles.resp-20k-end]
mode = "perturb"
perturbers = [{{ name = "response_lengthening", params = {LENGTHEN} }}]

[profiles.trim-resp-20k-end]
mode = "perturb"
perturbers = [{{ name = "response_lengthening", params = {LENGTHEN} }}]
remedies = [{{ name = "response_trim", params = {{ budget_tokens = 1500 }} }}]
"""


def _tool(word: str) -> dict:
    return {"type": "function", "function": {
        "name": f"{word}_reading", "description": f"The current {word} reading of a quasar station.",
        "parameters": {"type": "object", "properties": {"station": {"type": "string"}}, "required": ["station"]}}}


def _marker(word: str) -> str:
    """What the fake matches a case by (no word of any tool in it: the search reads the question)."""
    return f"[case {WORDS.index(word)}]"


def _question(word: str) -> str:
    if word == MISLEADING:
        return f"{_marker(word)} Compare the {', '.join(OTHERS[:9])} readings of station Alpha."
    return f"{_marker(word)} What is the {word} reading of station Alpha?"


def _hidden_cases(folder: Path) -> tuple[Path, Path]:
    """Cases with their own three tools (the needed one and two neighbours), and the fake's hidden numbers."""
    cases, hidden = [], []
    for i, word in enumerate(WORDS):
        own = [_tool(word), _tool(WORDS[(i + 1) % len(WORDS)]), _tool(WORDS[(i + 2) % len(WORDS)])]
        if word == MISLEADING:
            own = [_tool(word), *map(_tool, OTHERS)]
        call = {"name": f"{word}_reading", "arguments": {"station": "Alpha"}}
        cases.append({"id": f"h-{word}", "category": "remedyfake", "tools": own,
                      "messages": [{"role": "user", "content": _question(word)}],
                      "expected": [{"name": call["name"], "arguments": {"station": ["Alpha"]}}]})
        hidden.append({"match": _marker(word), "answer": {"calls": [call]},
                       "max_tools": 100_000 if word in ROBUST else len(own) if word == MISLEADING else K})
    return _lines(folder / "hidden-cases.jsonl", cases), _lines(folder / "hidden.jsonl", hidden)


NEEDLE_CASES = ["n-alpha", "n-beta", "n-gamma", "n-delta", "n-epsilon", "n-zeta"]


def _needle_cases(folder: Path) -> tuple[Path, Path]:
    """Conversations whose last tool message holds the needed record among others; the fake answers right only when
    that record ends within its first 3,000 tokens."""
    cases, needles = [], []
    for n, cid in enumerate(NEEDLE_CASES):
        station = f"{cid[2:]}-{7000 + n}"
        records = [{"station": f"plain-{j}", "reading": f"{j} C"} for j in range(3)]
        records.append({"station": station, "reading": "-4 C"})
        call = {"name": "report_reading", "arguments": {"station": station}}
        tool = {"type": "function", "function": {"name": "report_reading", "description": "Report a reading.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "station": {"type": "string"}}, "required": ["station"]}}}
        cases.append({"id": cid, "category": "remedyfake", "tools": [tool], "messages": [
            {"role": "user", "content": "List the station readings."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "list_readings", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"records": records})},
            {"role": "user", "content": f"[{cid}] Report the reading of station {station}."}],
            "expected": [{"name": "report_reading", "arguments": {"station": [station]}}]})
        needles.append({"match": f"[{cid}]", "answer": {"calls": [call]}, "needle": f'"{station}"',
                        "within_tokens": 3000})
    return _lines(folder / "needle-cases.jsonl", cases), _lines(folder / "needles.jsonl", needles)


def _lines(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def toolquake(*args: str, timeout: float = 500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def verdicts(out: Path) -> dict[tuple[str, str], bool]:
    db = sqlite3.connect(out / "replay.sqlite")
    try:
        return {(c, p): bool(v) for c, p, v in db.execute(
            "SELECT case_id, profile, valid FROM results WHERE status = 'scored'")}
    finally:
        db.close()


@pytest.fixture(scope="module")
def hidden_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remedy-arms")
    cases, hidden = _hidden_cases(folder)
    config = folder / "config.toml"
    config.write_text(CONFIG)
    fake = start_fake_upstream("--hidden-tools", str(hidden), "--usage-counts")
    try:
        r = toolquake("replay", "--backend", f"{fake.url}/v1", "--config", str(config), "--cases", str(cases),
                      "--profiles", "off,pad-32k,search-pad-32k", "--out", str(folder / "run"), "--no-progress",
                      "--token-counter", "estimate", "--allow-estimate", "--concurrency", "4")
        assert r.returncode == 0, r.stderr[-3000:]
        recorded = httpx.get(f"{fake.url}/_fake/requests", timeout=30).json()
    finally:
        fake.stop()
    return folder / "run", recorded


def test_tool_search_wins_back_the_padded_catalog(hidden_run):
    out, recorded = hidden_run
    got = verdicts(out)
    n = len(WORDS)
    off = sum(got[(f"h-{w}", "off")] for w in WORDS)
    padded = sum(got[(f"h-{w}", "pad-32k")] for w in WORDS)
    searched = sum(got[(f"h-{w}", "search-pad-32k")] for w in WORDS)
    assert off == n  # three tools each: every case right unperturbed
    assert padded == len(ROBUST) and padded < n / 2  # padded to 32K tokens, most cases fail
    assert searched >= 0.9 * n and searched == n - 1  # all but the misleading question
    assert not got[(f"h-{MISLEADING}", "search-pad-32k")]
    # what reached the model (the fake's record): n requests of each arm; off's hold their own 3 tools (12 for the
    # misleading case), the padded arm's hundreds, and nothing else lies above K: every searched request held at
    # most K tools
    sizes = [len(json.loads(r["body"]).get("tools") or []) for r in recorded
             if r["path"].endswith("/chat/completions")]
    assert len(sizes) == 3 * n
    assert sum(1 for s in sizes if s > 100) == n and sizes.count(len(OTHERS) + 1) == 1
    assert sum(1 for s in sizes if s <= K) == 2 * n - 1 and sizes.count(K) >= n


def test_the_report_shows_the_paired_recovery(hidden_run):
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    out, recorded = hidden_run
    counted: dict[str, list[int]] = {w: [0, 0] for w in WORDS}  # word → [padded request's tokens, searched one's]
    for r in recorded:
        body = json.loads(r["body"]) if r["path"].endswith("/chat/completions") else {}
        size = len(body.get("tools") or [])
        if size > 100 or size == K:
            word = next(w for w in WORDS if _marker(w) in body["messages"][-1]["content"])
            counted[word][0 if size > 100 else 1] = EstimateCounter().count_request(body)
    got = verdicts(out)
    triples = [(got[(f"h-{w}", "off")], got[(f"h-{w}", "pad-32k")], got[(f"h-{w}", "search-pad-32k")])
               for w in WORDS]
    won = sum(1 for _, p, r in triples if r and not p)
    lost = sum(1 for _, p, r in triples if p and not r)
    share = (sum(r for *_, r in triples) - sum(p for _, p, _ in triples)) / \
        (sum(o for o, *_ in triples) - sum(p for _, p, _ in triples))
    r = toolquake("report", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)["remedies"]
    assert entry["profile"] == "search-pad-32k" and entry["twin"] == "pad-32k" and entry["remedies"] == ["tool_search"]
    assert entry["n"] == len(WORDS) and (entry["cases_won"], entry["cases_lost"]) == (won, lost)
    assert entry["won_back"] == pytest.approx(share) and share == pytest.approx(17 / 18)
    assert entry["won_back_ci"][0] > 0.5 and entry["significant"] is True
    assert entry["accuracy_perturbed"] == pytest.approx(len(ROBUST) / len(WORDS))
    # the proxy knew every case (X-Toolquake-Case): the misleading question's needed tool was dropped, counted
    assert (entry["needed_dropped"], entry["needed_dropped_known"]) == (1, len(WORDS))
    # tokens saved: the padded request's tokens minus the searched one's, per case, from the bodies the fake got
    assert entry["tokens_saved"] == pytest.approx(sum(counted[w][0] - counted[w][1] for w in WORDS) / len(WORDS))
    assert entry["tokens_saved"] > 20_000
    md = toolquake("report", str(out))
    assert "## Remedies: accuracy on the same cases" in md.stdout
    assert f"| tool_search | search-pad-32k | pad-32k | {len(WORDS)} |" in md.stdout


def test_response_trim_wins_back_a_needle_past_the_first_tokens(tmp_path):
    cases, needles = _needle_cases(tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    fake = start_fake_upstream("--needle", str(needles))
    try:
        r = toolquake("replay", "--backend", f"{fake.url}/v1", "--config", str(config), "--cases", str(cases),
                      "--profiles", "off,resp-20k-end,trim-resp-20k-end", "--out", str(tmp_path / "run"),
                      "--no-progress", "--token-counter", "estimate", "--allow-estimate")
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        fake.stop()
    got = verdicts(tmp_path / "run")
    assert all(got[(c, "off")] for c in NEEDLE_CASES)
    assert not any(got[(c, "resp-20k-end")] for c in NEEDLE_CASES)  # the needed record after 20K tokens
    assert all(got[(c, "trim-resp-20k-end")] for c in NEEDLE_CASES)
    report = json.loads(toolquake("report", str(tmp_path / "run"), "--format", "json").stdout)
    (entry,) = report["remedies"]
    assert entry["twin"] == "resp-20k-end" and entry["won_back"] == pytest.approx(1.0)
    assert entry["cases_won"] == len(NEEDLE_CASES) and entry["cases_lost"] == 0
    assert entry["tokens_saved"] > 10_000  # 20K tokens of response cut to 1,500


#: sweep cases → the tool count from which the fake (`--breaking`) answers wrong
SWEEP_BREAKS = {"s-9": 9, "s-20": 20, "s-33": 33, "s-47": 47}
SWEEP_MAX = 60


def test_a_sweep_with_a_remedy_runs_its_twin_and_draws_both_curves(tmp_path):
    from tests.support.sweep import breaking_file, cases_file
    from toolquake.proxy.replay.report import load, summarize, survival_plots

    hidden = {cid: [[x, None]] for cid, x in SWEEP_BREAKS.items()}
    fake = start_fake_upstream("--breaking", str(breaking_file(hidden, "tools")))
    try:
        r = toolquake("sweep", "--no-progress", "--token-counter", "estimate", "--allow-estimate", "--backend",
                      f"{fake.url}/v1", "--cases", str(cases_file(list(SWEEP_BREAKS))), "--axis", "tools", "--min",
                      "1", "--max", str(SWEEP_MAX), "--remedy", 'tool_search:{"k": 8, "method": "bm25"}', "--out",
                      str(tmp_path / "sweep"))
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in (tmp_path / "sweep").glob("*.sqlite")} == {"sweep.sqlite", "sweep-remedied.sqlite"}
    # without the remedy every case breaks where the fake said; with it no request holds more than 8 tools, so no
    # case breaks within the range: the median moves from the hidden median to above the maximum
    ordered = sorted(SWEEP_BREAKS.values())
    median = ordered[(len(ordered) - 1) // 2]
    sentence = (f"with tool_search the median breaking point moves from {median} to above {SWEEP_MAX} tools in the "
                "request")
    assert sentence in r.stdout
    summary = summarize(load([tmp_path / "sweep"]))
    runs = summary["sweeps"]
    assert set(runs) == {"fake-model", "fake-model + tool_search"}
    assert {c: v["first_wrong"] for c, v in runs["fake-model"]["tools"]["cases"].items()} == SWEEP_BREAKS
    assert runs["fake-model + tool_search"]["tools"]["censored"] == sorted(SWEEP_BREAKS)
    (shift,) = summary["sweep_remedies"]
    assert (shift["twin"], shift["run"], shift["median_without"], shift["median_with"]) == \
        ("fake-model", "fake-model + tool_search", median, None)
    assert shift["text"] == sentence
    svg = survival_plots(summary, "svg")["survival-tools.svg"].decode()
    assert "fake-model (n=4)" in svg and "fake-model + tool_search (n=4)" in svg  # both curves, one plot
    md = toolquake("report", str(tmp_path / "sweep"), "--no-plots")
    assert sentence in md.stdout
