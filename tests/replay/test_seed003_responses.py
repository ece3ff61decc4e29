"""`toolquake replay --profiles @seed003-responses` end to end (issue #17): a scripted model (the fake upstream
playing ground-truth trajectories) behind the in-process proxy, multi_turn_base chosen by the preset, the tool
responses grown with real records, and a case with no response to grow counted as not perturbed."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.multiturn import first_user, load, scripted_turns
from tests.support.report import report_run
from toolquake.bfcl.simulators import Backends
from toolquake.scorers import multiturn as mt

pytestmark = pytest.mark.needs_corpus

# base_0 and base_1 each have steps whose response holds an array (grep, ls); base_2's responses hold none
CASES = ("multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_2")


def test_seed003_responses_replay(backends: Backends, tmp_path: Path) -> None:
    from toolquake.proxy.replay.selection import PRESETS

    script = {first_user(load(c)): scripted_turns(mt.ground_truth_result(load(c), backends)) for c in CASES}
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": k, "turns": v}) + "\n" for k, v in script.items()))
    fake = start_fake_upstream("--trajectories", str(path))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "toolquake", "replay", "--backend", f"{fake.url}/v1", "--limit", str(len(CASES)),
             "--profiles", "@seed003-responses", "--out", str(tmp_path / "out")],
            cwd=ROOT, capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        sent = [json.loads(r["body"]) for r in httpx.get(f"{fake.url}/_fake/requests", timeout=60).json()
                if r["path"].endswith("/chat/completions")]
        # the budget is in the tokens of the backend's tokenizer (the replay's token counter is 'auto'): ask it
        contents = {m["content"] for r in sent for m in r["messages"] if m["role"] == "tool"}
        tokens = {c: httpx.post(f"{fake.url}/tokenize", json={"prompt": c}, timeout=60).json()["count"]
                  for c in contents}
    finally:
        fake.stop()
    profiles = ["off"] + [f"resp-{k}k-p1" for k in (10, 20, 40)] + [f"resp-80k-p{p}" for p in range(1, 9)]
    assert PRESETS["seed003-responses"] == ["off", "resp-*"]
    db = sqlite3.connect(tmp_path / "out" / "replay.sqlite")
    rows = db.execute("SELECT case_id, profile, status, valid, perturbers FROM results").fetchall()
    assert sorted({r[1] for r in rows}) == sorted(profiles), "the preset's twelve arms"
    assert sorted({r[0] for r in rows}) == sorted(CASES), "multi_turn_base, chosen by the preset"
    assert all(r[2] == "scored" and r[3] == 1 for r in rows), [r[:4] for r in rows if r[3] != 1]
    for case_id, profile, _, _, perturbers in rows:
        kept = json.loads(perturbers).get("not_perturbed")
        if profile == "off" or case_id != "multi_turn_base_2":
            assert kept is None, (case_id, profile, kept)
        else:
            assert kept, (case_id, profile)
    # the tool responses sent upstream reach each budget, in tokens of that response alone (within 2 %)
    for k in (10_000, 20_000, 40_000, 80_000):
        assert any(abs(t - k) <= 0.02 * k for t in tokens.values()), (k, sorted(tokens.values())[-20:])
    assert max(tokens.values()) <= 1.02 * 80_000
    report = report_run(str(tmp_path / "out"), "--format", "json", "--no-plots")
    assert report.returncode == 0, report.stderr[-2000:]
    arms = next(iter(json.loads(report.stdout)["models"].values()))["arms"]
    assert arms["off"]["not_perturbed"] == 0
    for profile in profiles[1:]:
        assert arms[profile]["not_perturbed"] == 1, (profile, arms[profile])
        assert arms[profile]["by_category"]["multi_turn_base"]["accuracy"] == 1.0
