"""`toolquake_tool_failure_recovery_total{profile,kind,verdict}`: the proxy (`toolquake serve`, live scoring on)
replaces an agent's tool result with a failure, the fake upstream answers what the test chose, and the counter
goes up by one for that verdict — chat and Responses, streamed and not, with no BFCL case involved."""

from __future__ import annotations

import json
import uuid
from typing import Any

import openai
import pytest

from tests.support import scraped, wait_for

NAME = "toolquake_tool_failure_recovery_total"
CONFIG = """
[server]
model_allowlist = ["fake-model"]

[profiles.fail-timeout]
perturbers = [{{ name = "tool_failure", params = {{ kind = "timeout" }} }}]

[profiles.fail-each]
perturbers = [
  {{ name = "tool_failure", params = {{ kind = "server_error", target = "each", probability_each = 1.0 }} }},
]

[scoring]
store = "{db}"
"""
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
RESULT = json.dumps({"city": "Paris", "temp_c": 12.5})
ARGS = json.dumps({"city": "Paris"})
#: answer the fake gives → the verdict the test expects for it after a timeout
ANSWERS = {
    "retried": {"calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
    "requeried": {"calls": [{"name": "get_weather", "arguments": {"city": "Paris, France"}}]},
    "reported": {"text": "The weather service timed out; please try again later."},
    "invented": {"text": "It is 23.5 degrees in Paris today."},
}


@pytest.fixture(scope="module")
def tq(fake_upstream, tmp_path_factory):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG.format(db=tmp_path_factory.mktemp("rec") / "live.sqlite"))
    yield proc
    proc.stop()


def send(proxy, profile: str, api: str, stream: bool, answer: dict[str, Any], results: int = 1) -> None:
    c = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test",
                      default_headers={"x-test-tag": uuid.uuid4().hex, "x-fake-answer": json.dumps(answer)})
    if api == "chat":
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        for n in range(results):
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": RESULT})
        kw: dict[str, Any] = dict(model="fake-model", messages=msgs, tools=CHAT_TOOLS)
        if stream:
            assert list(c.chat.completions.create(stream=True, **kw))
        else:
            assert c.chat.completions.create(**kw).choices
        return
    items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    for n in range(results):
        items.append({"type": "function_call", "call_id": f"call_{n}", "name": "get_weather", "arguments": ARGS})
        items.append({"type": "function_call_output", "call_id": f"call_{n}", "output": RESULT})
    kw = dict(model="fake-model", input=items, tools=TOOLS)
    if stream:
        assert list(c.responses.create(stream=True, **kw))[-1].type == "response.completed"
    else:
        assert c.responses.create(**kw).output


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("verdict", list(ANSWERS))
def test_each_answer_after_a_timeout_is_counted_under_its_verdict(tq, api: str, stream: bool, verdict: str) -> None:
    labels = dict(profile="fail-timeout", kind="timeout")
    before = {v: scraped(tq, NAME, verdict=v, **labels) for v in ANSWERS}
    send(tq, "fail-timeout", api, stream, ANSWERS[verdict])
    wait_for(lambda: scraped(tq, NAME, verdict=verdict, **labels) == before[verdict] + 1, what=f"{verdict} counted")
    assert {v: scraped(tq, NAME, verdict=v, **labels) for v in ANSWERS} == {
        v: before[v] + (v == verdict) for v in ANSWERS}


def test_only_the_failure_the_answer_reacts_to_is_counted(tq) -> None:
    """`each` with probability 1 keeps the first turn's failure in the history: the second turn's answer is
    judged once, on the newest result."""
    labels = dict(profile="fail-each", kind="server_error")
    before = scraped(tq, NAME, **labels)
    send(tq, "fail-each", "chat", False, ANSWERS["reported"], results=2)
    wait_for(lambda: scraped(tq, NAME, **labels) > before, what="a verdict")
    send(tq, "fail-each", "chat", False, ANSWERS["retried"], results=2)  # one more, to be sure the first is all in
    wait_for(lambda: scraped(tq, NAME, **labels) >= before + 2, what="two verdicts")
    assert scraped(tq, NAME, **labels) == before + 2
    assert scraped(tq, NAME, verdict="reported", **labels) >= 1 and scraped(tq, NAME, verdict="retried", **labels) >= 1


def test_requests_without_an_injected_failure_count_nothing(tq) -> None:
    before = scraped(tq, NAME)
    send(tq, "fail-timeout", "chat", False, ANSWERS["reported"], results=0)  # no tool result to replace
    send(tq, "off", "chat", False, ANSWERS["reported"])  # a tool result, no perturbation
    send(tq, "fail-timeout", "chat", False, ANSWERS["invented"])  # counted: marks that the two above were seen
    wait_for(lambda: scraped(tq, NAME) > before, what="the last request counted")
    assert scraped(tq, NAME) == before + 1
