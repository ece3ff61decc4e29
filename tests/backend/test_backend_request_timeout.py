"""`toolquake backend local --request-timeout` (#45, item 7): a request that holds a model instance past it is cut,
answered with an OpenAI-shaped 504 `timeout` (a stream: an error event, then the end), and the instance goes to
the next request, which was waiting for it.

Without the model: the real CLI and HTTP server over loopback, with a stand-in for llama-cpp-python's `Llama`
first on the server's PYTHONPATH (tests/backend/stand_in: one token every 50 ms, so a 2,000-token answer would
hold the only instance for 100 s). With the model (`make install-local`): the same cut on SmolLM2-135M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from tests.support import ROOT, Proc, start_process
from tests.support.backend import STAND_IN_MODEL, needs_model, stand_in_env

pytestmark = pytest.mark.processes

REQUEST_TIMEOUT = 2.0
LONG = 2000  # tokens: 100 s of the stand-in's
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def backend() -> Iterator[Proc]:
    proc = start_process(["-m", "toolquake", "backend", "local", "--port", "0", "--max-tokens", str(LONG),
                          "--model-path", str(STAND_IN_MODEL), "--request-timeout", str(REQUEST_TIMEOUT)],
                         None, "/healthz", env=stand_in_env(), timeout=120)
    yield proc
    proc.stop()


def events(lines: Iterator[str], most: int) -> Iterator[dict[str, Any]]:
    """The stream's data payloads, at most `most` of them (a stream that is never cut ends the test)."""
    n = 0
    for line in lines:
        if line.startswith("data: {"):
            n += 1
            assert n <= most, f"still streaming after {most} events: not cut"
            yield json.loads(line[len("data: "):])


def timed_out(body: dict[str, Any]) -> None:
    assert body["error"]["code"] == "timeout" and body["error"]["type"] == "server_error", body
    assert "--request-timeout" in body["error"]["message"]


def test_a_stream_past_the_request_timeout_is_cut_and_the_waiting_request_gets_the_model(backend):
    url = f"{backend.url}/v1/chat/completions"
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool, http.stream(
            "POST", url, json={"model": "m", "messages": USER, "stream": True}) as stream:
        assert stream.status_code == 200
        got = events(stream.iter_lines(), 400)  # 20 s of tokens; cut after about 40
        for event in got:  # up to the first token: this request holds the only model instance now
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                break
        waiting = pool.submit(httpx.post, url, json={"model": "m", "messages": USER, "max_tokens": 3}, timeout=60)
        rest = list(got)
        second = waiting.result(60)
    tokens = sum(1 for e in rest if e.get("choices") and e["choices"][0]["delta"].get("content"))
    assert 0 < tokens < LONG - 1
    timed_out(rest[-1])  # the stream's last event says why it ended; no [DONE] after it
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"] == "tok tok tok "


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "m", "messages": USER}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
], ids=["chat", "responses"])
def test_an_answer_past_the_request_timeout_gets_a_504_and_the_server_serves_on(backend, path, body):
    r = httpx.post(f"{backend.url}{path}", json=body, timeout=60)
    assert r.status_code == 504, r.text
    timed_out(r.json())
    short = {**body, "max_output_tokens" if "input" in body else "max_tokens": 2}
    r = httpx.post(f"{backend.url}{path}", json=short, timeout=60)
    assert r.status_code == 200, r.text


def test_the_request_timeout_flag_has_a_documented_default():
    out = subprocess.run([sys.executable, "-m", "toolquake", "backend", "local", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--request-timeout" in text and "(default 120)" in text.split("--request-timeout", 2)[-1]
    assert "| `--request-timeout` | 120 s |" in (ROOT / "docs" / "backend.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "toolquake", "backend", "local", "--request-timeout", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "--request-timeout" in bad.stderr


@pytest.mark.slow
@pytest.mark.model
@needs_model
def test_the_real_model_is_cut_at_the_request_timeout_and_serves_the_next_request():
    from toolquake.proxy.backend.local import LocalBackend

    count = [{"role": "user", "content": "Count from 1 to 2000, one number per line, and say nothing else."}]
    with LocalBackend(n_ctx=4096, max_tokens=3000, request_timeout=5.0) as b:
        r = httpx.post(f"{b.api_url}/chat/completions", json={"model": b.model, "messages": count}, timeout=120)
        assert r.status_code == 504, r.text[:500]
        timed_out(r.json())
        r = httpx.post(f"{b.api_url}/chat/completions", json={"model": b.model, "messages": USER, "max_tokens": 4},
                       timeout=120)
        assert r.status_code == 200, r.text
