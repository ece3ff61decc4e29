"""`toolquake replay` end to end: the CLI as a process, the real proxy in it, the fake upstream as the model.

The fake upstream is an oracle: its script answers each case's user message with the case's ground
truth (`scorers.mutations.ground_truth_calls`), except for a chosen set of cases answered with
another of the case's functions. The expected verdicts are therefore known before the run.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys

import httpx
import pytest

from tests.support import ROOT
from tests.support.ports import refusing_url
from tests.support.replay import N_CASES, kill_at_random_points, replay, row_counter, rows


@pytest.mark.needs_corpus
def test_replay_scores_the_oracle_and_the_scripted_wrong_answers(oracle, tmp_path):
    fake, cases, wrong = oracle
    out = tmp_path / "run"
    httpx.delete(f"{fake.url}/_fake/requests")
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off,reversed,no-target-tool", "--limit", str(N_CASES),
               "--out", str(out), "--header", "X-Test-Tag: oracle")
    assert r.returncode == 0, r.stderr
    got = {(x["case_id"], x["profile"]): x for x in rows(out)}
    assert len(got) == 3 * N_CASES
    assert all(x["status"] == "scored" for x in got.values())
    for case in cases:
        for profile in ("off", "reversed"):
            x = got[(case.id, profile)]
            if case.id in wrong:
                assert not x["valid"] and x["taxonomy"] == "wrong_function", x
            else:
                assert x["valid"] == 1, x
        # the expected tool was removed: the right answer is no call, and the oracle still calls it
        x = got[(case.id, "no-target-tool")]
        assert x["expected"] == "irrelevance" and not x["valid"] and x["taxonomy"] == "irrelevance_violation"
        assert json.loads(x["perturbers"])["applied"][0]["report"]["expect"] == "no_call"
    # the printed table: accuracy per arm, computed from the oracle's known answers
    expected_acc = (N_CASES - len(wrong)) / N_CASES
    table = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[1:]}
    assert table["off"] == [str(N_CASES), f"{expected_acc:.3f}"]
    assert table["no-target-tool"] == [str(N_CASES), "0.000"]
    # the model never saw the case header; the removed tool really was missing upstream
    seen = [s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "oracle"}).json()
            if s["path"] == "/v1/chat/completions"]
    assert len(seen) == 3 * N_CASES
    assert not any(k.startswith("x-toolquake") for s in seen for k in s["headers"])
    bodies = [json.loads(s["body"]) for s in seen]
    assert all(b["temperature"] == 0.0 for b in bodies)
    tool_counts = sorted(len(b.get("tools") or []) for b in bodies)
    case_tools = sorted([len(c.functions) for c in cases] * 2 + [len(c.functions) - 1 for c in cases])
    assert tool_counts == case_tools  # every case's expected tool was gone in exactly one of its three arms

    # rerun: nothing left to send, nothing recorded twice
    httpx.delete(f"{fake.url}/_fake/requests")
    again = replay("--backend", f"{fake.url}/v1", "--profiles", "off,reversed,no-target-tool", "--limit",
                   str(N_CASES), "--out", str(out), "--header", "X-Test-Tag: oracle")
    assert again.returncode == 0, again.stderr
    assert [s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "oracle"}).json()
            if s["method"] == "POST"] == []
    assert len(rows(out)) == 3 * N_CASES


@pytest.mark.needs_corpus
def test_backend_errors_are_recorded_per_pair_and_retried_on_resume(oracle, tmp_path):
    fake, cases, wrong = oracle
    out = tmp_path / "run"
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off", "--limit", "5", "--out", str(out),
               "--model", "fake-model", "--header", "X-Fake-Fault: status:503")
    assert r.returncode == 1, r.stderr
    first = rows(out)
    assert len(first) == 5 and all(x["status"] == "error" and x["http_status"] == 503 for x in first)
    assert {x["error_code"] for x in first} == {"injected"}
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off", "--limit", "5", "--out", str(out))
    assert r.returncode == 0, r.stderr
    second = rows(out)
    assert len(second) == 5 and all(x["status"] == "scored" and x["attempts"] == 2 for x in second)
    assert sum(x["valid"] for x in second) == sum(1 for c in cases[:5] if c.id not in wrong)


@pytest.mark.needs_corpus
def test_a_perturber_that_fails_fails_the_pair_instead_of_scoring_it_unperturbed(oracle, tmp_path):
    fake, _, _ = oracle
    # irrelevance cases have no ground-truth call, so `tool_removal(which="expected")` cannot run on them
    args = ["--backend", f"{fake.url}/v1", "--profiles", "no-target-tool", "--categories", "irrelevance",
            "--limit", "2"]
    r = replay(*args, "--out", str(tmp_path / "strict"))
    assert r.returncode == 1, r.stderr
    got = rows(tmp_path / "strict")
    assert len(got) == 2 and all(x["status"] == "error" and x["error_code"] == "perturbation_failed" for x in got)
    # --fail-open: served unperturbed, scored, and the failure is on record
    r = replay(*args, "--fail-open", "--out", str(tmp_path / "open"))
    assert r.returncode == 0, r.stderr
    got = rows(tmp_path / "open")
    assert len(got) == 2 and all(x["status"] == "scored" for x in got)
    assert all(json.loads(x["perturbers"])["failed"] == ["tool_removal"] for x in got)


@pytest.mark.processes
def test_unreachable_backend_is_a_clear_error_before_anything_runs(tmp_path):
    with refusing_url("/v1") as dead:
        r = replay("--backend", dead, "--profiles", "off", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert f"cannot reach the backend at {dead}/models" in r.stderr
    assert "toolquake backend local" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.needs_corpus
def test_shards_split_the_cases_and_the_report_merges_them(oracle, tmp_path):
    fake, cases, wrong = oracle
    base = ["--backend", f"{fake.url}/v1", "--profiles", "off", "--limit", "9"]
    for i in range(3):
        # shard 1 takes its index from the Indexed Job's environment
        shard = ["--shard", "3"] if i == 1 else ["--shard", f"{i}/3"]
        r = replay(*base, *shard, "--out", str(tmp_path / f"shard-{i}"), env={"JOB_COMPLETION_INDEX": str(i)})
        assert r.returncode == 0, r.stderr
    ids = [sorted(x["case_id"] for x in rows(tmp_path / f"shard-{i}")) for i in range(3)]
    assert ids == [sorted(c.id for c in cases[:9][i::3]) for i in range(3)]
    assert (tmp_path / "shard-1" / "replay-shard-1-of-3.sqlite").exists()
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", "--format", "json",
                             *(str(tmp_path / f"shard-{i}") for i in range(3))], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    arm = json.loads(report.stdout)["arms"]["off"]
    valid = sum(1 for c in cases[:9] if c.id not in wrong)
    assert arm["n"] == 9 and arm["accuracy"] == pytest.approx(valid / 9)
    assert arm["errors"] == {"wrong_function": 9 - valid}


def test_shard_and_profile_arguments():
    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.selection import expand_profiles, parse_shard

    assert parse_shard("2/8") == (2, 8)
    assert parse_shard("8", {"JOB_COMPLETION_INDEX": "5"}) == (5, 8)
    assert parse_shard(None) is None
    for bad in ("8/8", "-1/4", "a/b", "0/0"):
        with pytest.raises(ReplayError):
            parse_shard(bad, {})
    with pytest.raises(ReplayError, match="JOB_COMPLETION_INDEX"):
        parse_shard("4", {})
    known = ["off", "shuffled", "pad-8k-p10", "pad-8k-p50", "expanded", "rephrased", "rephrased-all"]
    assert expand_profiles("off,pad-*", known) == ["off", "pad-8k-p10", "pad-8k-p50"]
    assert expand_profiles("@seed001,off", known) == ["off", "rephrased", "rephrased-all", "expanded"]
    with pytest.raises(ReplayError, match="unknown profile 'nope'"):
        expand_profiles("off,nope", known)
    with pytest.raises(ReplayError, match="no profile matches"):
        expand_profiles("fmt-*", known)


@pytest.mark.needs_corpus
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_records_every_pair_exactly_once(oracle, tmp_path):
    fake, cases, wrong = oracle
    out = tmp_path / "run"
    profiles = "off,reversed"
    args = [sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", f"{fake.url}/v1",
            "--profiles", profiles, "--limit", str(N_CASES), "--concurrency", "4", "--out", str(out),
            "--header", "X-Fake-Fault: delay:40"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    db_path = out / "replay.sqlite"
    total = 2 * N_CASES
    rng = random.Random(8)

    count = row_counter(db_path)
    kills = kill_at_random_points(args, env, count, total, rng, rounds=4, max_step=8)
    assert kills >= 2
    partial = count()
    assert partial < total
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = rows(out)
    pairs = [(x["case_id"], x["profile"]) for x in got]
    assert len(pairs) == len(set(pairs)) == total
    assert {p for p in pairs} == {(c.id, p) for c in cases for p in ("off", "reversed")}
    assert all(x["status"] == "scored" and x["attempts"] == 1 for x in got)
    for x in got:
        assert bool(x["valid"]) == (x["case_id"] not in wrong)
    db = sqlite3.connect(db_path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


# seed 002 / BFCL V4 format sensitivity: the published order of the 26 configurations
# (return format > tool-call tag > doc format, then markdown and experimental variants of #6)
SEED002 = [(r, t, d, "plaintext", "classic") for r in ("python", "json", "verbose_xml", "concise_xml")
           for t in (True, False) for d in ("python", "xml", "json")]
SEED002 += [("python", False, "json", "markdown", "classic"), ("python", False, "json", "plaintext", "experimental")]


def test_shipped_presets_reproduce_the_seed_grids():
    from toolquake.perturbers import build
    from toolquake.proxy.replay.selection import expand_profiles
    from toolquake.proxy.server.config import load_config

    config = load_config(None, env={})
    known = ["off", *config.profiles]

    def params(profile: str, perturber: str) -> dict:
        (step,) = config.profiles[profile].perturbers
        assert step.name == perturber and step.probability == 1.0
        return build(step.name, step.params).params()

    formats = expand_profiles("@seed002", known)
    got = [(p["return_format"], p["tool_call_tag"], p["function_doc_format"], p["prompt_format"], p["prompt_style"])
           for p in (params(name, "format_rewrite") for name in formats)]
    assert got == SEED002
    padded = expand_profiles("@seed003", known)
    assert padded[0] == "off"
    grid = {(p["budget_tokens"], p["position"]) for p in (params(name, "catalog_padding") for name in padded[1:])}
    assert grid == {(b, a) for b in (8192, 16384, 32768, 65536, 120000) for a in (0.1, 0.3, 0.5, 0.7, 0.9)}
    assert len(padded) == 26
    assert expand_profiles("@seed001", known) == ["off", "rephrased", "rephrased-all", "expanded"]
    assert params("expanded", "toolkit_expansion")["k"] == 3
    assert params("no-target-tool", "tool_removal")["which"] == "expected"


@pytest.mark.needs_corpus
def test_replay_through_an_external_proxy(oracle, tmp_path):
    from tests.support import start_proxy

    fake, cases, wrong = oracle
    proxy = start_proxy(fake.url)
    try:
        r = replay("--backend", f"{fake.url}/v1", "--proxy", proxy.url, "--profiles", "off,shuffled", "--limit", "6",
                   "--out", str(tmp_path / "run"))
        assert r.returncode == 0, r.stderr
        got = rows(tmp_path / "run")
        assert len(got) == 12 and all(x["status"] == "scored" for x in got)
        assert all(bool(x["valid"]) == (x["case_id"] not in wrong) for x in got)
        # the proxy's own log shows the requests went through it, under each profile
        log = proxy.output()
        assert log.count('"profile":"shuffled"') + log.count('"profile": "shuffled"') == 6
    finally:
        proxy.stop()



