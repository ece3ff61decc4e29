"""`toolquake replay --cases`: your own cases through the real proxy and the fake upstream, under `off`,
`shuffled`, `expanded` (and `no-target-tool`, which needs the case), graded with verdicts this test works
out on its own for the answers it scripted: right, wrong function, wrong value, no call."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.cases import TIME, WEATHER
from tests.support.replay import replay, rows
from tests.support.scratch import scratch_file

pytestmark = pytest.mark.processes

CURRENCY = {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount.",
            "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
                           "required": ["amount", "to"]}}}
DOCS = {"type": "function", "function": {"name": "search_docs", "description": "Search the product docs.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = [WEATHER, TIME, CURRENCY, DOCS]
#: per case: (question, the right call), then how the scripted model answers it
CALLS = [
    ("What is the weather in Paris?", {"name": "get_weather", "arguments": {"city": "Paris"}}),
    ("Time in Tokyo please", {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}),
    ("Convert 20 to EUR", {"name": "convert_currency", "arguments": {"amount": 20, "to": "EUR"}}),
    ("How do I reset my password?", {"name": "search_docs", "arguments": {"query": "reset password"}}),
    ("Weather in Oslo?", {"name": "get_weather", "arguments": {"city": "Oslo"}}),
    ("What time is it in UTC?", {"name": "get_time", "arguments": {"tz": "UTC"}}),
    ("Convert 5 to USD", {"name": "convert_currency", "arguments": {"amount": 5, "to": "USD"}}),
    ("Find the docs about billing", {"name": "search_docs", "arguments": {"query": "billing"}}),
]
KINDS = ("right", "wrong_function", "wrong_value", "no_call")
TEXT = [("Thanks, that is all!", "right"), ("Tell me a joke", "call")]  # expected "no call"


def scripted(call: dict, kind: str) -> dict:
    """The answer the fake model gives for a case expecting `call`."""
    if kind == "right":
        return {"calls": [call]}
    if kind == "wrong_function":
        other = next(t["function"]["name"] for t in TOOLS if t["function"]["name"] != call["name"])
        return {"calls": [{"name": other, "arguments": call["arguments"]}]}
    if kind == "wrong_value":
        args = {k: (v + "-not" if isinstance(v, str) else v + 1) for k, v in call["arguments"].items()}
        return {"calls": [{"name": call["name"], "arguments": args}]}
    return {"text": "I would rather not use a tool."}


def expected_verdict(kind: str, removed: bool = False) -> tuple[bool, str | None]:
    """(valid, taxonomy) of an answer of `kind` to a case expecting a call; `removed`: its tool was taken away,
    so the right answer became no call."""
    if removed:
        return (True, None) if kind == "no_call" else (False, "irrelevance_violation")
    return {"right": (True, None), "wrong_function": (False, "wrong_function"),
            "wrong_value": (False, "wrong_param_value"), "no_call": (False, "wrong_syntax")}[kind]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cases")
    calls, texts, script, truth = [], [], [], {}
    for i, (question, call) in enumerate(CALLS):
        kind = KINDS[i % len(KINDS)]
        cid = f"agent-{i}"
        calls.append({"id": cid, "messages": [{"role": "system", "content": "You are a helpful agent."},
                                               {"role": "user", "content": question}], "tools": TOOLS,
                      "expected": [{"name": call["name"],
                                    "arguments": {k: [v] for k, v in call["arguments"].items()}}]})
        script.append({"match": question, "answer": scripted(call, kind)})
        truth[cid] = ("call", kind)
    for i, (question, kind) in enumerate(TEXT):
        cid = f"chat-{i}"
        texts.append({"id": cid, "category": "smalltalk", "messages": [{"role": "user", "content": question}],
                      "tools": TOOLS, "expected": "no call"})
        answer = {"text": "You are welcome."} if kind == "right" else {"calls": [CALLS[0][1]]}
        script.append({"match": question, "answer": answer})
        truth[cid] = ("no_call", kind)
    (d / "agent.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    (d / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in texts) + "{torn\n")
    script_file = scratch_file("cases-script-", ".jsonl")
    script_file.write_text("".join(json.dumps(s) + "\n" for s in script))
    fake = start_fake_upstream("--script", str(script_file))
    yield fake, d, truth
    fake.stop()


def _check(got: dict, truth: dict, profile: str) -> None:
    for cid, (what, kind) in truth.items():
        x = got[(cid, profile)]
        assert x["status"] == "scored", x
        if what == "no_call":
            assert x["category"] == "smalltalk" and x["expected"] == "irrelevance"
            assert bool(x["valid"]) == (kind == "right"), x
            if kind != "right":
                assert x["taxonomy"] == "irrelevance_violation"
            continue
        valid, taxonomy = expected_verdict(kind)
        assert x["category"] == "agent", x
        assert bool(x["valid"]) == valid and x["taxonomy"] == taxonomy, (cid, kind, x)


@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                    reason="`expanded` needs the embeddings extra (make install-embeddings)")
def test_replay_scores_user_cases_under_off_shuffled_and_expanded(setup, tmp_path):
    fake, d, truth = setup
    out = tmp_path / "run"
    httpx.delete(f"{fake.url}/_fake/requests")
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off,shuffled,expanded", "--cases",
               str(d / "agent.jsonl"), "--cases", str(d / "chat.jsonl"), "--out", str(out),
               "--header", "X-Test-Tag: cases")
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stderr and "chat.jsonl:3: not JSON" in r.stderr  # the bad line, reported and left out
    got = {(x["case_id"], x["profile"]): x for x in rows(out)}
    assert len(got) == 3 * len(truth)
    for profile in ("off", "shuffled", "expanded"):
        _check(got, truth, profile)
    # what the model saw: the case's own tools, in another order under shuffled, 3 more under expanded
    seen = [json.loads(s["body"]) for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "cases"}).json()
            if s["path"] == "/v1/chat/completions"]
    assert len(seen) == 3 * len(truth)
    own = [t["function"]["name"] for t in TOOLS]
    orders = [[t["function"]["name"] for t in b["tools"]] for b in seen]
    assert sum(o == own for o in orders) >= len(truth)  # off
    assert any(sorted(o) == sorted(own) and o != own for o in orders)  # shuffled
    expanded = [o for o in orders if len(o) == len(own) + 3]
    assert len(expanded) == len(truth) and all(set(own) < set(o) for o in expanded)
    # the report shows each file's cases as their own category, accuracy as this test works it out
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", "--format", "json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    arms = json.loads(report.stdout)["arms"]
    right_calls = sum(1 for what, kind in truth.values() if what == "call" and kind == "right")
    n_calls = sum(1 for what, _ in truth.values() if what == "call")
    for profile in ("off", "shuffled", "expanded"):
        cats = arms[profile]["by_category"]
        assert cats["agent"]["n"] == n_calls and cats["agent"]["accuracy"] == pytest.approx(right_calls / n_calls)
        assert cats["smalltalk"]["n"] == 2 and cats["smalltalk"]["accuracy"] == pytest.approx(0.5)
    # rerun: everything is scored already, nothing is sent again
    httpx.delete(f"{fake.url}/_fake/requests")
    again = replay("--backend", f"{fake.url}/v1", "--profiles", "off,shuffled,expanded", "--cases",
                   str(d / "agent.jsonl"), "--cases", str(d / "chat.jsonl"), "--out", str(out),
                   "--header", "X-Test-Tag: cases")
    assert again.returncode == 0, again.stderr
    assert [s for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "cases"}).json()
            if s["method"] == "POST"] == []


def test_perturbers_that_need_the_case_work_on_user_cases(setup, tmp_path):
    """no-target-tool removes the tool the user case expects: the right answer becomes no call."""
    fake, d, truth = setup
    out = tmp_path / "removed"
    httpx.delete(f"{fake.url}/_fake/requests")
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "no-target-tool", "--cases", str(d / "agent.jsonl"),
               "--out", str(out), "--header", "X-Test-Tag: removed")
    assert r.returncode == 0, r.stderr
    got = {x["case_id"]: x for x in rows(out)}
    for i, (_, call) in enumerate(CALLS):
        x = got[f"agent-{i}"]
        kind = truth[f"agent-{i}"][1]
        valid, taxonomy = expected_verdict(kind, removed=True)
        assert x["expected"] == "irrelevance" and bool(x["valid"]) == valid and x["taxonomy"] == taxonomy, x
        assert json.loads(x["perturbers"])["applied"][0]["report"]["removed"] == [call["name"]]
    seen = [json.loads(s["body"]) for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "removed"}).json()
            if s["path"] == "/v1/chat/completions"]
    assert sorted(len(b["tools"]) for b in seen) == [len(TOOLS) - 1] * len(CALLS)


@pytest.mark.needs_corpus
def test_user_cases_mix_with_bfcl_categories_and_split_into_shards(setup, tmp_path):
    fake, d, truth = setup
    base = ["--backend", f"{fake.url}/v1", "--profiles", "off", "--categories", "multiple", "--limit", "2",
            "--cases", str(d / "agent.jsonl"), "--cases", str(d / "chat.jsonl")]
    for i in range(2):
        r = replay(*base, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}"))
        assert r.returncode == 0, r.stderr
    found = [rows(tmp_path / f"s{i}") for i in range(2)]
    ids = [x["case_id"] for part in found for x in part]
    assert len(ids) == len(set(ids)) == 2 + len(truth)
    assert {x["category"] for part in found for x in part} == {"multiple", "agent", "smalltalk"}
    assert all(x["status"] == "scored" for part in found for x in part)
    _check({(x["case_id"], "off"): x for part in found for x in part if x["category"] != "multiple"}, truth, "off")


@pytest.mark.needs_corpus
def test_conversation_lengthening_pads_user_cases_and_keeps_their_verdicts(setup, tmp_path):
    """Earlier turns from corpus cases go before the user case's last user message; the answer (scripted on
    that message) and so the verdict stay the ones `off` gets."""
    fake, d, truth = setup
    config = tmp_path / "long.toml"
    config.write_text('[profiles.long]\nperturbers = [{ name = "conversation_lengthening", params = '
                      '{ budget_tokens = 3000, setting = "structured" } }]\n')
    out = tmp_path / "long"
    httpx.delete(f"{fake.url}/_fake/requests")
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off,long", "--config", str(config), "--cases",
               str(d / "agent.jsonl"), "--out", str(out), "--header", "X-Test-Tag: long")
    assert r.returncode == 0, r.stderr
    got = {(x["case_id"], x["profile"]): x for x in rows(out)}
    _check(got, {k: v for k, v in truth.items() if v[0] == "call"}, "long")
    for (cid, profile), x in got.items():
        if profile == "long":
            assert json.loads(x["perturbers"])["applied"][0]["report"]["turns_added"] > 0
    seen = [json.loads(s["body"]) for s in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "long"}).json()
            if s["path"] == "/v1/chat/completions"]
    lengths = sorted(len(b["messages"]) for b in seen)
    assert lengths[:len(CALLS)] == [2] * len(CALLS) and min(lengths[len(CALLS):]) > 2
