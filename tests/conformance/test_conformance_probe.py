"""`toolquake conformance --backend URL` against the fake upstream: a backend without faults passes every
rule (exit 0); one with known faults gets them in the table, where they are, and exit 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.conformance import rule_rows
from tests.support.ports import refusing_url

pytestmark = pytest.mark.processes


def probe(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolquake", "conformance", "--backend", url, *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """A fake backend whose answer to the single-call probe leaves the call in the text (Hermes tags)."""
    script = tmp_path_factory.mktemp("probe") / "script.jsonl"
    script.write_text(json.dumps({"match": "weather in Paris?", "answer": {
        "text": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}}) + "\n")
    proc = start_fake_upstream("--script", str(script))
    yield proc
    proc.stop()


def test_a_backend_without_faults_passes_every_rule(fake_upstream):
    from toolquake.proxy.server.conformance import RULES

    out = probe(fake_upstream.url + "/v1")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = rule_rows(out.stdout)
    assert set(rows) == set(RULES)
    assert all(result == "ok" for result, _ in rows.values())
    assert out.stdout.count("| ok | – |") == 16 + len(RULES)  # 4 probes × 2 APIs × streamed or not, each rule


def test_a_backend_with_known_faults_gets_them_in_the_table_and_exit_1(faulty):
    from toolquake.proxy.cli.conformance import PROBES

    out = probe(faulty.url, "--header", "X-Fake-Broken: no-index,finish-stop")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = rule_rows(out.stdout)
    # no-index breaks chat streams only, finish-stop every chat answer with calls; the single probe's call is text
    chat_stream = [f"{p}/chat/stream" for p in sorted(PROBES) if p != "single"]
    assert rows["delta_missing_index"] == (f"FAIL ({len(chat_stream)})", ", ".join(chat_stream))
    chat = sorted(f"{p}/chat/{s}" for p in PROBES if p != "single" for s in ("plain", "stream"))
    assert rows["finish_reason_not_tool_calls"] == (f"FAIL ({len(chat)})", ", ".join(chat))
    hermes = sorted(f"single/{api}/{s}" for api in ("chat", "responses") for s in ("plain", "stream"))
    assert rows["call_in_content_hermes"] == ("FAIL (4)", ", ".join(hermes))
    broken = {"delta_missing_index", "finish_reason_not_tool_calls", "call_in_content_hermes"}
    assert all(result == "ok" for rule, (result, _) in rows.items() if rule not in broken)
    assert "| single | responses | yes | 1 violation(s) | call_in_content_hermes |" in out.stdout


def test_an_unreachable_backend_exits_2():
    with refusing_url() as nobody:  # bound, never listened on: the connection is refused
        out = probe(f"{nobody}/v1", "--model", "m", "--timeout", "2")
    assert out.returncode == 2
    assert "error: ConnectError" in out.stdout
