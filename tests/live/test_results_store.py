"""The SQLite results store: WAL, versioned schema and migrations, what it keeps, and its summary."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from fractions import Fraction

import pytest

from tests.support import ROOT
from toolquake.proxy.live import results
from toolquake.proxy.live.results import ResultsStore, Row, StoreError
from toolquake.proxy.replay.report import render_markdown, summarize_db
from toolquake.scorers.aggregate import wilson_ci


def _row(**kw) -> Row:
    base = dict(request_id="r1", profile="off", mode="perturb", arm="live", model="m", stream=False, status=200)
    base.update(kw)
    return Row(**base)


def test_new_file_uses_wal_and_the_current_schema_version(tmp_path):
    path = tmp_path / "sub" / "results.sqlite"
    store = ResultsStore(path)
    store.append(_row(case_id="simple_python_0", category="simple_python", valid=True, errors=[],
                      perturbers=[{"name": "tool_order", "params": {"mode": "reverse"}, "report": {}}]))
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == results.SCHEMA_VERSION == len(results.MIGRATIONS)
    db.close()
    [row] = results.read_rows(path)
    assert row["case_id"] == "simple_python_0" and row["valid"] == 1
    assert row["perturbers"] == [{"name": "tool_order", "params": {"mode": "reverse"}, "report": {}}]


def test_bodies_are_kept_only_when_store_contents_is_on(tmp_path):
    body = {"messages": [{"role": "user", "content": "secret question"}]}
    for flag in (False, True):
        path = tmp_path / f"r{flag}.sqlite"
        store = ResultsStore(path, store_contents=flag)
        store.append(_row(request_body=body, response_body={"choices": []}))
        store.close()
        [row] = results.read_rows(path)
        assert (row["request_body"] == body) is flag
        assert (row["response_body"] is not None) is flag
        raw = b"".join(p.read_bytes() for p in tmp_path.glob(path.name + "*"))
        assert (b"secret question" in raw) is flag


def test_an_older_file_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    results.MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO results (request_id, ts, profile, mode, arm, stream, status, perturbers, valid) "
               "VALUES ('old', 1.0, 'off', 'perturb', 'live', 0, 200, '[]', 1)")
    db.close()
    store = ResultsStore(path)
    store.append(_row(request_id="new", profile="sh", mode="shadow", arm="twin", agree="false", shadow_of="x"))
    store.close()
    rows = results.read_rows(path)
    assert [r["request_id"] for r in rows] == ["old", "new"]
    assert rows[0]["agree"] is None and rows[1]["agree"] == "false"
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == results.SCHEMA_VERSION
    db.close()


def test_migrations_run_in_order_once_each(tmp_path):
    calls = []
    steps = [lambda db, i=i: (calls.append(i), db.execute(f"CREATE TABLE t{i} (x)")) for i in range(3)]
    db = sqlite3.connect(tmp_path / "m.sqlite", isolation_level=None)
    assert results.migrate(db, steps[:2]) == 2
    assert results.migrate(db, steps) == 3
    assert results.migrate(db, steps) == 3
    assert calls == [0, 1, 2]


def test_a_newer_schema_is_refused_with_advice(tmp_path):
    path = tmp_path / "future.sqlite"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {results.SCHEMA_VERSION + 5}")
    db.close()
    with pytest.raises(StoreError, match="newer than this toolquake"):
        ResultsStore(path)
    with pytest.raises(StoreError, match="newer than this toolquake"):
        results.read_rows(path)


def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just text " * 100)
    with pytest.raises(StoreError, match="cannot use"):
        ResultsStore(path)


def test_append_waits_for_another_writer_instead_of_failing(tmp_path):
    path = tmp_path / "busy.sqlite"
    store = ResultsStore(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO results (request_id, ts, profile, mode, arm, stream, status, perturbers) "
                  "VALUES ('other', 1.0, 'off', 'perturb', 'live', 0, 200, '[]')")
    inserting, done = threading.Event(), threading.Event()
    # sqlite calls this as the store's INSERT starts running (the write lock is taken after it)
    store._db.set_trace_callback(lambda sql: inserting.set() if sql.lstrip().upper().startswith("INSERT") else None)
    t = threading.Thread(target=lambda: (store.append(_row()), done.set()))
    t.start()
    assert inserting.wait(10)  # the append runs while the other writer holds the file ...
    assert not done.is_set()  # ... and cannot have finished: the lock is held
    other.execute("COMMIT")
    assert done.wait(10)  # it waited instead of failing
    t.join()
    other.close()
    store.close()
    # written after the other writer's row: it waited for that transaction
    assert [r["request_id"] for r in results.read_rows(path)] == ["other", "r1"]


def test_two_stores_on_one_file_both_append(tmp_path):
    path = tmp_path / "shared.sqlite"
    a, b = ResultsStore(path), ResultsStore(path)
    for i in range(20):
        (a if i % 2 else b).append(_row(request_id=f"r{i}"))
    a.close()
    b.close()
    assert sorted(r["request_id"] for r in results.read_rows(path)) == sorted(f"r{i}" for i in range(20))


def test_summary_is_computed_from_the_stored_verdicts(tmp_path):
    path = tmp_path / "s.sqlite"
    store = ResultsStore(path)
    spec = [  # (profile, category, valid, taxonomy, semantic_valid)
        ("off", "multiple", True, None, None),
        ("off", "multiple", True, None, None),
        ("off", "multiple", False, "wrong_param_value", True),
        ("off", "simple_python", True, None, None),
        ("expanded", "multiple", False, "wrong_function", False),
        ("expanded", "multiple", True, None, None),
        ("expanded", "multiple", False, "wrong_count", False),
        ("expanded", "simple_python", False, "wrong_function", False),
    ]
    for i, (profile, cat, valid, tax, sem) in enumerate(spec):
        store.append(
            _row(
                request_id=f"r{i}",
                profile=profile,
                case_id=f"{cat}_{i}",
                category=cat,
                valid=valid,
                taxonomy=tax,
                error_type=None if valid else "x:y",
                semantic_valid=sem,
            )
        )
    for i, agree in enumerate(["true", "semantic", "false", "true"]):
        store.append(_row(request_id=f"t{i}", profile="sh", mode="shadow", arm="twin", agree=agree))
    store.close()
    s = summarize_db(path)
    assert s["rows"] == len(spec) + 4

    def acc(profile, cat=None):
        sel = [v for p, c, v, _, _ in spec if p == profile and (cat is None or c == cat)]
        return Fraction(sum(sel), len(sel))

    for profile in ("off", "expanded"):
        arm = s["arms"][profile]
        assert arm["n"] == sum(1 for p, *_ in spec if p == profile)
        assert arm["accuracy"] == pytest.approx(float(acc(profile)))
        for cat in ("multiple", "simple_python"):
            assert arm["by_category"][cat]["accuracy"] == pytest.approx(float(acc(profile, cat)))
    exp = s["arms"]["expanded"]
    assert exp["drop_vs_off"] == pytest.approx(float((acc("expanded") - acc("off")) / acc("off")))
    assert exp["by_category"]["multiple"]["drop_vs_off"] == pytest.approx(
        float((acc("expanded", "multiple") - acc("off", "multiple")) / acc("off", "multiple"))
    )
    assert exp["errors"] == {"wrong_function": 2, "wrong_count": 1}
    assert s["arms"]["off"]["semantic_flips"] == 1
    assert s["consistency"]["sh"] == {
        "n": 4,
        "exact": 2,
        "semantic": 1,
        "disagree": 1,
        "rate_exact": 0.5,
        "rate_semantic": 0.75,
        "rate_disagree": 0.25,
    }
    text = render_markdown(s)
    assert "| live | expanded | 4 | 0.250 |" in text
    assert "| sh | 4 | 2 | 1 | 1 | 75.0 % [30.1, 95.4] |" in text


@pytest.mark.processes
def test_report_db_prints_the_summary(tmp_path):
    path = tmp_path / "cli.sqlite"
    store = ResultsStore(path)
    for i, (profile, valid) in enumerate([("off", True), ("off", True), ("expanded", True), ("expanded", False)]):
        store.append(
            _row(
                request_id=f"r{i}",
                profile=profile,
                case_id=f"multiple_{i}",
                category="multiple",
                valid=valid,
                taxonomy=None if valid else "wrong_function",
            )
        )
    store.close()
    run = [sys.executable, "-m", "toolquake", "report", "--db", str(path)]
    as_json = subprocess.run([*run, "--format", "json"], capture_output=True, text=True, cwd=ROOT)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == json.loads(json.dumps(summarize_db(path)))
    as_md = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert as_md.returncode == 0 and as_md.stdout == render_markdown(summarize_db(path))
    missing = subprocess.run([*run[:-1], str(tmp_path / "nope.sqlite")], capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and "no results file" in missing.stderr


@pytest.mark.processes
def test_report_db_counts_not_perturbed_pairs_apart_and_out_of_the_accuracy(tmp_path):
    """Rows as the live scorer writes them: a rephrasing the value check rejected went out unchanged."""
    path = tmp_path / "np.sqlite"
    store = ResultsStore(path)
    rejected = [{"name": "paraphrase", "params": {}, "report": {"not_perturbed": "rephrasing rejected"}}]
    done = [{"name": "paraphrase", "params": {}, "report": {"chars_changed": 12}}]
    spec = [  # (profile, case, valid, perturbers)
        ("off", "multiple_0", True, []), ("off", "multiple_1", True, []), ("off", "multiple_2", False, []),
        ("rephrased", "multiple_0", False, done), ("rephrased", "multiple_1", True, rejected),
        ("rephrased", "multiple_2", True, rejected), ("rephrased", "multiple_3", True, done),
        ("rephrased", "multiple_4", False, done),
    ]
    for i, (profile, case, valid, steps) in enumerate(spec):
        store.append(_row(request_id=f"r{i}", profile=profile, case_id=case, category="multiple", valid=valid,
                          taxonomy=None if valid else "wrong_function", perturbers=steps))
    store.close()
    stored = results.read_rows(path)
    kept = [r for r in stored if r["profile"] == "rephrased" and r["perturbers"] == rejected]
    mine = [r for r in stored if r["profile"] == "rephrased" and r["perturbers"] == done]
    assert len(kept) == 2 and len(mine) == 3
    run = [sys.executable, "-m", "toolquake", "report", "--db", str(path)]
    out = subprocess.run([*run, "--format", "json"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    arm = json.loads(out)["arms"]["rephrased"]
    correct = sum(1 for r in mine if r["valid"])
    assert arm["n"] == len(mine) and arm["not_perturbed"] == len(kept)
    assert arm["accuracy"] == pytest.approx(correct / len(mine))
    assert arm["accuracy_ci"] == pytest.approx(list(wilson_ci(correct, len(mine))))
    assert arm["perturbed_share"] == pytest.approx(len(mine) / (len(mine) + len(kept)))
    # the paired comparison against off: only the perturbed case that off also answered (multiple_0)
    assert arm["paired"]["n"] == 1 and arm["paired"]["valid_to_invalid"] == 1
    assert json.loads(out)["arms"]["off"]["not_perturbed"] == 0
    md = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert f"| live | rephrased | {len(mine)} | {len(kept)} | {len(mine) / (len(mine) + len(kept)):.3f} |" in md


def test_the_live_drop_is_the_paired_drop_inside_its_interval(tmp_path):
    # off scored cases 0–11 (8 valid), expanded 0–5 and 12–17 (9 valid; on the 6 shared cases 6 → 3 valid): the
    # overall accuracies give +12.5 %, the paired comparison on the shared cases -50 %; the report's drop is the
    # one its interval and McNemar's test are about
    path = tmp_path / "p.sqlite"
    store = ResultsStore(path)
    off = {i: i < 8 for i in range(12)}
    expanded = {i: i < 3 for i in range(6)} | {i: True for i in range(12, 18)}
    for profile, verdicts in (("off", off), ("expanded", expanded)):
        for i, valid in verdicts.items():
            store.append(_row(request_id=f"{profile}{i}", profile=profile, case_id=f"multiple_{i}",
                              category="multiple", valid=valid, error_type=None if valid else "x:y"))
    store.close()
    arm = summarize_db(path)["arms"]["expanded"]
    shared = [i for i in expanded if i in off]
    base_acc = Fraction(sum(off[i] for i in shared), len(shared))
    arm_acc = Fraction(sum(expanded[i] for i in shared), len(shared))
    assert arm["paired"]["n"] == len(shared) == 6
    assert arm["drop_vs_off"] == pytest.approx(float(arm_acc / base_acc - 1)) == -0.5
    lo, hi = arm["drop_vs_off_ci"]
    assert lo <= arm["drop_vs_off"] <= hi
    lo, hi = arm["drop_vs_off_cs"]
    assert lo <= arm["drop_vs_off"] <= (hi if hi is not None else float("inf"))
