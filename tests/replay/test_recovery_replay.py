"""Recovery after failed tool results, scored in a replay of multi-turn cases: `toolquake replay` (CLI process,
in-process proxy) plays three BFCL multi-turn cases against the fake upstream, whose answers after the first
tool result this test chose (retry, report, invent a number, call something else); the fail-* profiles replace
the simulators' result before it reaches the model. The verdicts stored per row, and the report's recovery
table, are compared with what the test expects from its own choices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import recorded, start_fake_upstream
from tests.support.replay import replay, rows
from tests.support.report import report_run
from toolquake.scorers.aggregate import wilson

pytestmark = pytest.mark.needs_corpus

CASES = ("multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_2")
PROFILES = ("fail-timeout", "fail-empty")
TAG = "recovery-replay"
INVENTED = "The operation finished: 98765 entries were processed."
#: the right behaviour per kind (docs/perturbers-faults.md), for the verdicts this test provokes
RECOVERED = {"fail-timeout": {"retried", "reported"}, "fail-empty": {"requeried", "reported"}}


def plan(case: Any, backends: Any) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """The fake's answers for one case (turn 0 scripted, later turns a text) and the verdicts expected, in order,
    for the answers that follow a failed result (every answer after a call in turn 0)."""
    from toolquake.scorers.multiturn import ground_truth_result

    first = ground_truth_result(case, backends).turns[0][0].calls[0]
    first_call = {"calls": [first]}
    other = next(f["name"] for f in case.functions if f["name"] != first["name"])
    later = [[{"text": "Done."}] for _ in case.turns[1:]]
    if case.id == CASES[0]:  # retry the failed call, then report that it failed again
        return [[first_call, first_call, {"text": "The tool failed twice, I could not finish this."}], *later], \
            ["retried", "reported"]
    if case.id == CASES[1]:  # answer with a number that was never sent
        return [[first_call, {"text": INVENTED}], *later], ["invented"]
    # call another function (its own result fails too), then a text that says nothing of the failure
    arguments = ground_args(case, other)
    return [[first_call, {"calls": [{"name": other, "arguments": arguments}]}, {"text": "Done."}], *later], \
        ["other_call", "answered"]


def ground_args(case: Any, name: str) -> dict[str, Any]:
    """Arguments for `name` from its schema: a placeholder string for each required parameter."""
    fn = next(f for f in case.functions if f["name"] == name)
    required = (fn.get("parameters") or {}).get("required") or []
    return {p: "x" for p in required}


@pytest.fixture(scope="module")
def replayed(backends: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]], Any]:
    from toolquake.bfcl.corpus import load_case

    expected: dict[str, list[str]] = {}
    script = []
    for case_id in CASES:
        case = load_case(case_id)
        turns, verdicts = plan(case, backends)
        expected[case_id] = verdicts
        script.append({"first_user": case.turns[0][0]["content"], "turns": turns})
    assert len({s["first_user"] for s in script}) == len(CASES)
    tmp = tmp_path_factory.mktemp("recovery")
    path = tmp / "trajectories.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in script))
    fake = start_fake_upstream("--trajectories", str(path))
    try:
        out = tmp / "out"
        done = replay("--backend", f"{fake.url}/v1", "--profiles", ",".join(("off", *PROFILES)), "--out", str(out),
                      "--categories", "multi_turn_base", "--limit", str(len(CASES)), "--header", f"X-Test-Tag: {TAG}")
        assert done.returncode == 0, done.stderr
        assert "change nothing here" not in done.stderr  # multi-turn cases: the failures are injected
        yield out, expected, recorded(fake, TAG)
    finally:
        fake.stop()


def test_each_answer_after_a_failure_gets_the_verdict_the_test_chose(replayed) -> None:
    out, expected, sent = replayed
    found = {(r["case_id"], r["profile"]): r for r in rows(out)}
    assert set(found) == {(c, p) for c in CASES for p in ("off", *PROFILES)}
    for case_id in CASES:
        assert "recovery" not in json.loads(found[(case_id, "off")]["perturbers"])
        for profile in PROFILES:
            row = found[(case_id, profile)]
            assert row["status"] == "scored", row
            got = json.loads(row["perturbers"])["recovery"]
            kind = profile.removeprefix("fail-")
            assert [g["verdict"] for g in got] == expected[case_id], (case_id, profile, got)
            assert [g["recovered"] for g in got] == [v in RECOVERED[profile] for v in expected[case_id]]
            assert all(g["kind"] == kind and g["turn"] == 0 for g in got)
            assert [g["step"] for g in got] == list(range(1, len(got) + 1))
    # the number the invented answer carries was never sent to the model, other than as that answer itself
    bodies = [json.loads(r["body"]) for r in sent if r["method"] == "POST"]
    assert bodies and not any("98765" in json.dumps([m for m in b["messages"] if m.get("content") != INVENTED])
                              for b in bodies)
    invented = json.loads(found[(CASES[1], "fail-timeout")]["perturbers"])["recovery"][0]
    assert invented["invented"] == ["98765"]


def test_the_model_saw_the_failure_in_place_of_the_simulators_result(replayed) -> None:
    _, _, sent = replayed
    bodies = [json.loads(r["body"]) for r in sent if r["method"] == "POST"]
    after_call = [b for b in bodies if b["messages"][-1]["role"] == "tool"]
    timeouts = [b for b in after_call if "timed out" in b["messages"][-1]["content"]]
    empties = [b for b in after_call if b["messages"][-1]["content"] in ("{}", "[]", "")]
    per_case = sum(len(v) for v in replayed[1].values())
    assert len(timeouts) == per_case and len(empties) >= per_case


def test_the_report_shows_the_recovered_share_per_kind_with_wilson_intervals(replayed) -> None:
    out, expected, _ = replayed
    done = replay_report(out, "json")
    report = json.loads(done)
    table = report["recovery"]["models"]["fake-model"]
    for profile in PROFILES:
        verdicts = [v for vs in expected.values() for v in vs]
        k = sum(v in RECOVERED[profile] for v in verdicts)
        entry = table[profile]
        assert entry["kind"] == profile.removeprefix("fail-")
        assert (entry["failures"], entry["recovered"]) == (len(verdicts), k)
        assert entry["recovered_share"] == pytest.approx(k / len(verdicts))
        assert entry["recovered_ci"] == pytest.approx(list(wilson(k, len(verdicts))))
        assert entry["verdicts"] == {v: verdicts.count(v) for v in set(verdicts)}
        assert entry["cases"] == len(CASES)
    md = replay_report(out, "md")
    assert "Recovery after failed tool results" in md and "fail-timeout" in md
    html = replay_report(out, "html")
    assert "Recovery after failed tool results" in html
    import csv
    import io

    lines = list(csv.DictReader(io.StringIO(replay_report(out, "csv"))))
    by_profile = {r["Profile"]: r for r in lines}
    assert by_profile["off"]["Tool Failure Recovered"] == "N/A"
    for profile in PROFILES:
        entry = table[profile]
        assert by_profile[profile]["Tool Failure Recovered"] == f"{entry['recovered_share'] * 100:.2f}%"
        assert by_profile[profile]["Tool Failures"] == str(entry["failures"])
    families = {(e["family"], e["kind"], e["profile"]) for e in report["families"]}
    assert families == {("faults", p.removeprefix("fail-"), p) for p in PROFILES}


def replay_report(out: Path, fmt: str) -> str:


    done = report_run(str(out), "--format", fmt, "--no-plots")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fail_arms_on_single_turn_cases_are_named_as_changing_nothing(fake_upstream, tmp_path: Path) -> None:
    fake = fake_upstream
    done = replay("--backend", f"{fake.url}/v1", "--profiles", "off,fail-timeout", "--out", str(tmp_path / "o"),
                  "--categories", "simple_python", "--limit", "2")
    assert done.returncode == 0, done.stderr
    assert "tool_failure arms (fail-*) change nothing here" in done.stderr, done.stderr
    sent = {r["profile"]: r for r in rows(tmp_path / "o")}
    assert set(sent) == {"off", "fail-timeout"}
