"""Secrets sent through every path (success, upstream errors, proxy errors, shadow twins, replay,
content logging off and on) never appear in logs, metrics, the results store or reports."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, metric_value, scraped, wait_for
from tests.support.chat import body
from toolquake.proxy.live.results import read_rows

SHADOW_CONFIG = """
[server]
log_contents = {log_contents}
[scoring]
store = "{store}"
store_contents = true
[profiles.shadowed]
mode = "shadow"
sample_rate = 1.0
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
[profiles.reversed]
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
"""


def traffic(url: str, secret: str) -> None:
    auth = {"authorization": f"Bearer {secret}", "api-key": secret, "x-api-key": secret}
    for path in ("/v1", "/p/reversed/v1", "/p/shadowed/v1"):
        for stream in (False, True):
            httpx.post(f"{url}{path}/chat/completions", json=body(stream=stream), headers=auth)
            httpx.post(f"{url}{path}/chat/completions", json=body(stream=stream),
                       headers={**auth, "x-fake-fault": "status:500"})
    httpx.post(f"{url}/v1/chat/completions", content=b"{broken", headers=auth)
    httpx.post(f"{url}/p/missing/v1/chat/completions", json=body(), headers=auth)
    httpx.get(f"{url}/v1/models", headers=auth)
    httpx.get(f"{url}/admin/profiles", headers=auth)


@pytest.mark.parametrize("log_contents", ["false", "true"])
def test_secrets_never_leave_the_request(tmp_path, proxy_factory, log_contents):
    secret = f"sk-secret-{uuid.uuid4().hex}"
    store = tmp_path / "results.sqlite"
    p = proxy_factory(SHADOW_CONFIG.format(log_contents=log_contents, store=store),
                      {"TOOLQUAKE_ADMIN_TOKEN": "admin-" + uuid.uuid4().hex})
    traffic(p.url, secret)
    # shadow twins and scoring run after the answers: wait until the twins of the two answered shadowed requests
    # were compared with their originals (then their rows are written; the proxy's stop drains what is queued)
    wait_for(lambda: scraped(p, "toolquake_consistency_total", profile="shadowed") >= 2, 60,
             "the shadow twins compared")
    metrics = httpx.get(f"{p.url}/metrics").text
    assert metric_value(metrics, "toolquake_shadow_requests_total") >= 2  # the twins really ran, with the auth
    p.stop()
    assert len(read_rows(store)) >= 2  # the twins' rows (with contents) are in the store looked at below
    logs = p.output()
    assert "request" in logs  # there are log lines to look at
    if log_contents == "true":
        assert "Paris" in logs  # contents are logged when asked; secrets still are not
    assert secret not in logs
    assert secret not in metrics
    for f in tmp_path.iterdir():
        assert secret.encode() not in f.read_bytes(), f
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", "--db", str(store), "--format", "json"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert secret not in report.stdout + report.stderr


@pytest.mark.needs_corpus
def test_replay_keeps_the_api_key_out_of_its_results(tmp_path, fake_upstream):
    secret = f"sk-replay-{uuid.uuid4().hex}"
    out = tmp_path / "replay"
    done = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--backend", f"{fake_upstream.url}/v1",
                           "--profiles", "off,reversed", "--categories", "simple_python", "--limit", "3",
                           "--out", str(out), "--api-key", secret, "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = httpx.get(f"{fake_upstream.url}/_fake/requests").json()
    assert any(r["headers"].get("authorization") == f"Bearer {secret}" for r in seen)  # it was used
    assert secret not in done.stdout + done.stderr
    for f in Path(out).rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    for fmt in ("md", "json", "csv", "html"):
        report = subprocess.run([sys.executable, "-m", "toolquake", "report", str(out), "--format", fmt, "--no-plots"],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert report.returncode == 0, report.stderr[-1000:]
        assert secret not in report.stdout + report.stderr
