"""`toolquake sweep` as its own process against the fake upstream as a model whose breaking point is known
(`--breaking`: right exactly up to a hidden tool count, or response size, per case): the cases and breaking files,
the hidden breaking points of the tools axis, the command, and what a sweep stored."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT
from tests.support.scratch import scratch_file

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


def user_text(case_id: str) -> str:
    return f"[{case_id}] What is the weather in Paris?"


def cases_file(ids: list[str], tool_message: bool = False) -> Path:
    lines = []
    for cid in ids:
        messages: list[dict] = [{"role": "user", "content": user_text(cid)}]
        if tool_message:  # a conversation whose last tool response the response_tokens axis grows
            records = [{"id": i, "city": c, "temp_c": t} for i, (c, t) in enumerate([("Lyon", 11), ("Nice", 17)])]
            messages = [{"role": "user", "content": "Weather records for France, please."},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "list_weather", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"records": records})},
                        {"role": "user", "content": user_text(cid)}]
        lines.append({"id": cid, "category": "sweepfake", "messages": messages, "tools": [TOOL],
                      "expected": [{"name": "get_weather", "arguments": {"city": ["Paris"]}}]})
    path = scratch_file("sweep-cases-", ".jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def breaking_file(hidden: dict[str, list], measure: str, *more: tuple[dict[str, list], str]) -> Path:
    """The fake's `--breaking` file: each case of `hidden` wrong on its intervals of `measure` (and so for each
    further (hidden, measure) pair: one fake for cases broken along several measures)."""
    path = scratch_file("breaking-", ".jsonl")
    path.write_text("".join(json.dumps({"match": f"[{cid}]", "answer": RIGHT, "measure": m, "wrong": wrong}) + "\n"
                            for h, m in ((hidden, measure), *more) for cid, wrong in h.items()))
    return path


def is_wrong(x: float, wrong: list) -> bool:
    return any(lo <= x and (hi is None or x <= hi) for lo, hi in wrong)


def sweep(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_command(*args), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)


def sweep_command(*args: str) -> list[str]:
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


def first_wrong(points: dict[float, bool]) -> float | None:
    return min((x for x, ok in points.items() if not ok), default=None)
