"""Shadow mode: the client gets the answer to its original request; a perturbed twin is compared with it.

End to end: the proxy (`python -m proxy serve`) and the fake upstream run as their own processes; the
client is the real `openai` SDK. One proxy for the module: each test sends to a shadow profile of its own (the
counters are per profile, so is `max_concurrent`). Plus the consistency rules themselves (scorers/consistency.py).
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import recorded, scraped, start_proxy, wait_for
from tests.support.shadow import MESSAGES, TOOLS, _tool, client, config
from toolquake.proxy.live import results
from toolquake.scorers.consistency import (
    AGREE_EXACT,
    AGREE_SEMANTIC,
    DISAGREE,
    Call,
    calls_of,
    compare,
    values_equivalent,
)

#: shadow profiles beside config()'s `shadow-reversed`, one per test (the same reversal)
REVERSE = 'perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]'
MORE_PROFILES = f"""
[profiles.shadow-agree]
mode = "shadow"
sample_rate = 1.0
{REVERSE}

[profiles.shadow-one]
mode = "shadow"
sample_rate = 1.0
max_concurrent = 1
{REVERSE}

[profiles.shadow-zero]
mode = "shadow"
sample_rate = 0.0
{REVERSE}
"""


@pytest.fixture(scope="module")
def served(fake_upstream, tmp_path_factory):
    db = tmp_path_factory.mktemp("shadow") / "shadow.sqlite"
    proxy = start_proxy(fake_upstream.url, config(db) + MORE_PROFILES)
    yield proxy, db
    proxy.stop()


def test_client_gets_the_original_answer_and_the_twin_goes_out_perturbed(served, fake_upstream):
    proxy, db = served
    tag = uuid.uuid4().hex
    # the fake calls whichever tool comes first: the reversed twin calls the other one
    stream = client(proxy).chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, stream=True, extra_headers={"X-Test-Tag": tag})
    rid = stream.headers["x-toolquake-request-id"]
    chunks = list(stream.parse())
    names = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.function.name]
    assert names == ["weather_forecast"]
    wait_for(lambda: scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed") == 1, what="twin")
    original, twin = recorded(fake_upstream, tag)
    orig_body, twin_body = json.loads(original["body"]), json.loads(twin["body"])
    assert orig_body["stream"] is True and twin_body["stream"] is False
    assert [t["function"]["name"] for t in orig_body["tools"]] == ["weather_forecast", "humidity_forecast"]
    assert [t["function"]["name"] for t in twin_body["tools"]] == ["humidity_forecast", "weather_forecast"]
    assert twin["headers"]["authorization"] == "Bearer sk-shadow-test"
    assert not any(k.startswith("x-toolquake-") for k in twin["headers"])
    assert scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed", model="fake-model",
                  agree=DISAGREE) == 1
    wait_for(lambda: [r for r in results.read_rows(db) if r["profile"] == "shadow-reversed"], what="stored row")
    [row] = [r for r in results.read_rows(db) if r["profile"] == "shadow-reversed"]
    assert (row["arm"], row["agree"], row["shadow_of"], row["mode"]) == ("twin", DISAGREE, rid, "shadow")
    assert row["perturbers"] == [{"name": "tool_order", "params": {"mode": "reverse"},
                                  "report": {"order": ["humidity_forecast", "weather_forecast"]}}]
    assert row["request_body"] is None and row["response_body"] is None


def test_agreement_exact_and_semantic_and_disagreement_are_counted(served):
    proxy, _ = served
    c = client(proxy, "shadow-agree")
    cases = [  # (the original's arguments, the twin's arguments, expected agreement)
        # the perturbation changes the request but not the answer
        ({"city": "Miami"}, {"city": "Miami"}, AGREE_EXACT),
        # the twin writes the same values differently
        ({"city": "Miami, FL", "days": 7}, {"city": "miami fl", "days": 7.0}, AGREE_SEMANTIC),
        # a different value
        ({"city": "Miami", "days": 7}, {"city": "Miami", "days": 3}, DISAGREE),
    ]
    for orig_args, twin_args, _ in cases:
        # original (weather_forecast first) and twin (humidity_forecast first) both call weather_forecast
        table = {"weather_forecast": {"calls": [{"name": "weather_forecast", "arguments": orig_args}]},
                 "humidity_forecast": {"calls": [{"name": "weather_forecast", "arguments": twin_args}]}}
        c.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                  extra_headers={"X-Fake-Answer-By-First-Tool": json.dumps(table)})
    wait_for(lambda: scraped(proxy, "toolquake_consistency_total", profile="shadow-agree") == len(cases),
             what="three twins")
    for agree in (AGREE_EXACT, AGREE_SEMANTIC, DISAGREE):
        expected = sum(1 for *_, a in cases if a == agree)
        assert scraped(proxy, "toolquake_consistency_total", profile="shadow-agree", agree=agree) == expected


def test_twins_over_max_concurrent_are_skipped_and_never_delay_the_client(served):
    proxy, _ = served
    c = client(proxy, "shadow-one")

    def ask(_: int) -> str:
        r = c.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                      extra_headers={"X-Fake-Fault": "delay:1500"})
        return r.choices[0].message.tool_calls[0].function.name

    with ThreadPoolExecutor(3) as pool:
        answered = list(pool.map(ask, range(3)))
    assert answered == ["weather_forecast"] * 3
    # the clients have their answers while the one admitted twin is still waiting on the slow upstream
    assert scraped(proxy, "toolquake_shadow_requests_total", profile="shadow-one", outcome="answered") == 0
    assert scraped(proxy, "toolquake_shadow_requests_total", profile="shadow-one", outcome="busy") == 2
    wait_for(lambda: scraped(proxy, "toolquake_shadow_requests_total", profile="shadow-one", outcome="answered") == 1,
             what="the twin")
    assert scraped(proxy, "toolquake_consistency_total", profile="shadow-one") == 1


def test_sample_rate_zero_sends_no_twin(served, fake_upstream):
    proxy, _ = served
    tag = uuid.uuid4().hex
    for _ in range(3):
        client(proxy, "shadow-zero").chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                              extra_headers={"X-Test-Tag": tag})
    wait_for(lambda: scraped(proxy, "toolquake_shadow_requests_total", profile="shadow-zero", outcome="sampled_out")
             == 3, what="counts")
    assert len(recorded(fake_upstream, tag)) == 3
    assert scraped(proxy, "toolquake_consistency_total", profile="shadow-zero") == 0


# --- the consistency rules --------------------------------------------------------------------


def test_parallel_calls_in_another_order_agree_exactly():
    a = [Call("f", {"x": 1}), Call("g", {"y": "a"})]
    assert compare(a, list(reversed(a))).agree == AGREE_EXACT


@pytest.mark.parametrize("left,right,agree", [
    ({"city": "Miami, FL"}, {"city": "miami fl"}, AGREE_SEMANTIC),
    ({"n": 5}, {"n": 5.0}, AGREE_EXACT),
    ({"n": 5}, {"n": "5"}, AGREE_SEMANTIC),
    ({"l": ["A b", 2]}, {"l": ["a-b", 2]}, AGREE_SEMANTIC),
    ({"l": [1, 2]}, {"l": [2, 1]}, DISAGREE),
    ({"city": "Miami"}, {"city": "Boston"}, DISAGREE),
    ({"flag": True}, {"flag": 1}, DISAGREE),
    ({"city": "Miami"}, {"city": "Miami", "unit": "celsius"}, AGREE_SEMANTIC),  # the schema default
    ({"city": "Miami"}, {"city": "Miami", "unit": "kelvin"}, DISAGREE),
    ({"city": "Miami"}, {"city": "Miami", "extra": "x"}, DISAGREE),
])
def test_argument_rules(left, right, agree):
    tools = [_tool("f", unit="celsius")]
    assert compare([Call("f", left)], [Call("f", right)], tools=tools).agree == agree


def test_different_functions_or_counts_disagree_with_reasons():
    r = compare([Call("f", {})], [Call("g", {})])
    assert r.agree == DISAGREE and "functions" in r.reasons[0]
    r = compare([Call("f", {})], [Call("f", {}), Call("f", {})])
    assert r.agree == DISAGREE and "call count" in r.reasons[0]
    assert compare([], []).agree == AGREE_EXACT
    assert compare([], [Call("f", {})]).agree == DISAGREE


def test_calls_of_keeps_undecodable_arguments_as_text():
    msg = {"tool_calls": [{"function": {"name": "f", "arguments": "{not json"}},
                          {"function": {"name": "g", "arguments": ""}}]}
    assert calls_of(msg) == [Call("f", "{not json"), Call("g", {})]
    assert calls_of({"content": "hello"}) == []


def test_an_extra_string_equivalence_is_used_when_given():
    same_city = {("NYC", "New York City")}
    assert not values_equivalent("NYC", "New York City")
    assert values_equivalent("NYC", "New York City", strings=lambda a, b: (a, b) in same_city)
