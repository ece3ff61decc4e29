"""Seed 003 challenge 3 as the paper measures it (#47): `@seed003-conversations` gives each conversation up to its
last user turn and grades one request, the model's next call, by AST against the ground truth's first call of that
turn; BFCL's whole-conversation verdict stays available as its own arm family (`@seed003-conversations-bfcl`).

The model is the ground truth (the fake upstream playing each case's ground-truth trajectory: every request is
answered with the ground truth's calls of the turn it is at), for the first eight `multi_turn_base` cases. Two of
them answer their last turn with a harmless read-only `pwd()` after the ground truth's calls. The requests the fake
received are counted again here with the run's counter (the estimate) and matched with the pairs.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.multiturn import first_user, load, possible_answer, scripted_turns
from tests.support.report import report
from toolquake.perturbers.helpers.tokens import EstimateCounter
from toolquake.scorers import multiturn as mt

pytestmark = pytest.mark.needs_corpus

N = 8
CASES = [f"multi_turn_base_{i}" for i in range(N)]
BUDGETS = (10_000, 20_000, 40_000, 80_000)
ARMS = ["conv-off", *(f"conv-{b // 1000}k-{s}" for s in ("s1", "s2") for b in BUDGETS)]
#: cases whose model adds `pwd()` after the ground truth's calls of the last turn (one call / four calls expected)
PWD_CASES = ("multi_turn_base_1", "multi_turn_base_3")
PWD = {"name": "pwd", "arguments": {}}
#: where the value the last turn's first ground-truth call needs sits, read off the corpus (the call, then the
#: earlier message of the given conversation that holds the value, if any):
#: base_1 tail(file_name='log.txt', lines=20): 'log.txt' in an earlier user turn and in an earlier `ls` result;
#: base_3 cd(folder='projects'): 'projects' in an earlier `ls` result only; base_5 comment(tweet_id=0, ...): the
#: tweet id in an earlier `post_tweet` result only; base_7 cat(file_name='goals.txt'): in an earlier `find` result
#: only; base_0, 2, 4 and 6: the value is in the final user message or in no earlier message
PLACED = {"s1": {"multi_turn_base_1"},
          "s2": {"multi_turn_base_1", "multi_turn_base_3", "multi_turn_base_5", "multi_turn_base_7"}}


def _budget(profile: str) -> int | None:
    part = profile.split("-")[1]
    return int(part[:-1]) * 1000 if part.endswith("k") else None


def _report(out: Any, *args: str) -> str:
    return report(str(out), *args).stdout


def _trajectories(backends: Any, path: Any) -> None:
    """The fake's script: each case's ground truth, turn by turn (its own user messages named, so the filler's
    user turns do not count as turns), the last turn with `pwd()` added for PWD_CASES."""
    lines = []
    for case_id in CASES:
        case = load(case_id)
        turns = scripted_turns(mt.ground_truth_result(case, backends))
        if case_id in PWD_CASES:
            turns[-1][0] = {"calls": [*turns[-1][0]["calls"], PWD]}
        users = [m["content"] for turn in case.turns for m in turn if m["role"] == "user"]
        lines.append(json.dumps({"first_user": first_user(case), "turns": turns, "users": users}))
    path.write_text("\n".join(lines) + "\n")


def _replay(fake_url: str, out: Any, profiles: str, limit: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", f"{fake_url}/v1",
                           "--profiles", profiles, "--categories", "multi_turn_base", "--limit", str(limit),
                           "--token-counter", "estimate",
                           "--allow-estimate", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def _rows(out: Any) -> list[dict[str, Any]]:
    db = sqlite3.connect(out / "replay.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return [dict(x) for x in db.execute("SELECT * FROM results ORDER BY case_id, profile")]
    finally:
        db.close()


@pytest.fixture(scope="module")
def given(backends, tmp_path_factory):
    """`@seed003-conversations` on the first eight `multi_turn_base` cases against the ground-truth model: the
    requests the model received, the stored rows, the JSON and Markdown reports."""
    root = tmp_path_factory.mktemp("seed003-conversations")
    _trajectories(backends, root / "trajectories.jsonl")
    fake = start_fake_upstream("--trajectories", str(root / "trajectories.jsonl"))
    try:
        r = _replay(fake.url, root / "run", "@seed003-conversations", N)
        import httpx

        received = [json.loads(x["body"]) for x in httpx.get(f"{fake.url}/_fake/requests").json()
                    if x["path"].endswith("/chat/completions")]
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    return received, _rows(root / "run"), json.loads(_report(root / "run", "--format", "json", "--no-plots")), \
        _report(root / "run", "--no-plots")


def _case_of(body: dict[str, Any]) -> str:
    users = {m.get("content") for m in body["messages"] if m.get("role") == "user"}
    (case_id,) = [c for c in CASES if first_user(load(c)) in users]
    return case_id


def _unplaced(row: dict[str, Any]) -> str | None:
    applied = (json.loads(row["perturbers"] or "{}") or {}).get("applied") or []
    return next((a["report"]["not_perturbed"] for a in applied if "not_perturbed" in (a.get("report") or {})), None)


def test_one_graded_request_per_pair_each_at_its_budget(given) -> None:
    received, rows, _, _ = given
    assert len(rows) == N * len(ARMS) and all(r["status"] == "scored" for r in rows)
    # one request per (case, arm): the conversation is given, never played
    per_case = Counter(_case_of(b) for b in received)
    assert per_case == {c: len(ARMS) for c in CASES}
    counter = EstimateCounter()
    for case_id in CASES:
        counts = sorted(counter.count_request(b) for b in received if _case_of(b) == case_id)
        placed = [r for r in rows if r["case_id"] == case_id and _budget(r["profile"]) and _unplaced(r) is None]
        for row in placed:  # the stored report (the run's counter) and the request the model got: at the budget
            budget = _budget(row["profile"])
            (step,) = json.loads(row["perturbers"])["applied"]
            assert abs(step["report"]["tokens_total"] - budget) <= 0.02 * budget, (case_id, row["profile"])
            near = [c for c in counts if abs(c - budget) <= 0.02 * budget]
            assert near, (case_id, row["profile"], counts)
            counts.remove(near[0])
        # every other request of the case (conv-off, the unplaced pairs) is the given conversation, unlengthened
        assert len(set(counts)) == 1, (case_id, counts)
    # the report's tokens reached, arm by arm: within the budget's 2 % (the pairs left out are not among them)
    reached = given[2]["lengthening"]["fake-model"]
    for profile in ARMS[1:]:
        b, spread = _budget(profile), reached[profile]["tokens_total"]
        assert b * 0.98 <= spread["min"] <= spread["max"] <= b * 1.02


def test_the_ground_truth_model_scores_one_in_both_settings(given) -> None:
    _, rows, data, md = given
    grid = data["conversation_grid"]["fake-model"]
    assert set(grid) == {"fact user_turn", "fact tool_response"}
    for group, setting in (("fact user_turn", "s1"), ("fact tool_response", "s2")):
        assert sorted(grid[group], key=int) == [str(b) for b in BUDGETS]
        for b in BUDGETS:
            cell = grid[group][str(b)]
            assert cell["conversation"] == "given" and cell["accuracy"] == 1.0
            assert cell["n"] == sum(1 for r in rows if r["profile"] == f"conv-{b // 1000}k-{setting}"
                                    and _unplaced(r) is None) > 0
    assert data["arms"]["conv-off"]["n"] == N and data["arms"]["conv-off"]["accuracy"] == 1.0
    for arm in ARMS:
        assert data["arms"][arm]["next_call"]["accuracy"] == 1.0
    assert "| fake-model | fact user_turn | AST, next call (the paper's score) | 1.000" in md


def test_the_cases_where_no_fact_can_be_placed_are_listed_and_left_out(given, backends) -> None:
    _, _, data, md = given
    listed = {(u["case_id"], p): u["reason"] for u in data["conversation_unplaced"]["fake-model"]
              for p in u["profiles"]}
    counter = EstimateCounter()
    for setting, kind in (("s1", "user"), ("s2", "tool")):
        for b in BUDGETS:
            profile = f"conv-{b // 1000}k-{setting}"
            for case_id in CASES:
                if case_id not in PLACED[setting]:
                    assert listed[(case_id, profile)] in (
                        f"no earlier {kind} message holds a value of the expected next call",
                        "no value of the expected next call that the final user message does not already hold")
                    continue
                size = counter.count_request(_given_body(case_id, backends))
                if size > 1.02 * b:  # the given conversation alone is past the budget: listed, not sent as is
                    assert "already over the budget" in listed[(case_id, profile)]
                else:
                    assert (case_id, profile) not in listed
            left = sum(1 for c in CASES if (c, profile) in listed)
            assert data["arms"][profile]["not_perturbed"] == left
            assert data["arms"][profile]["n"] == N - left
    assert ("multi_turn_base_5", "conv-10k-s2") in listed  # 11.8K estimate tokens before any filler
    assert "Seed 003 challenge 3: given conversations whose fact could not be placed" in md
    assert "| fake-model | multi_turn_base_0 | conv-10k-s1, conv-20k-s1, conv-40k-s1, conv-80k-s1" in md


def _given_body(case_id: str, backends: Any) -> dict[str, Any]:
    """The given conversation of a case (the request before any lengthening), built here as replay builds it."""
    from toolquake.proxy.replay.multiturn import given_request

    return given_request(load(case_id), "fake-model", backends)[0]


def test_a_harmless_extra_call_after_the_graded_one_is_graded_as_the_paper_grades(given) -> None:
    _, rows, data, _ = given
    for case_id in PWD_CASES:
        for row in (r for r in rows if r["case_id"] == case_id):
            answer = json.loads(row["answer"])
            assert row["valid"] == 1 and answer["next_call"]["valid"]
            assert answer["next_call"]["calls"] == len(load(case_id).ground_truth[-1]) + 1
            assert answer["next_call"]["expected_calls"] == len(load(case_id).ground_truth[-1])
    # the last turns of several calls (only the first graded) are reported apart from those of one
    off = data["arms"]["conv-off"]["next_call"]
    multi = sum(1 for c in CASES if len(load(c).ground_truth[-1]) > 1)
    assert off["multi_call"]["n"] == multi and off["one_call"]["n"] == N - multi
    cell = data["conversation_grid"]["fake-model"]["fact tool_response"]["10000"]
    assert cell["multi_call"]["n"] >= 1 and cell["multi_call"]["accuracy"] == 1.0


def test_both_settings_get_the_same_filler(given, backends) -> None:
    """Where a case has its fact in both settings, s1 and s2 at one budget add the same filler turns, in the same
    order: they differ only in where the fact sits (a user turn or a tool response)."""
    received, rows, _, _ = given
    case_id = "multi_turn_base_1"
    own = [json.dumps(m, sort_keys=True) for m in _given_body(case_id, backends)["messages"]]
    counter = EstimateCounter()
    for b in BUDGETS:
        mine = [x for x in received if _case_of(x) == case_id and abs(counter.count_request(x) - b) <= 0.02 * b]
        assert len(mine) == 2, b
        fillers = [[m for m in (json.dumps(y, sort_keys=True) for y in x["messages"]) if m not in own] for x in mine]
        assert fillers[0] and fillers[0] == fillers[1]
        assert any('"tool_calls"' in m for m in fillers[0])  # tool-calling filler in both
    # ...after a different fact: a user turn in s1, a tool response in s2 (here both in the first turn)
    for setting, role in (("s1", "user"), ("s2", "tool")):
        for row in (r for r in rows if r["case_id"] == case_id and r["profile"].endswith(setting)):
            (step,) = json.loads(row["perturbers"])["applied"]
            assert json.loads(own[step["report"]["fact_message"]])["role"] == role


def test_bfcl_s_whole_conversation_verdict_is_its_own_arm_family(backends, tmp_path) -> None:
    from toolquake.proxy.replay.selection import default_categories, expand_profiles
    from toolquake.proxy.server.config import load_config

    config = load_config(None, env={})
    family = expand_profiles("@seed003-conversations-bfcl", ["off", *config.profiles])
    assert family == ["off", *(f"bfcl-conv-{b // 1000}k-{s}" for s in ("s1", "s2") for b in BUDGETS)]
    assert all(config.profiles[p].conversation == "played" for p in family[1:])
    assert default_categories("@seed003-conversations-bfcl") == ["multi_turn_base"]
    _trajectories(backends, tmp_path / "trajectories.jsonl")
    fake = start_fake_upstream("--trajectories", str(tmp_path / "trajectories.jsonl"))
    try:
        r = _replay(fake.url, tmp_path / "run", "off,bfcl-conv-10k-s2", 2)
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert len(rows) == 4
    for row in rows:  # played: every turn's steps, BFCL's verdict, and the last turn's calls by AST beside it
        answer = json.loads(row["answer"])
        assert len(answer["turns"]) == len(load(row["case_id"]).turns) and "final_call" in answer
        assert "next_call" not in answer and row["valid"] == 1
    data = json.loads(_report(tmp_path / "run", "--format", "json", "--no-plots"))
    cells = data["conversation_grid"]["fake-model"]["played, fact tool_response"]
    assert cells["10000"]["conversation"] == "played" and "final_call" in cells["10000"]
    md = _report(tmp_path / "run", "--no-plots")
    assert "| fake-model | played, fact tool_response | BFCL, whole conversation |" in md


def test_the_next_call_verdict_is_bfcl_s_ast_verdict_on_the_first_call(backends, tmp_path) -> None:
    """Wrong answers too: the last turn's calls reversed (right as a set, wrong as the next call), a wrong argument
    in the first call, a text answer; each stored verdict is BFCL's own AST checker (the `bfcl-eval` wheel) on the
    answer's first call against the turn's first ground-truth call."""
    from toolquake.scorers.bfcl_reference import Reference

    answers = {"multi_turn_base_0": lambda calls: list(reversed(calls)),
               "multi_turn_base_1": lambda calls: [{**calls[0], "arguments": {**calls[0]["arguments"],
                                                                               "file_name": "not-log.txt"}}],
               "multi_turn_base_2": lambda calls: calls,
               "multi_turn_base_3": lambda calls: None}
    lines = []
    for case_id, change in answers.items():
        case = load(case_id)
        turns = scripted_turns(mt.ground_truth_result(case, backends))
        calls = change(turns[-1][0]["calls"])
        turns[-1][0] = {"calls": calls} if calls else {"text": "I would rather not."}
        users = [m["content"] for turn in case.turns for m in turn if m["role"] == "user"]
        lines.append(json.dumps({"first_user": first_user(case), "turns": turns, "users": users}))
    (tmp_path / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    fake = start_fake_upstream("--trajectories", str(tmp_path / "trajectories.jsonl"))
    try:
        r = _replay(fake.url, tmp_path / "run", "conv-off", len(answers))
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    reference = Reference(tmp_path / "bfcl-eval")
    verdicts = {}
    for row in _rows(tmp_path / "run"):
        case = load(row["case_id"])
        message = json.loads(row["answer"])["choices"][0]["message"]
        made = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message.get("tool_calls") or []]
        expected = [possible_answer(case.ground_truth[-1][0], case.functions)]
        theirs = reference.check(case.functions, expected, "multiple", made[:1])[0] if made else False
        assert bool(row["valid"]) == theirs, row["case_id"]
        verdicts[row["case_id"]] = bool(row["valid"])
    assert verdicts == {"multi_turn_base_0": False, "multi_turn_base_1": False, "multi_turn_base_2": True,
                        "multi_turn_base_3": False}


def test_given_conversations_are_refused_through_another_proxy(proxy, fake_upstream, tmp_path) -> None:
    """With --proxy the perturbers' reports are not visible, so a pair whose fact could not be placed, or whose
    request missed its budget, could not be listed apart: refused, naming the played family instead."""
    r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend",
                        f"{fake_upstream.url}/v1", "--proxy", proxy.url, "--profiles", "@seed003-conversations",
                        "--limit", "1", "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "@seed003-conversations-bfcl" in r.stderr and "--proxy" in r.stderr
    assert not (tmp_path / "run" / "replay.sqlite").exists()
