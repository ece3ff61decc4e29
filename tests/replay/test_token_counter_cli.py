"""`--token-counter tiktoken:<encoding>` through the CLI: a padding replay against the fake upstream whose requests,
as the backend received them, are counted here with tiktoken's own encoding; the counter named in the results file
and the report; clear errors for a counter that cannot be made."""

from __future__ import annotations

import importlib.util
import json
import sqlite3

import httpx
import pytest

from tests.support import start_fake_upstream
from tests.support.replay import replay
from tests.support.tokens import tiktoken_files as _tiktoken_files
from tests.support.tokens import tiktokens_own as _tiktokens_own
from toolquake.perturbers.helpers.tokens import MESSAGE_OVERHEAD, render_request

pytestmark = pytest.mark.processes


@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_replay_pads_to_budgets_counted_in_the_named_openai_encoding(tmp_path, monkeypatch) -> None:
    from tests.support.report import report_text as report
    from toolquake.bfcl.corpus import is_present

    if not is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    folder = _tiktoken_files()
    own = _tiktokens_own("o200k_base", folder, tmp_path, monkeypatch)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    config = tmp_path / "config.toml"
    config.write_text('[profiles.pad-3000]\nmode = "perturb"\nperturbers = [{ name = "catalog_padding", '
                      'params = { budget_tokens = 3000, position = 0.5 } }]\n')
    fake = start_fake_upstream()
    try:
        r = replay("--backend", f"{fake.url}/v1", "--profiles", "pad-3000", "--config", str(config),
                   "--categories", "simple_python", "--limit", "3", "--token-counter", "tiktoken:o200k_base",
                   "--out", str(tmp_path / "out"))
        assert r.returncode == 0, r.stderr[-2000:]
        received = [json.loads(x["body"]) for x in httpx.get(f"{fake.url}/_fake/requests").json()
                    if x["path"].endswith("/chat/completions")]
    finally:
        fake.stop()
    assert len(received) == 3
    counted = []
    for body in received:
        n_messages = len(body["messages"])
        tokens = len(own.encode(render_request(body), disallowed_special=())) + MESSAGE_OVERHEAD * n_messages
        # within one pool tool (about 130 tokens here) of the budget: padding adds whole tools
        assert abs(tokens - 3000) <= 0.05 * 3000, tokens
        counted.append((len(body["tools"]), tokens))
    db = sqlite3.connect(tmp_path / "out" / "replay.sqlite")
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    reports = [json.loads(p)["applied"][0]["report"] for (p,) in db.execute("SELECT perturbers FROM results")]
    db.close()
    # what the proxy reported reaching is what the backend received, by tiktoken's own count
    assert sorted(counted) == sorted((rep["tools_after"], rep["tokens_after"]) for rep in reports)
    assert meta["token_counter"] == "tiktoken:o200k_base"
    assert {rep["token_counter"] for rep in reports} == {"tiktoken:o200k_base"}
    got = json.loads(report(tmp_path / "out", "--format", "json"))
    (model,) = got["models"]
    assert got["padding"][model]["pad-3000"]["token_counter"] == {"tiktoken:o200k_base": 3}


@pytest.mark.skipif(importlib.util.find_spec("litellm") is not None,
                    reason="litellm is installed here: its copies of the encoding files are always found")
def test_replay_with_a_counter_it_cannot_make_says_why_and_how(tmp_path) -> None:
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps({"id": "thanks", "messages": [{"role": "user", "content": "Thanks!"}], "tools": [],
                                 "expected": "no call"}) + "\n")
    fake = start_fake_upstream()
    try:
        r = replay("--backend", f"{fake.url}/v1", "--profiles", "off", "--cases", str(cases), "--token-counter",
                   "tiktoken:o200k_base", "--out", str(tmp_path / "out"), env={"TOOLQUAKE_CACHE": str(tmp_path),
                                                                              "TIKTOKEN_CACHE_DIR": str(tmp_path)})
        assert r.returncode == 2, r.stderr
        assert "make tiktoken-files" in r.stderr and "o200k_base.tiktoken" in r.stderr
        r = replay("--backend", f"{fake.url}/v1", "--profiles", "off", "--cases", str(cases), "--token-counter",
                   f"tiktoken:{tmp_path / 'nothing.tiktoken'}", "--out", str(tmp_path / "out2"))
        assert r.returncode == 2 and "neither a known encoding" in r.stderr, r.stderr
    finally:
        fake.stop()


def test_serve_refuses_a_tokenizer_it_cannot_load_with_the_reason(tmp_path) -> None:
    import subprocess
    import sys

    from tests.support import ROOT

    for spec, says in ((f"tiktoken:{tmp_path / 'none.tiktoken'}", "neither a known encoding"),
                       (f"tokenizer:{tmp_path / 'none.json'}", "tokenizer file not found")):
        r = subprocess.run([sys.executable, "-m", "toolquake", "serve", "--token-counter", spec, "--port", "0",
                            "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
