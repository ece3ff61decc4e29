"""Running `toolquake replay` as its own process, and reading what it recorded: the oracle (a fake upstream
scripted with BFCL's ground truth, a wrong function for every fourth case), the results rows, and the crash test's
random SIGKILLs."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import ROOT
from tests.support.scratch import scratch_file

N_CASES = 20


WRONG_EVERY = 4  # cases 0, 4, 8, ... are answered with a wrong function


def oracle_script(cases: list, wrong: set[str]) -> Path:
    from toolquake.bfcl.convert import openai_name
    from toolquake.scorers.mutations import ground_truth_calls

    lines = []
    for case in cases:
        calls = [{"name": openai_name(c["name"]), "arguments": c["arguments"]} for c in ground_truth_calls(case)]
        if case.id in wrong:
            expected = {c["name"] for c in calls}
            other = next(openai_name(f["name"]) for f in case.functions if openai_name(f["name"]) not in expected)
            calls = [{"name": other, "arguments": calls[0]["arguments"]}]
        lines.append({"match": case.turns[0][-1]["content"], "answer": {"calls": calls}})
    # a longer message first, so that a message that contains another one is matched by its own entry
    lines.sort(key=lambda e: -len(e["match"]))
    path = scratch_file("oracle-", ".jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def replay(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def rows(out: Path) -> list[dict]:
    files = sorted(out.glob("replay*.sqlite"))
    assert files, f"no results file in {out}"
    found = []
    for f in files:
        db = sqlite3.connect(f)
        db.row_factory = sqlite3.Row
        found += [dict(r) for r in db.execute("SELECT * FROM results")]
        db.close()
    return found


def row_counter(db_path: Path, where: str = ""):
    """A function counting the results rows recorded so far (0 while the store does not exist or is locked); `where`
    (an SQL condition written by the test, e.g. "status = 'scored'") counts only the rows that meet it."""
    query = "SELECT COUNT(*) FROM results" + (f" WHERE {where}" if where else "")

    def count() -> int:
        if not db_path.exists():
            return 0
        try:
            db = sqlite3.connect(db_path, timeout=5)
            try:
                return db.execute(query).fetchone()[0]
            finally:
                db.close()
        except sqlite3.OperationalError:
            return 0

    return count


def kill_at_random_points(args: list[str], env: dict[str, str], count, total: int, rng: random.Random, *,
                          rounds: int, max_step: int) -> int:
    """Start the replay `rounds` times and SIGKILL it each time at a random point (after a random number of
    newly recorded rows, 0 = during start-up), stopping while fewer than 2 rows are left; the number of kills."""
    kills = 0
    for _ in range(rounds):
        before = count()
        if before >= total - 2:
            break
        target = before + rng.randint(0, min(max_step, total - before - 2))
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while count() < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(30)
    return kills
