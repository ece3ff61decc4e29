"""Requests the backend refuses count as failures (#31), as BFCL counts an inference error.

The fake upstream is the oracle of test_replay.py (the ground truth, a wrong function for a chosen set of
cases) behind a small context: `--max-tools 2` refuses any request with more than two tools with 400
`context_length_exceeded`. So the `multiple` cases with three tools are refused in every arm, and every
request of the padding arm (`pad-8k-p10`: the catalog padded to 8K tokens) is refused. Every expected figure
is recomputed here from the stored rows (scipy for the intervals and McNemar's test).
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import sqlite3
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.replay import kill_at_random_points, oracle_script, replay, row_counter, rows
from tests.support.report import report_text as report

pytestmark = pytest.mark.processes

stats = pytest.importorskip("scipy.stats")

LIMIT = 8  # of each category
MAX_TOOLS = 2
PROFILES = ("off", "reversed", "pad-8k-p10")
REFUSED = "context_length_exceeded"


@pytest.fixture(scope="module")
def refusing():
    from toolquake.bfcl.corpus import load_category

    cases = load_category("simple_python")[:LIMIT] + load_category("multiple")[:LIMIT]
    wrong = {c.id for i, c in enumerate(cases) if c.category == "multiple" and i % 3 == 0}
    fake = start_fake_upstream("--script", str(oracle_script(cases, wrong)), "--max-tools", str(MAX_TOOLS))
    yield fake, cases, wrong
    fake.stop()


def _args(fake, out) -> list[str]:
    return ["--backend", f"{fake.url}/v1", "--profiles", ",".join(PROFILES), "--categories",
            "simple_python,multiple", "--limit", str(LIMIT), "--out", str(out)]


def expected_arm(stored: list[dict], profile: str) -> dict:
    """An arm's figures from the stored rows: every scored row counts, a refused one as a wrong answer."""
    mine = [r for r in stored if r["profile"] == profile and r["status"] == "scored"]
    valid = sum(1 for r in mine if r["valid"])
    answered = [r for r in mine if r["error_code"] is None]
    ci = stats.binomtest(valid, len(mine)).proportion_ci(method="wilson")
    return {"n": len(mine), "accuracy": valid / len(mine), "ci": [ci.low, ci.high],
            "failed": sum(1 for r in mine if r["error_code"]),
            "codes": dict(Counter(r["error_code"] for r in mine if r["error_code"])),
            "answered": len(answered),
            "answered_accuracy": sum(1 for r in answered if r["valid"]) / len(answered) if answered else None}


def expected_paired(stored: list[dict], profile: str) -> dict:
    verdict = {(r["profile"], r["case_id"]): bool(r["valid"]) for r in stored if r["status"] == "scored"}
    cases = [c for p, c in verdict if p == profile and ("off", c) in verdict]
    lost = sum(1 for c in cases if verdict[("off", c)] and not verdict[(profile, c)])
    gained = sum(1 for c in cases if not verdict[("off", c)] and verdict[(profile, c)])
    p = stats.binomtest(lost, lost + gained, 0.5).pvalue if lost + gained else 1.0
    return {"n": len(cases), "valid_to_invalid": lost, "invalid_to_valid": gained, "p": p}


def check_report(data: dict, stored: list[dict]) -> None:
    for profile in PROFILES:
        arm, want = data["arms"][profile], expected_arm(stored, profile)
        assert (arm["n"], arm["failed"], arm["failed_codes"], arm["answered"]) == (
            want["n"], want["failed"], want["codes"], want["answered"]), profile
        assert arm["accuracy"] == pytest.approx(want["accuracy"])
        assert arm["accuracy_ci"] == pytest.approx(want["ci"], abs=1e-4)
        assert arm["answered_accuracy"] == (None if want["answered_accuracy"] is None
                                            else pytest.approx(want["answered_accuracy"]))
        assert arm["unscored"] == 0
        if profile != "off":
            cmp, w = arm["paired"], expected_paired(stored, profile)
            assert (cmp["n"], cmp["valid_to_invalid"], cmp["invalid_to_valid"]) == (
                w["n"], w["valid_to_invalid"], w["invalid_to_valid"])
            assert cmp["p_value"] == pytest.approx(w["p"], rel=1e-9)


@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings  # catalog padding screens its tools with the embedding model
def test_refused_requests_are_failures_in_accuracy_mcnemar_and_the_paper_tables(refusing, tmp_path):
    fake, cases, wrong = refusing
    out = tmp_path / "run"
    httpx.delete(f"{fake.url}/_fake/requests")
    r = replay(*_args(fake, out), "--header", "X-Test-Tag: refusing")
    assert r.returncode == 0, r.stderr  # refused pairs are scored: nothing is left to retry
    stored = rows(out)
    assert len(stored) == len(cases) * len(PROFILES) and all(x["status"] == "scored" for x in stored)
    functions = {c.id: len(c.functions) for c in cases}
    for x in stored:
        refused = x["profile"] == "pad-8k-p10" or functions[x["case_id"]] > MAX_TOOLS
        if refused:
            assert (x["valid"], x["error_type"], x["error_code"], x["http_status"]) == (
                0, "inference_error", REFUSED, 400), x
        else:
            assert x["error_code"] is None and bool(x["valid"]) == (x["case_id"] not in wrong), x
    refused_pairs = sum(1 for x in stored if x["error_code"])
    assert f"{refused_pairs} request(s) failed on the backend's side" in r.stderr
    # a refusal is final: each pair was sent once (no retry of a 400), and a rerun sends nothing
    sent = [s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "refusing"}).json()
            if s["path"] == "/v1/chat/completions"]
    assert len(sent) == len(stored)
    again = replay(*_args(fake, out), "--header", "X-Test-Tag: refusing")
    assert again.returncode == 0, again.stderr
    assert len([s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "refusing"}).json()
                if s["path"] == "/v1/chat/completions"]) == len(stored)

    data = json.loads(report("--format", "json", str(out)))
    check_report(data, stored)
    pad = expected_arm(stored, "pad-8k-p10")
    assert pad["n"] == len(cases) and pad["accuracy"] == 0.0 and pad["answered"] == 0  # not n = 0, accuracy None
    # seed 003 Tables 1 / 5 / 6: the padding arm's accuracy per category counts its refusals
    for table in ("padding_extremes", "padding_same_position", "padding_same_budget"):
        for cat, e in data[table]["fake-model"].items():
            mine = [x for x in stored if x["profile"] == "pad-8k-p10" and x["category"] == cat]
            assert e["min"] == pytest.approx(sum(x["valid"] for x in mine) / len(mine))
            assert e["min_failed"] == sum(1 for x in mine if x["error_code"]) == len(mine)
    # seed 001 Table 2 (right): the failures the padding caused are requests that failed
    caused = data["caused_errors"]["fake-model"]["pad-8k-p10"]
    assert caused["counts"] == {"request failed": expected_paired(stored, "pad-8k-p10")["valid_to_invalid"]}

    # every format shows the failures with their codes and the accuracy over the answered requests
    off = expected_arm(stored, "off")
    md = report(str(out))
    assert f"| fake-model | off | {off['n']} | {off['accuracy']:.3f} |" in md
    assert f"{off['failed']} ({REFUSED} {off['failed']})" in md and "bfcl over answered" in md
    assert f"{off['answered_accuracy'] * 100:.1f} %" in md
    html = report("--format", "html", str(out))
    assert f"{pad['failed']} ({REFUSED} {pad['failed']})" in html and "bfcl over answered" in html
    table = list(csv.DictReader(io.StringIO(report("--format", "csv", "--csv-stats", str(out)))))
    row = next(x for x in table if x["Profile"] == "off")
    assert (row["N"], row["Failed"], row["Failed Codes"], row["Answered N"]) == (
        str(off["n"]), str(off["failed"]), f"{REFUSED}:{off['failed']}", str(off["answered"]))
    assert row["Answered Acc"] == f"{off['answered_accuracy'] * 100:.2f}%"
    long = list(csv.DictReader(io.StringIO(report("--format", "csv", "--csv-tables", str(out)))))
    mins = [x for x in long if x["Table"] == "seed 003 Table 1" and x["Statistic"] == "Min"]
    assert mins and all(x["Failed"] == str(LIMIT) for x in mins)


@pytest.mark.needs_corpus
@pytest.mark.parametrize("fault,code,status,tries", [("status:500", "injected", 500, 3),
                                                      ("invalid-json", "upstream_invalid_response", 502, 1)])
def test_a_500_is_tried_three_times_and_an_unreadable_answer_once_then_both_count(refusing, tmp_path, fault, code,
                                                                                  status, tries):
    fake, _, _ = refusing
    out = tmp_path / "run"
    tag = f"fault-{fault.replace(':', '-')}"
    r = replay("--backend", f"{fake.url}/v1", "--model", "fake-model", "--profiles", "off", "--categories",
               "simple_python", "--limit", "2", "--out", str(out), "--header", f"X-Fake-Fault: {fault}",
               "--header", f"X-Test-Tag: {tag}")
    assert r.returncode == 0, r.stderr
    got = rows(out)
    assert len(got) == 2 and all((x["status"], x["valid"], x["error_code"], x["http_status"], x["attempts"]) ==
                                 ("scored", 0, code, status, 1) for x in got), got
    sent = [s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": tag}).json()
            if s["path"] == "/v1/chat/completions"]
    assert len(sent) == 2 * tries


@pytest.mark.needs_corpus
def test_a_refused_multi_turn_step_is_bfcl_s_inference_error(refusing, tmp_path):
    fake, _, _ = refusing
    out = tmp_path / "run"
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off", "--categories", "multi_turn_base", "--limit", "1",
               "--out", str(out))
    assert r.returncode == 0, r.stderr
    (x,) = rows(out)
    assert (x["status"], x["valid"], x["error_type"], x["taxonomy"], x["error_code"], x["http_status"]) == (
        "scored", 0, "multi_turn:inference_error", "inference_error", REFUSED, 400)
    assert x["error"].startswith("turn 0, step 0: ")


@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings  # catalog padding screens its tools with the embedding model
@pytest.mark.slow
def test_sigkill_then_resume_retries_the_503s_and_counts_every_refused_and_answered_pair_once(refusing, tmp_path):
    fake, cases, _ = refusing
    out = tmp_path / "run"
    args = [sys.executable, "-m", "toolquake", "replay", "--no-progress", *_args(fake, out), "--concurrency", "4",
            "--header", "X-Fake-Fault: delay:40"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    total = len(cases) * len(PROFILES)
    # first the backend is overloaded (503: come back later): every pair is an error row, not scored
    r = subprocess.run([*args[:-2], "--header", "X-Fake-Fault: status:503", "--model", "fake-model"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert {(x["status"], x["http_status"]) for x in rows(out)} == {("error", 503)} and len(rows(out)) == total
    scored = row_counter(out / "replay.sqlite", where="status = 'scored'")
    kills = kill_at_random_points(args, env, scored, total, random.Random(31), rounds=4, max_step=10)
    assert kills >= 2 and scored() < total
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stored = rows(out)
    pairs = [(x["case_id"], x["profile"]) for x in stored]
    assert len(pairs) == len(set(pairs)) == total
    # every 503 was retried until scored; a scored pair (a refusal too) was never sent again: one 503 attempt and
    # one attempt that scored it, whatever the kills interrupted
    assert all(x["status"] == "scored" and x["attempts"] == 2 for x in stored)
    assert sum(1 for x in stored if x["error_code"] == REFUSED) == sum(
        1 for c in cases for p in PROFILES if p == "pad-8k-p10" or len(c.functions) > MAX_TOOLS)
    check_report(json.loads(report("--format", "json", str(out))), stored)
    db = sqlite3.connect(out / "replay.sqlite")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


@pytest.mark.parametrize("status,code,counts", [
    (400, "context_length_exceeded", True), (400, "exceed_context_size_error", True), (413, "http_413", True),
    (422, "BadRequestError", True), (500, "injected", True), (504, "upstream_timeout", True), (None, "timeout", True),
    (502, "upstream_invalid_response", True), (200, "bad_response", True),
    (None, "unreachable", False), (502, "upstream_unreachable", False), (503, "injected", False),
    (429, "rate_limit_exceeded", False), (401, "invalid_api_key", False), (404, "model_not_found", False),
    (500, "perturbation_failed", False), (500, "internal_error", False), (404, "unknown_profile", False),
    (413, "request_too_large", False), (None, "scorer_error", False), (None, "backend_error", False),
])
def test_which_failures_are_the_backend_s(status, code, counts):
    """The backend's failures count as wrong answers; the proxy's, the network's and access failures are retried."""
    from toolquake.proxy.replay.failures import is_model_failure

    assert is_model_failure(status, code) is counts


@pytest.mark.parametrize("body,code", [
    ({"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}},
     "context_length_exceeded"),
    ({"error": {"code": 400, "message": "exceeds the context", "type": "exceed_context_size_error"}},
     "exceed_context_size_error"),  # llama.cpp
    ({"object": "error", "message": "maximum context length", "type": "BadRequestError", "code": 400},
     "BadRequestError"),  # vLLM's older flat body
    ({"detail": "nope"}, "http_400"),
])
def test_the_code_of_an_error_answer(body, code):
    from toolquake.proxy.replay.failures import error_of

    assert error_of(httpx.Response(400, json=body))[0] == code
