"""The conformance checker on the embedded backend (the real SmolLM2-135M model): its well-formed answers
break no rule, checked by the probe (`toolquake conformance`) and on the proxy's relay path.

A handful of requests (the model is slow on CPU): two probes × 2 APIs × streamed or not, then two streams
through the proxy.
"""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.support import ROOT, metric_value, metrics_text, start_proxy, wait_for
from tests.support.backend import MODEL
from tests.support.conformance import rule_rows
from toolquake.proxy.server.conformance import RULES

pytestmark = [pytest.mark.slow, *MODEL]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def backend():
    from toolquake.proxy.backend.local import LocalBackend

    with LocalBackend(n_ctx=2048, max_tokens=64) as b:
        yield b


def test_the_probe_finds_no_violation_on_the_embedded_backend(backend):
    out = subprocess.run([sys.executable, "-m", "toolquake", "conformance", "--backend", backend.api_url,
                          "--probe", "single", "--probe", "parameterless", "--max-tokens", "64"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    answered = re.findall(r"^\| (single|parameterless) \| (chat_completions|responses) \| (yes|no) \| ok \| – \|$",
                          out.stdout, re.M)
    assert len(set(answered)) == 8, out.stdout
    rules = rule_rows(out.stdout)
    assert set(rules) == set(RULES) and all(result == "ok" for result, _ in rules.values())


def test_streams_relayed_from_the_embedded_backend_break_no_rule(backend, tmp_path):
    config = f'[server]\nmodel_allowlist = ["smollm2"]\n[scoring]\nstore = "{tmp_path}/r.sqlite"\n'
    proxy = start_proxy(backend.url, config)
    try:
        with httpx.Client(base_url=proxy.url, timeout=300) as client:
            chat = {"model": "smollm2", "stream": True, "max_tokens": 48, "temperature": 0, "tool_choice": "required",
                    "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
            with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                assert r.status_code == 200 and b"[DONE]" in r.read() and b"get_weather" in r.read()
            resp = {"model": "smollm2", "stream": True, "max_output_tokens": 48, "temperature": 0,
                    "tool_choice": "required", "input": "Weather in Oslo?",
                    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}
            with client.stream("POST", "/v1/responses", json=resp) as r:
                assert r.status_code == 200 and b"response.completed" in r.read()

        def both_checked() -> str | None:  # the check runs after the last byte: both answers checked
            metrics = metrics_text(proxy)
            return metrics if metric_value(metrics, "toolquake_conformance_checks_total") >= 2 else None

        metrics = wait_for(both_checked, 10, "both answers to be checked")
        assert metric_value(metrics, "toolquake_conformance_checks_total") == 2
        assert "toolquake_conformance_violations_total{" not in metrics, metrics
        assert "toolquake_conformance_check_failures_total{" not in metrics
    finally:
        proxy.stop()
