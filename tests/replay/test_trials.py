"""Repeated trials (`toolquake replay --trials K`, #18): exactly once per (case, arm, trial), the per-trial seed,
the schema-1 migration, and the report's spread, pass^k and pass@k checked against values computed here.

The fake upstream is the oracle of test_replay.py (right answers except for chosen cases), made
nondeterministic per trial with `X-Fake-Flaky: P`: a request with a `seed` gets the no-call text with
probability P, fixed by (seed, user message). Every verdict is therefore known before the run.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys

import httpx
import pytest

from tests.fake_upstream import flaky_hit
from tests.support import ROOT
from tests.support.replay import N_CASES, kill_at_random_points, replay, row_counter, rows
from tests.support.report import report
from toolquake.proxy.replay.run import trial_sampling_seed
from toolquake.scorers.aggregate import pass_at_k, pass_hat_k, spread

FLAKY = 0.3
TRIALS = 3


def _want_valid(case, trial: int, wrong: set[str]) -> bool:
    return case.id not in wrong and not flaky_hit(trial_sampling_seed(case.id, trial), case.turns[0][-1]["content"],
                                                  FLAKY)


# ---------------------------------------------------------------------------------------------
# the estimators


def _enumerated(verdicts: list[list[bool]], k: int) -> tuple[float, float]:
    """pass^k and pass@k by enumerating every k-subset of each case's trials (no binomial formula)."""
    hat, at = [], []
    for v in verdicts:
        subsets = list(itertools.combinations(v, k))
        hat.append(sum(all(s) for s in subsets) / len(subsets))
        at.append(sum(any(s) for s in subsets) / len(subsets))
    return sum(hat) / len(hat), sum(at) / len(at)


def test_pass_hat_k_and_pass_at_k_by_hand_and_by_enumeration():
    # one case, 4 trials, 2 right: pass^2 = C(2,2)/C(4,2) = 1/6, pass@2 = 1 - C(2,2)/C(4,2) = 5/6
    assert pass_hat_k([(4, 2)], 2) == pytest.approx(1 / 6) and pass_at_k([(4, 2)], 2) == pytest.approx(5 / 6)
    assert pass_hat_k([(4, 2)], 3) == 0.0 and pass_at_k([(4, 2)], 3) == 1.0
    assert pass_hat_k([(3, 3), (3, 0)], 1) == pytest.approx(0.5)  # pass^1 is the mean accuracy
    assert pass_hat_k([(1, 1)], 2) is None and pass_at_k([], 1) is None
    rng = random.Random(3)
    verdicts = [[rng.random() < 0.6 for _ in range(5)] for _ in range(40)]
    counts = [(len(v), sum(v)) for v in verdicts]
    for k in range(1, 6):
        hat, at = _enumerated(verdicts, k)
        assert pass_hat_k(counts, k) == pytest.approx(hat) and pass_at_k(counts, k) == pytest.approx(at)
    s = spread([0.5, 0.7, 0.6])
    assert s["mean"] == pytest.approx(0.6) and s["std"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.6]))
    assert (s["min"], s["max"]) == (0.5, 0.7) and spread([0.4])["std"] is None


def test_trial_seed_is_stable_and_differs_by_trial_and_case():
    seeds = {trial_sampling_seed(c, t) for c in ("a", "b") for t in range(3)}
    assert len(seeds) == 6 and trial_sampling_seed("a", 1) == trial_sampling_seed("a", 1)
    assert all(0 <= s < 2**31 for s in seeds)


# ---------------------------------------------------------------------------------------------
# replay --trials through the real proxy


@pytest.mark.needs_corpus
def test_trials_send_each_pair_k_times_with_the_trial_seed_and_report_pass_k(oracle, tmp_path):  # noqa: F811
    fake, cases, wrong = oracle
    out = tmp_path / "run"
    httpx.delete(f"{fake.url}/_fake/requests")
    args = ["--backend", f"{fake.url}/v1", "--profiles", "off,reversed", "--limit", str(N_CASES), "--out", str(out),
            "--trials", str(TRIALS), "--temperature", "0.7", "--header", f"X-Fake-Flaky: {FLAKY}",
            "--header", "X-Test-Tag: trials"]
    r = replay(*args)
    assert r.returncode == 0, r.stderr
    got = rows(out)
    keys = [(x["case_id"], x["profile"], x["trial"]) for x in got]
    assert len(keys) == len(set(keys)) == 2 * N_CASES * TRIALS
    for x in got:
        case = next(c for c in cases if c.id == x["case_id"])
        assert bool(x["valid"]) == _want_valid(case, x["trial"], wrong), x
    # what the model got: the trial's seed, the same in both arms, and the temperature
    seen = [json.loads(s["body"]) for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "trials"}).json()
            if s["path"] == "/v1/chat/completions"]
    assert len(seen) == 2 * N_CASES * TRIALS and all(b["temperature"] == 0.7 for b in seen)
    sent = sorted(b["seed"] for b in seen)
    assert sent == sorted(trial_sampling_seed(c.id, t) for c in cases for t in range(TRIALS) for _ in range(2))
    assert "× 3 trials" in r.stderr

    data = json.loads(report(str(out), "--format", "json").stdout)
    for profile in ("off", "reversed"):
        t = data["arms"][profile]["trials"]
        verdicts = [[_want_valid(c, k, wrong) for k in range(TRIALS)] for c in cases]
        per_trial = [sum(v[k] for v in verdicts) / N_CASES for k in range(TRIALS)]
        assert [x["accuracy"] for x in t["per_trial"]] == pytest.approx(per_trial)
        assert t["accuracy"]["mean"] == pytest.approx(statistics.mean(per_trial))
        assert t["accuracy"]["std"] == pytest.approx(statistics.stdev(per_trial))
        assert (t["k"], t["cases"], t["complete_cases"]) == (TRIALS, N_CASES, N_CASES)
        for k in range(1, TRIALS + 1):
            hat, at = _enumerated(verdicts, k)
            assert t["pass_hat_k"][str(k)] == pytest.approx(hat) and t["pass_at_k"][str(k)] == pytest.approx(at)
        # the intervals and the paired test stay on trial 0
        assert data["arms"][profile]["accuracy"] == pytest.approx(per_trial[0])
    assert 0 < data["arms"]["off"]["trials"]["pass_hat_k"]["3"] < data["arms"]["off"]["trials"]["pass_at_k"]["3"]
    md = report(str(out), "--no-plots").stdout
    assert "## Repeated trials" in md and "| pass^3 |" in md
    page = report(str(out), "--format", "html", "--no-plots").stdout
    assert "<section id='trials'>" in page and page.index("id='summary'") < page.index("id='trials'")

    # a second run with more trials sends only the new ones
    httpx.delete(f"{fake.url}/_fake/requests")
    more = replay(*[a if a != str(TRIALS) else "4" for a in args])
    assert more.returncode == 0, more.stderr
    assert len(rows(out)) == 2 * N_CASES * 4
    new = [json.loads(s["body"])["seed"] for s in httpx.get(f"{fake.url}/_fake/requests",
                                                             params={"tag": "trials"}).json() if s["method"] == "POST"]
    assert sorted(new) == sorted(trial_sampling_seed(c.id, 3) for c in cases for _ in range(2))


@pytest.mark.needs_corpus
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_records_every_trial_exactly_once(oracle, tmp_path):  # noqa: F811
    fake, cases, wrong = oracle
    out = tmp_path / "run"
    args = [sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", f"{fake.url}/v1",
            "--profiles", "off,reversed", "--limit", str(N_CASES), "--concurrency", "4", "--out", str(out),
            "--trials", str(TRIALS), "--temperature", "0.7", "--header", "X-Fake-Fault: delay:40",
            "--header", f"X-Fake-Flaky: {FLAKY}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    db_path = out / "replay.sqlite"
    total = 2 * N_CASES * TRIALS
    rng = random.Random(18)

    count = row_counter(db_path)
    kills = kill_at_random_points(args, env, count, total, rng, rounds=5, max_step=20)
    assert kills >= 2
    assert count() < total
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = rows(out)
    keys = [(x["case_id"], x["profile"], x["trial"]) for x in got]
    assert len(keys) == len(set(keys)) == total
    assert set(keys) == {(c.id, p, t) for c in cases for p in ("off", "reversed") for t in range(TRIALS)}
    assert all(x["status"] == "scored" and x["attempts"] == 1 for x in got)
    for x in got:
        case = next(c for c in cases if c.id == x["case_id"])
        assert bool(x["valid"]) == _want_valid(case, x["trial"], wrong), x
    db = sqlite3.connect(db_path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


# ---------------------------------------------------------------------------------------------
# files written before --trials


def test_a_schema_1_file_is_read_as_trial_0_and_migrated_when_written(tmp_path):
    from toolquake.proxy.replay import store
    from toolquake.proxy.replay.report import load, summarize

    path = tmp_path / "replay.sqlite"
    old_results = (store._RESULTS.replace("    trial INTEGER NOT NULL DEFAULT 0,\n", "")
                   .replace("PRIMARY KEY (case_id, profile, trial)", "PRIMARY KEY (case_id, profile)"))
    assert "trial" not in old_results
    db = sqlite3.connect(path)
    db.executescript(store._META + old_results)
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("schema_version", "1"), ("model", "m")])
    db.execute("INSERT INTO arms VALUES ('off', ?)", (json.dumps({"mode": "off", "perturbers": []}),))
    db.executemany("INSERT INTO results (case_id, profile, category, status, valid, recorded_at) VALUES "
                   "(?, 'off', 'multiple', 'scored', ?, 0)", [("multiple_0", 1), ("multiple_1", 0)])
    db.commit()
    db.close()
    # a report reads it as it is (read-only): one trial
    s = summarize(load([path]))
    assert s["arms"]["off"]["n"] == 2 and s["arms"]["off"]["accuracy"] == 0.5 and s["arms"]["off"]["trials"] is None
    # opened for writing: migrated in place, the old rows kept as trial 0, a second trial recorded beside them
    f = store.ResultsFile(path)
    assert f.meta()["schema_version"] == "2" and f.meta()["model"] == "m"
    assert f.scored_pairs() == {("multiple_0", "off", 0), ("multiple_1", "off", 0)}
    f.record(store.Record("multiple_0", "off", "multiple", "scored", trial=1, valid=False))
    f.record(store.Record("multiple_0", "off", "multiple", "scored", trial=0, valid=False))  # scored is final
    f.close()
    s = summarize(load([path]))
    assert s["arms"]["off"]["accuracy"] == 0.5 and s["arms"]["off"]["trials"]["k"] == 2
    assert s["arms"]["off"]["trials"]["per_trial"][1] == {"trial": 1, "n": 1, "accuracy": 0.0}
    # a schema this toolquake does not know is refused with what to do
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    from toolquake.proxy.replay.errors import ReplayError

    with pytest.raises(ReplayError, match="schema 9.*new --out directory"):
        store.ResultsFile(path)
