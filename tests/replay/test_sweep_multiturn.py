"""`toolquake sweep` over BFCL multi-turn cases: the CLI as a process, the real proxy in it, the API simulators, and the
fake upstream playing each case's ground-truth trajectory — until a request grows past a hidden per-case size, where
it answers with text and no call (`--breaking` with `first_user`, `--trajectories` with `users`).

With one request in flight at a time, the fake's log cuts into the conversations the sweep played, in the order it
recorded them. From what the fake was sent the test judges each conversation itself — right exactly when no request
that was to make the turn's calls was past the size — and checks the recorded BFCL verdicts, the breaking points
and the report against that.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import start_fake_upstream
from tests.support.report import report_run
from tests.support.sweep import sweep

pytestmark = [pytest.mark.needs_corpus, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: `--categories multi_turn_base --limit 4`
CASES = ("multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_2", "multi_turn_base_3")


def _size(body: dict[str, Any], what: str) -> int:
    """The estimate's tokens of the request's last tool message (`response_tokens`) or of the whole request."""
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    counter = EstimateCounter()
    if what == "request_tokens":
        return counter.count_request(body)
    tools = [m for m in body["messages"] if m.get("role") == "tool"]
    content = tools[-1]["content"] if tools else ""
    return counter.count_text(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture(scope="module")
def scripts(backends: Any) -> dict[str, dict[str, Any]]:
    """Case → its first user message, its turns' user messages, and the ground truth as the fake's answers."""
    from tests.support.multiturn import load, scripted_turns
    from toolquake.scorers import multiturn as mt

    out = {}
    for cid in CASES:
        case = load(cid)
        users = [str(m["content"]) for turn in case.turns for m in turn if m.get("role") == "user"]
        out[cid] = {"first_user": users[0], "users": users,
                    "turns": scripted_turns(mt.ground_truth_result(case, backends))}
    assert len({s["first_user"] for s in out.values()}) == len(CASES), "first user messages must tell cases apart"
    return out


def _fake(scripts: dict[str, dict[str, Any]], limits: dict[str, int | None], what: str, tmp: Path):
    traj, breaking = tmp / "trajectories.jsonl", tmp / "breaking.jsonl"
    traj.write_text("".join(json.dumps(s) + "\n" for s in scripts.values()))
    breaking.write_text("".join(json.dumps({"first_user": scripts[cid]["first_user"], "measure": what,
                                            "wrong": [] if limit is None else [[limit + 1, None]]}) + "\n"
                                for cid, limit in limits.items()))
    return start_fake_upstream("--trajectories", str(traj), "--breaking", str(breaking))


def _conversations(sent: list[dict], scripts: dict[str, dict[str, Any]]) -> list[tuple[str, list[tuple]]]:
    """The fake's requests cut into conversations: (case, [(turn, step, body)]); a conversation opens at turn 0, step
    0. The turn counts the case's own user messages only (filler turns are not the case's)."""
    out: list[tuple[str, list[tuple]]] = []
    for q in sent:
        if not q["path"].endswith("/chat/completions"):
            continue
        body = json.loads(q["body"])
        messages = body["messages"]
        texts = [str(m.get("content")) for m in messages if m.get("role") == "user"]
        cid = next(c for c, s in scripts.items() if s["first_user"] in texts)
        turn = sum(1 for t in texts if t in set(scripts[cid]["users"])) - 1
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        step = sum(1 for m in messages[last_user:] if m.get("role") == "assistant")
        if (turn, step) == (0, 0):
            out.append((cid, []))
        assert out and out[-1][0] == cid, "one conversation at a time"
        out[-1][1].append((turn, step, body))
    return out


def _right(script: dict[str, Any], requests: list[tuple], limit: int | None, what: str) -> bool:
    """The conversation as the test judges it: right unless a request that was to make its turn's calls (step 0 of a
    turn with calls in the ground truth) was past the limit, so the fake answered text instead."""
    calls = [bool(turn) and "calls" in turn[0] for turn in script["turns"]]
    return not any(limit is not None and step == 0 and calls[turn] and _size(body, what) > limit
                   for turn, step, body in requests)


def _rows(out: Path) -> list[tuple[str, float, bool, int]]:
    """(case, x, valid, steps) of every recorded conversation, in the order recorded."""
    db = sqlite3.connect(out / "sweep.sqlite")
    try:
        xs = {p: json.loads(s)["sweep"]["x"] for p, s in db.execute("SELECT profile, spec FROM arms")}
        rows = db.execute("SELECT case_id, profile, valid, perturbers, status FROM results ORDER BY rowid").fetchall()
    finally:
        db.close()
    assert all(r[4] == "scored" for r in rows), rows
    return [(cid, xs[profile], bool(valid), json.loads(p)["steps"]) for cid, profile, valid, p, _ in rows]


def _report(out: Path) -> dict[str, Any]:
    r = report_run(str(out), "--format", "json", "--no-plots")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["sweeps"]["fake-model"]


def _check_sweep(scripts, limits, what: str, axis: str, low: int, high: int, step: int, tmp: Path) -> dict:
    fake = _fake(scripts, limits, what, tmp)
    try:
        out = tmp / "out"
        r = sweep("--backend", f"{fake.url}/v1", "--categories", "multi_turn_base", "--limit", str(len(CASES)),
                  "--axis", axis, "--min", str(low), "--max", str(high), "--resolution", str(step),
                  "--concurrency", "1", "--out", str(out))
        sent = httpx.get(f"{fake.url}/_fake/requests").json()
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr + r.stdout
    assert len(sent) < 2000, "the fake keeps the last 2,000 requests: the test needs them all"
    rows, played = _rows(out), _conversations(sent, scripts)
    assert [(cid, steps) for cid, _, _, steps in rows] == [(cid, len(reqs)) for cid, reqs in played]
    verdicts: dict[str, dict[float, bool]] = {}
    for (cid, x, valid, _), (_, requests) in zip(rows, played):
        assert valid == _right(scripts[cid], requests, limits[cid], what), (cid, x)  # BFCL's verdict, as judged
        assert x not in verdicts.setdefault(cid, {}), (cid, x)  # each point asked once
        verdicts[cid][x] = valid
    assert set(verdicts) == set(CASES)
    report = _report(out)[axis]["cases"]
    outcomes = {}
    for cid, seen in verdicts.items():
        first = min((x for x, ok in seen.items() if not ok), default=None)
        last = max((x for x, ok in seen.items() if ok and (first is None or x < first)), default=None)
        if first is not None and last is not None:
            assert first - last == step, (cid, seen)  # exact to the grid: the neighbours were both asked
        assert len(seen) < 30, cid
        assert report[cid] == {"last_right": last, "first_wrong": first, "requests": len(seen)}, cid
        outcomes[cid] = (last, first)
    return outcomes


def test_response_tokens_sweep_over_multi_turn_cases(scripts, tmp_path):
    """Every step's last tool response grown to x tokens: a case breaks once a turn's request carries the previous
    turn's results past its limit."""
    limits = {"multi_turn_base_0": 700, "multi_turn_base_1": 1900, "multi_turn_base_2": None,
              "multi_turn_base_3": 1200}
    outcomes = _check_sweep(scripts, limits, "response_tokens", "response_tokens", 0, 4000, 100, tmp_path)
    inside = [cid for cid, (last, first) in outcomes.items() if last is not None and first is not None]
    assert len(inside) >= 2, outcomes  # breaking points strictly inside the range, after being right below
    assert outcomes["multi_turn_base_2"] == (4000, None)  # the fake never breaks it: censored


def test_conversation_tokens_sweep_over_multi_turn_cases(scripts, tmp_path):
    """Filler turns before each request's last user message, to x tokens of the request: these cases' catalogs
    already hold thousands, and every turn adds its own history."""
    limits = {"multi_turn_base_0": 13000, "multi_turn_base_1": 15000, "multi_turn_base_2": None,
              "multi_turn_base_3": 12500}
    outcomes = _check_sweep(scripts, limits, "request_tokens", "conversation_tokens", 10000, 20000, 500, tmp_path)
    inside = [cid for cid, (last, first) in outcomes.items() if last is not None and first is not None]
    assert len(inside) >= 2, outcomes
    assert outcomes["multi_turn_base_2"] == (20000, None)
