"""`make agent-demo`'s flow (scripts/agent_demo.py) with the example agent (examples/agent/) against the fake upstream.

The fake plays the model from scripts: for each task, a call to the task's tool with the task's arguments, then
(after the tool's result) a text carrying the task's fact (`--trajectories`); a request with 6 tools or more —
the agent has 5, so a profile that adds one — gets a text with no call instead (`--breaking`, measure `tools`).
The demo runs for real: `toolquake serve --record` and `toolquake serve --cases` as child processes, the agent's
frameworks (the Agents SDK on both APIs, LangGraph) through them, `toolquake cases from-recording`. Each step is
checked: what was recorded, the cases made from it, the perturbed runs as the upstream saw them, the verdicts in
the results store, the numbers in summary.json.
"""

from __future__ import annotations

import json
import os
import sqlite3

import httpx
import pytest

from examples.agent.tasks import TASKS
from scripts.agent_demo import Demo
from tests.support import ORPHAN_MARK, marked_processes, start_fake_upstream

pytestmark = pytest.mark.processes

PROFILES = ["off", "shuffled", "fail-timeout", "meta-namespace-twin"]
TOOLS = ["get_weather", "convert_currency", "list_events", "convert_units", "search_notes"]


def call(task) -> dict:
    return {"name": task.tool, "arguments": {k: v[0] for k, v in task.arguments.items()}}


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    trajectories, breaking = folder / "trajectories.jsonl", folder / "breaking.jsonl"
    trajectories.write_text("".join(json.dumps({"first_user": t.prompt, "turns": [[
        {"calls": [call(t)]}, {"text": f"Here it is: {t.fact}."}]]}) + "\n" for t in TASKS))
    breaking.write_text("".join(json.dumps({"first_user": t.prompt, "measure": "tools", "wrong": [[6, None]]}) + "\n"
                                for t in TASKS))
    proc = start_fake_upstream("--trajectories", str(trajectories), "--breaking", str(breaking))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def demo(fake, tmp_path_factory):
    said: list[str] = []
    d = Demo(upstream=f"{fake.url}/v1", model="fake-model", out=tmp_path_factory.mktemp("agent-demo") / "out",
             profiles=PROFILES, tasks=TASKS, say=said.append)
    summary = d.run()
    return d, summary, "\n".join(said)


def test_no_proxy_the_demo_started_outlives_it(demo):
    d, _, said = demo
    # the demo's proxies are the ones that name its output folder (--record, --cases); other tests of this session
    # (another xdist worker) have proxies of their own running meanwhile
    assert str(d.out) in said
    left = marked_processes(f"{ORPHAN_MARK}={os.environ[ORPHAN_MARK]}".encode())
    assert not [cmd for cmd in left.values() if "toolquake serve" in cmd and str(d.out) in cmd], left


def test_the_unperturbed_run_is_recorded_by_serve_record(demo):
    d, summary, _ = demo
    assert [r["task"] for r in summary["recorded"]] == [t.id for t in TASKS]
    assert all(r["completed"] and r["calls"] == [[call(t)["name"], call(t)["arguments"]]]
               for r, t in zip(summary["recorded"], TASKS)), summary["recorded"]
    lines = d.recording.read_text().splitlines()
    assert json.loads(lines[0]).get("toolquake_recording") == 1  # the recorder's own file, header first
    records = [json.loads(line) for line in lines[1:]]
    # two model turns per task (the call, then the answer after the tool's result), on both APIs
    assert len(records) == 2 * len(TASKS)
    assert {r["route"] for r in records} == {"chat_completions", "responses"}
    assert all(r["profile"] == "off" for r in records)


def test_the_recording_becomes_one_case_per_step_printed_for_review(demo):
    d, _, said = demo
    cases = [json.loads(line) for line in d.cases.read_text().splitlines()]
    assert len(cases) == 2 * len(TASKS)
    assert all(c["category"] == "agent" and c["id"] in said for c in cases)
    first_turns = {c["messages"][-1]["content"]: c for c in cases if c["messages"][-1]["role"] == "user"}
    for t in TASKS:  # the first turn expects the task's call, its arguments as recorded
        expected = first_turns[t.prompt]["expected"]
        assert expected == [{"name": t.tool, "arguments": {k: [v[0]] for k, v in t.arguments.items()}}], expected
        assert sorted((x.get("function") or x)["name"] for x in first_turns[t.prompt]["tools"]) == sorted(TOOLS)
    # the second turn (after the tool's result) answered in text: "no call"
    assert sum(c["expected"] == "no call" and c["messages"][-1]["role"] == "tool" for c in cases) == len(TASKS)
    assert f"{2 * len(TASKS)} good case(s), 0 bad line(s)" in said  # `toolquake cases validate`


def test_every_profile_is_scored_against_the_recorded_cases(demo):
    d, summary, _ = demo
    p = summary["profiles"]
    assert list(p) == PROFILES
    db = sqlite3.connect(d.db)
    rows = db.execute("SELECT profile, valid, resolved_by, perturbers FROM results").fetchall()
    db.close()
    assert all(r[2] == "content" for r in rows)  # tied to the cases by the conversation, no header
    for name in ("off", "shuffled", "fail-timeout"):  # the fake's answers do not depend on these changes
        assert p[name]["requests"] == p[name]["scored"] == 2 * len(TASKS), (name, p[name])
        assert p[name]["accuracy"] == 1.0 and p[name]["tasks_completed"] == len(TASKS), (name, p[name])
    applied = {r[0]: {s["name"] for s in json.loads(r[3])} for r in rows if json.loads(r[3])}
    assert applied == {"shuffled": {"tool_order"}, "fail-timeout": {"tool_failure"},
                       "meta-namespace-twin": {"tool_metadata"}}
    # a sixth tool: the fake answers in text, the agents stop without a call; every first turn is scored invalid
    twin = p["meta-namespace-twin"]
    assert twin["scored"] == len(TASKS) and twin["accuracy"] == 0.0 and twin["tasks_completed"] == 0
    assert twin["drop_vs_off"] == -1.0 and twin["valid_to_invalid"] == len(TASKS) and twin["mcnemar_p"] < 0.05
    assert twin["errors"] == {"wrong_syntax": len(TASKS)}  # a text where a call was expected


def test_recovery_after_the_failing_tool_is_judged_on_every_task(demo):
    _, summary, _ = demo
    timeout = summary["profiles"]["fail-timeout"]
    # each task's tool result replaced by a timeout; the fake's answer states the fact anyway: never recovered
    assert timeout["after_failing_tool"] == len(TASKS) and timeout["recovered"] == 0
    assert all(summary["profiles"][n]["after_failing_tool"] == 0 for n in PROFILES if n != "fail-timeout")


def test_summary_json_and_the_report_account_for_every_task(demo):
    d, summary, said = demo
    written = json.loads((d.out / "summary.json").read_text())
    assert written["profiles"].keys() == set(PROFILES)
    for name, p in written["profiles"].items():
        assert {"tasks", "tasks_completed", "scored", "accuracy", "drop_vs_off"} <= p.keys()
        assert p["tasks"] == len(TASKS) and [r["task"] for r in p["runs"]] == [t.id for t in TASKS]
        assert p["crashes"] == 0 and p["added_tool_calls"] == 0
    assert written["profiles"]["off"]["drop_vs_off"] == 0.0
    report, html = (d.out / "report.md").read_text(), (d.out / "report.html").read_text()
    assert all(f"| {name} |" in report and name in html for name in PROFILES)
    table = said[said.index("4) per profile"):]
    assert all(f"\n{name} " in table for name in PROFILES) and "tasks completed" in table


def test_calls_to_added_tools_are_read_from_the_proxys_metrics(proxy_factory):
    """The table's added-tool calls: the proxy's own counter, read per profile as the demo reads it."""
    from openai import OpenAI

    from scripts.agent_demo import by_profile

    proxy = proxy_factory('[server]\nplugins = ["tests.plugins.adds_tool"]\n\n'
                          '[profiles.invented]\nperturbers = [{ name = "test_adds_tool" }]\n')
    client = OpenAI(base_url=f"{proxy.url}/p/invented/v1", api_key="sk-test", max_retries=0)
    # the fake calls the tool the proxy added; the proxy answers that call itself, then the fake calls get_weather
    answer = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        extra_headers={"x-fake-call-foreign": "get_weather"})
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["get_weather"]
    page = httpx.get(f"{proxy.url}/metrics").text
    assert by_profile(page, "toolquake_injected_tool_calls_total") == {"invented": 1}
    assert by_profile(page, "toolquake_requests_total").get("invented") == 1
