"""A live `/metrics` scrape of a running proxy, after traffic that fills every kind of series, passes
`promtool check metrics` (Prometheus' own parser and linter), as the PodMonitor and the compose
Prometheus will scrape it."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from tests.support import Proc

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: `make tools` installs it (Debian package prometheus)")
    return path


def check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.processes
def test_promtool_rejects_badly_named_and_malformed_metrics() -> None:
    lint = check_metrics("# HELP jobs_count Jobs.\n# TYPE jobs_count counter\njobs_count 1\n")
    assert lint.returncode != 0 and "_total" in lint.stdout + lint.stderr
    assert check_metrics('jobs{kind="a" 1\n').returncode != 0


def test_live_metrics_scrape_passes_promtool(proxy: Proc) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": TOOLS}
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.post("/p/reversed/v1/chat/completions", json=body).status_code == 200
        with client.stream("POST", "/p/shuffled/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert b"[DONE]" in r.read()
        assert client.post("/p/no-such-profile/v1/chat/completions", json=body).status_code == 404
        failed = client.post("/v1/chat/completions", json=body, headers={"X-Fake-Fault": "status:500"})
        assert failed.status_code == 500
        assert client.get("/v1/models").status_code == 200
        scrape = client.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    text = scrape.text
    for series in ("toolquake_requests_total", "toolquake_request_duration_seconds_bucket",
                   "toolquake_perturbations_total", "toolquake_in_flight_requests"):
        assert series in text, f"{series} missing from the scrape"
    out = check_metrics(text)
    assert out.returncode == 0, json.dumps({"stdout": out.stdout, "stderr": out.stderr})
    assert out.stdout.strip() == "", out.stdout
