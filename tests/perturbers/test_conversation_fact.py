"""conversation_lengthening with `fact` (seed 003 challenge 3, settings 1 and 2; issue #17 item 4): on real BFCL
multi-turn steps (ground-truth runs through the agent loop and the simulators), every property is computed from
the perturbed requests themselves and the case's ground truth; then live through the proxy with the `openai` SDK,
and a replay whose conversations have no step to perturb."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import ROOT, recorded, start_fake_upstream
from tests.support.multiturn_steps import perturb, step_requests
from toolquake.perturbers.helpers.tokens import EstimateCounter

N_CASES = 30
BUDGETS = (10_000, 20_000, 40_000, 80_000)
SETTINGS = [("user_turn", "unstructured", "user"), ("tool_response", "structured", "tool")]
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


N_MISS_FUNC = 4


@pytest.fixture(scope="module")
def runs(backends: Any) -> dict[str, list[dict[str, Any]]]:
    """{case id: the requests of its ground-truth run} for the first N_CASES multi_turn_base and the first
    N_MISS_FUNC multi_turn_miss_func cases (a category at a time: the two share first user messages, which is what
    the fake upstream tells trajectories apart by)."""
    from toolquake.bfcl.corpus import load_category

    return {**step_requests(list(load_category("multi_turn_base"))[:N_CASES], backends),
            **step_requests(list(load_category("multi_turn_miss_func"))[:N_MISS_FUNC], backends)}


@pytest.fixture(scope="module")
def steps(runs: dict[str, list[dict[str, Any]]]) -> list[tuple[Any, dict[str, Any]]]:
    """(case, request) of every step of the ground-truth runs of the first N_CASES multi_turn_base cases."""
    from toolquake.bfcl.corpus import load_category

    return [(c, b) for c in list(load_category("multi_turn_base"))[:N_CASES] for b in runs[c.id]]


def text_of(m: dict[str, Any]) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else ""


def holds(text: str, value: Any) -> bool:
    """The test's own reading of "the text holds the value": strings case-insensitively, numbers by value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) in {float(x) for x in _NUM.findall(text)}
    low = text.lower()
    if value.lower() in low:
        return True
    try:  # a JSON tool result writes some characters escaped: read its strings too
        decoded = json.loads(text)
    except ValueError:
        return False
    return any(isinstance(x, str) and value.lower() in x.lower() for x in scalars(decoded))


def scalars(v: Any) -> list[Any]:
    """The leaves of a value (lists and objects walked), trimmed strings, numbers, no booleans or blanks."""
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in scalars(item)]
    if isinstance(v, dict):
        return scalars(list(v.values()))
    if isinstance(v, str) and v.strip():
        return [v.strip()]
    return [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else []


def turn_values(case: Any, body: dict[str, Any]) -> list[Any]:
    """Scalar argument values of the ground-truth calls of the turn this request is at (multi_turn_base has one
    user message per turn and no held-out functions)."""
    from toolquake.bfcl.simulators import parse_call

    turn = sum(1 for m in body["messages"] if m["role"] == "user") - 1
    calls = [parse_call(text) for text in case.ground_truth[turn]]
    return scalars([[*c.args, *c.kwargs.values()] for c in calls])


def inserted(body: dict[str, Any], out: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Where the perturbed request's added messages start and what they are: out = body[:k] + added + body[k:]."""
    a, b = body["messages"], out["messages"]
    extra = len(b) - len(a)
    k = 0
    while k < len(a) and a[k] == b[k]:
        k += 1
    assert b[k + extra:] == a[k:], "the request's own messages keep their order, with one block added"
    return k, b[k:k + extra]


def repeats(messages: list[dict[str, Any]]) -> int:
    """How many user or assistant messages directly follow one of their own role."""
    roles = [m["role"] for m in messages]
    return sum(a == b and a in ("user", "assistant") for a, b in zip(roles, roles[1:]))


@pytest.mark.needs_corpus
@pytest.mark.parametrize("fact,setting,role", SETTINGS)
def test_the_fact_precedes_the_filler_and_the_final_query_needs_it(steps, fact: str, setting: str, role: str) -> None:
    est = EstimateCounter()
    perturbed = unchanged = over = grown = 0
    for case, body in steps:
        msgs = body["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        needles = [v for v in turn_values(case, body) if not holds(text_of(msgs[last]), v)]
        holders = [i for i in range(last) if msgs[i]["role"] == role and any(holds(text_of(msgs[i]), v)
                                                                             for v in needles)]
        between = []
        for budget in BUDGETS:
            out, report = perturb({"budget_tokens": budget, "setting": setting, "fact": fact}, body, case)
            if not holders:  # no earlier message of the kind holds a value the answer needs
                assert "not_perturbed" in report and out == body, (case.id, report)
                unchanged += budget == BUDGETS[0]
                continue
            perturbed += budget == BUDGETS[0]
            assert "not_perturbed" not in report
            i = holders[0]
            assert report["fact_message"] == i and report["fact_located"] == "ground_truth"
            assert report["fact_kind"] == fact and report["turn"] == sum(m["role"] == "user" for m in msgs) - 1
            assert out["messages"][i] == msgs[i], "the fact message keeps its text"
            base = est.count_request(body)
            if report["turns_added"] == 0:  # already that long: left as it is, the fact where it was
                assert out == body and report["tokens_added"] == 0 and base >= 0.95 * budget, (case.id, base)
                over += 1
                continue
            k, added = inserted(body, out)
            assert added, (case.id, base, report)
            assert k > i, "the fact precedes all filler"
            assert added and all(m["role"] in ("user", "assistant", "tool") for m in added)
            assert ("tool" in {m["role"] for m in added}) == (setting == "structured")
            # the filler starts where the fact's turn ends: at the next user message of the original
            assert msgs[k]["role"] == "user" and all(m["role"] != "user" for m in msgs[i + 1:k]), (case.id, i, k)
            assert added[0]["role"] == "user" and added[-1]["role"] == "assistant"
            assert repeats(out["messages"]) == repeats(msgs), "roles alternate wherever they did"
            # the needle: in the fact message, not in the final user message, in no filler turn
            final = len(out["messages"]) - (len(msgs) - last)
            assert out["messages"][final] == msgs[last]
            found = [v for v in needles if holds(text_of(msgs[i]), v)]
            assert found and not any(holds(text_of(out["messages"][final]), v) for v in found)
            written = [text_of(m) for m in added] + [tc["function"]["name"] + " " + tc["function"]["arguments"]
                                                     for m in added for tc in m.get("tool_calls") or []]
            assert not any(holds(t, v) for t in written for v in needles), "a filler turn holds a needle"
            # the request reaches the budget within the existing tolerance
            total = est.count_request(out)
            assert abs(total - budget) <= 0.05 * budget, (case.id, total, budget)
            tokens = est.count_request({"messages": out["messages"][i + 1:final]})
            assert report["tokens_between"] == tokens
            between.append(tokens)
        if len(between) == len(BUDGETS):
            assert between == sorted(between) and len(set(between)) == len(BUDGETS), (case.id, between)
            grown += 1
    print(f"{fact}: {perturbed} steps perturbed ({grown} at every budget, {over} step-budgets already long "
          f"enough), {unchanged} not perturbed")
    assert grown > 0 and unchanged > 0 and over < perturbed * len(BUDGETS) / 2, (perturbed, unchanged, over)


@pytest.mark.needs_corpus
def test_a_single_turn_case_without_history_is_not_perturbed() -> None:
    from toolquake.bfcl.corpus import load_case

    case = load_case("simple_python_0")
    body = {"model": "m", "messages": case.turns[0]}
    for fact in ("user_turn", "tool_response"):
        out, report = perturb({"budget_tokens": 10_000, "fact": fact}, body, case)
        assert out == body and report["not_perturbed"].startswith(("no earlier", "no value"))


def test_a_position_with_a_fact_is_refused() -> None:
    from toolquake.perturbers import build

    with pytest.raises(ValueError, match="position"):
        build("conversation_lengthening", {"fact": "user_turn", "position": 3})
    with pytest.raises(ValueError, match="fact"):
        build("conversation_lengthening", {"fact": "somewhere"})


def test_the_preset_is_the_paper_grid_on_multi_turn_base() -> None:
    from toolquake.perturbers import build
    from toolquake.proxy.replay.selection import default_categories, expand_profiles
    from toolquake.proxy.server.config import load_config

    config = load_config(None, env={})
    for preset, base, prefix, needles in (("@seed003-conversations", "conv-off", "conv-", "next_call"),
                                          ("@seed003-conversations-bfcl", "off", "bfcl-conv-", "turn")):
        arms = expand_profiles(preset, ["off", *config.profiles])
        assert arms[0] == base and len(arms) == 9 and all(a.startswith(prefix) for a in arms[1:])
        grid = set()
        for name in arms[1:]:
            (step,) = config.profiles[name].perturbers
            p = build(step.name, step.params).params()
            grid.add((p["budget_tokens"], p["fact"], p["setting"]))
            assert p["needles"] == needles
        # both settings share the tool-calling filler: they differ only in where the fact sits
        assert grid == {(b, f, "structured") for b in BUDGETS for f, _, _ in SETTINGS}
        assert default_categories(preset) == ["multi_turn_base"]
    assert "Table 2" in config.profiles["conv-10k-s1"].description


# -- live: no case, so the fact is the first earlier message of its kind ----------------------------------------------

def live_request() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You manage files."},
        {"role": "user", "content": "My project folder is called 'orion-7'. List what is in the workspace."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "pwd", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"current_directory_content": ["orion-7", "notes"]}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"current_working_directory": "/workspace"}'},
        {"role": "assistant", "content": "The workspace holds orion-7 and notes."},
        {"role": "user", "content": "Is there anything in notes?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "ls", "arguments": '{"path": "notes"}'}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": '{"current_directory_content": []}'},
        {"role": "assistant", "content": "notes is empty."},
        {"role": "user", "content": "Now go into my project folder."},
    ]


@pytest.mark.needs_corpus
@pytest.mark.parametrize("profile,role,stream", [("conv-10k-s1", "user", False), ("conv-10k-s2", "tool", True),
                                                 ("conv-20k-s2", "tool", False), ("conv-20k-s1", "user", True)])
def test_live_traffic_places_the_filler_after_the_first_message_of_the_kind(proxy, fake_upstream, profile: str,
                                                                            role: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test")
    messages = live_request()
    tag = f"conv-fact-{profile}-{stream}"
    answer = client.chat.completions.create(model="fake-model", messages=messages, stream=stream,
                                            extra_headers={"X-Test-Tag": tag})
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else \
        answer.choices[0].message.content
    assert text
    sent = json.loads(recorded(fake_upstream, tag)[-1]["body"])
    first = next(i for i, m in enumerate(messages) if m["role"] == role)
    k, added = inserted({"messages": messages}, sent)
    assert sent["messages"][first] == messages[first]
    # the first of the kind, though a later one exists: the filler starts at the next user message after it
    nxt = next(i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user")
    assert k == nxt and [m["role"] for m in messages[k:]].count(role) >= 1
    assert repeats(sent["messages"]) == repeats(messages) == 0
    assert len(added) >= 4 and sent["messages"][-1] == messages[-1]
    budget = int(profile.split("-")[1].rstrip("k")) * 1000
    assert abs(EstimateCounter().count_request(sent) - budget) <= 0.05 * budget


# -- replay: a conversation with no step to perturb is counted apart -------------------------------------------------

@pytest.mark.needs_corpus
def test_a_replayed_conversation_without_a_fact_is_not_perturbed(backends, runs, tmp_path: Path) -> None:
    from tests.support.multiturn import first_user, scripted_turns
    from toolquake.bfcl.corpus import load_category
    from toolquake.scorers import multiturn as mt

    n = 8
    cases = list(load_category("multi_turn_base"))[:n]
    bodies = runs  # the ground-truth runs of these cases are the first n of the module's
    # a case none of whose ground-truth steps has the fact: the run never changes a request, so the pair is
    # `not_perturbed`; a case with such a step: the steps before it are the same, that one is perturbed
    none = {c.id for c in cases if all("not_perturbed" in perturb({"budget_tokens": 10_000, "fact": "user_turn"},
                                                                  b, c)[1] for b in bodies[c.id])}
    print(f"{len(none)} of {n} conversations without a step to perturb")
    assert 0 < len(none) < n
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": first_user(c),
                                        "turns": scripted_turns(mt.ground_truth_result(c, backends))}) + "\n"
                            for c in cases))
    model = start_fake_upstream("--trajectories", str(path))
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend",
                               f"{model.url}/v1", "--profiles", "off,bfcl-conv-10k-s1", "--categories",
                               "multi_turn_base",
                               "--limit", str(n), "--out", str(tmp_path / "run")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        report = subprocess.run([sys.executable, "-m", "toolquake", "report", str(tmp_path / "run"), "--format",
                                 "json"], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    finally:
        model.stop()
    arms = json.loads(report)["arms"]
    assert arms["off"]["n"] == n and arms["off"]["accuracy"] == 1.0
    assert arms["bfcl-conv-10k-s1"]["not_perturbed"] == len(none)
    assert arms["bfcl-conv-10k-s1"]["n"] == n - len(none)


@pytest.mark.needs_corpus
@pytest.mark.parametrize("fact,first", [("user_turn", 1), ("tool_response", 3)])
def test_without_a_case_the_report_says_first_of_kind(fact: str, first: int) -> None:
    body = {"model": "m", "messages": live_request()}
    out, report = perturb({"budget_tokens": 10_000, "fact": fact}, body, None)
    assert report["fact_located"] == "first_of_kind" and report["fact_message"] == first
    assert "needles_found" not in report and "not_perturbed" not in report
    k, added = inserted(body, out)
    assert k == 6 and added  # the fact's turn (replies, both calls' results) first: filler before the next user
    last = len(out["messages"]) - 1
    assert report["tokens_between"] == EstimateCounter().count_request({"messages": out["messages"][first + 1:last]})
    no_tool = {"model": "m", "messages": [m for m in live_request() if m["role"] in ("system", "user")]}
    same, report = perturb({"budget_tokens": 10_000, "fact": "tool_response"}, no_tool, None)
    assert same == no_tool and report["not_perturbed"] == "no earlier tool message"


@pytest.mark.needs_corpus
def test_the_turn_of_a_miss_func_step_counts_the_turn_that_reveals_functions(runs) -> None:
    from toolquake.bfcl.corpus import load_category
    from toolquake.perturbers.helpers.lengthening.facts import turn_of
    from toolquake.proxy.replay.multiturn import ADDITIONAL_FUNCTIONS_PROMPT

    cases = list(load_category("multi_turn_miss_func"))[:N_MISS_FUNC]
    revealed = 0
    for case in cases:
        held = {int(t) for t in case.extra["missed_function"]}
        for body in runs[case.id]:
            msgs = body["messages"]
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            turn = turn_of(case, msgs, users[-1])
            assert turn == len(users) - 1  # one user message per turn, the revealing turn's included
            if msgs[users[-1]]["content"] == ADDITIONAL_FUNCTIONS_PROMPT:
                assert turn in held and not case.turns[turn]
                revealed += 1
    assert revealed > 0


@pytest.mark.needs_corpus
def test_a_single_turn_case_with_a_history_finds_its_value_in_the_earlier_user_turn() -> None:
    from toolquake.bfcl.corpus import load_case

    case = load_case("simple_python_0")  # calculate_triangle_area(base=10, height=5, unit="units")
    body = {"model": "m", "messages": [
        {"role": "user", "content": "Remember this: my triangle has a base of 10 and a height of 5."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "A square has a side of 3."},
        {"role": "assistant", "content": "Noted too."},
        {"role": "user", "content": "Now find the area of my triangle."}]}
    out, report = perturb({"budget_tokens": 10_000, "fact": "user_turn"}, body, case)
    assert report["fact_located"] == "ground_truth" and report["fact_message"] == 0
    assert set(report["needles_found"]) == {"10.0", "5.0"}
    k, added = inserted(body, out)
    assert k == 2 and added and out["messages"][-1] == body["messages"][-1]
