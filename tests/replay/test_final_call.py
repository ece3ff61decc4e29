"""Seed 003 challenge 3 as the paper scores it (#31): the AST verdict on a conversation's final calls, beside BFCL's
whole-conversation verdict.

A scripted model (the fake upstream playing trajectories) answers five `multi_turn_base` conversations: two as
the ground truth, one with a wrong first turn and the right last turn (BFCL: invalid; final call: valid), one
with a wrong argument in its last turn (both invalid), one unscripted. They are replayed under `off` and a
conversation-lengthening arm of the played family (`bfcl-conv-20k-s2`). The final-call verdicts are recomputed here
from the stored answers with BFCL's own AST checker (the `bfcl-eval` wheel, scorers/bfcl_reference.py) and a
ground-truth conversion written here, then compared with what replay stored and what the report says.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.multiturn import first_user, load, possible_answer, scripted_turns
from tests.support.report import report
from toolquake.scorers import multiturn as mt

pytestmark = pytest.mark.needs_corpus

CASES = [f"multi_turn_base_{i}" for i in range(5)]
PROFILES = ("off", "bfcl-conv-20k-s2")


def _wrong_last_turn(result: mt.MultiTurnResult) -> mt.MultiTurnResult:
    """The same run with the first argument of the last turn's first call changed."""
    for step in result.turns[-1]:
        if step.calls:
            call = step.calls[0]
            key = next(iter(call["arguments"]))
            call["arguments"][key] = "certainly-not-this"
            return result
    raise AssertionError("the last turn has no call")


@pytest.fixture(scope="module")
def replayed(backends, tmp_path_factory):
    from toolquake.scorers.bfcl_reference import Reference

    script = {}
    gt = {c: mt.ground_truth_result(load(c), backends) for c in CASES[:4]}
    wrong_first = gt["multi_turn_base_0"]
    wrong_first.turns[0] = [mt.Step(calls=[{"name": "cd", "arguments": {"folder": "document"}},
                                           {"name": "mkdir", "arguments": {"dir_name": "tmp"}}])]
    script[first_user(load("multi_turn_base_0"))] = scripted_turns(wrong_first)
    script[first_user(load("multi_turn_base_1"))] = scripted_turns(gt["multi_turn_base_1"])
    script[first_user(load("multi_turn_base_2"))] = scripted_turns(_wrong_last_turn(gt["multi_turn_base_2"]))
    script[first_user(load("multi_turn_base_3"))] = scripted_turns(gt["multi_turn_base_3"])
    root = tmp_path_factory.mktemp("final-call")
    path = root / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": k, "turns": v}) + "\n" for k, v in script.items()))
    fake = start_fake_upstream("--trajectories", str(path))
    try:
        r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend",
                            f"{fake.url}/v1", "--categories", "multi_turn_base", "--limit", str(len(CASES)),
                            "--profiles", ",".join(PROFILES), "--out", str(root / "run")], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr[-2000:]
    db = sqlite3.connect(root / "run" / "replay.sqlite")
    db.row_factory = sqlite3.Row
    stored = [dict(x) for x in db.execute("SELECT * FROM results ORDER BY case_id, profile")]
    db.close()
    return root / "run", stored, Reference(root / "bfcl-eval")


def reference_final(reference, row: dict) -> bool:
    """BFCL's AST checker on the stored last turn's calls against that turn's ground truth."""
    case = load(row["case_id"])
    turns = json.loads(row["answer"])["turns"]
    if len(turns) < len(case.ground_truth):
        return False
    calls = [c for step in turns[-1] for c in step.get("calls") or []]
    expected = [possible_answer(t, case.functions) for t in case.ground_truth[-1]]
    if not expected:
        return not calls
    valid, _ = reference.check(case.functions, expected, "parallel" if len(expected) > 1 else "multiple", calls)
    return valid


def _in_arm(row: dict) -> bool:
    return row["status"] == "scored" and not (json.loads(row["perturbers"] or "{}") or {}).get("not_perturbed")


def test_final_call_verdicts_are_bfcl_s_ast_verdicts_on_the_stored_last_turn(replayed):
    out, stored, reference = replayed
    assert len(stored) == len(CASES) * len(PROFILES) and all(x["status"] == "scored" for x in stored)
    by = {(x["case_id"], x["profile"]): x for x in stored}
    for row in stored:
        final = json.loads(row["answer"])["final_call"]
        assert final["valid"] == reference_final(reference, row), row["case_id"]
        assert final["turn"] == len(load(row["case_id"]).ground_truth) - 1
    # the two verdicts measure different things: a wrong first turn fails BFCL's, not the final call's
    off0, off2 = by[("multi_turn_base_0", "off")], by[("multi_turn_base_2", "off")]
    assert not off0["valid"] and json.loads(off0["answer"])["final_call"]["valid"]
    assert not off2["valid"] and not json.loads(off2["answer"])["final_call"]["valid"]
    assert json.loads(by[("multi_turn_base_1", "off")]["answer"])["final_call"]["valid"]

    data = json.loads(report(str(out), "--format", "json", "--no-plots").stdout)
    for profile in PROFILES:
        mine = [x for x in stored if x["profile"] == profile and _in_arm(x)]
        final = data["arms"][profile]["final_call"]
        assert final["n"] == len(mine) > 0
        assert final["accuracy"] == pytest.approx(sum(reference_final(reference, x) for x in mine) / len(mine))
        assert final["bfcl_accuracy"] == pytest.approx(sum(x["valid"] for x in mine) / len(mine))
    # seed 003 Table 2: the conversation arm's cell carries the final-call accuracy beside BFCL's
    ((group, cells),) = data["conversation_grid"]["fake-model"].items()
    cell = cells["20000"]
    arm = data["arms"]["bfcl-conv-20k-s2"]
    assert cell["final_call"]["accuracy"] == pytest.approx(arm["final_call"]["accuracy"])
    assert cell["accuracy"] == pytest.approx(data["arms"]["bfcl-conv-20k-s2"]["accuracy"])
    md = report(str(out), "--no-plots").stdout
    assert group == "played, fact tool_response"
    assert f"| fake-model | {group} | AST, the last turn's calls |" in md
    off = data["arms"]["off"]["final_call"]
    assert f"| fake-model | off | {off['n']} |" in md
