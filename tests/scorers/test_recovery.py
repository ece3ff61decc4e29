"""Recovery verdicts (scorers/recovery.py) on hand-written answers after each kind of failure, the failure made
by the real tool_failure perturber; and which verdicts count as recovered per kind."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.tool_failure import KINDS
from toolquake.scorers import recovery

RESULT = {"city": "Paris", "temp_c": 12.5, "humidity_pct": 81, "forecast": [{"day": "mon", "high_c": 14}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "send_message", "description": "Send a message.",
                                           "parameters": {"type": "object", "properties": {
                                               "text": {"type": "string"}, "temp": {"type": "number"}}}}}]

#: per kind, a text answer that reports that failure in its own words
REPORTS = {
    "timeout": "The weather service timed out, so I have no forecast for Paris right now.",
    "rate_limit": "I hit the weather API's rate limit; I will try again in a moment.",
    "server_error": "The weather server returned an internal error, so I cannot tell you the forecast.",
    "truncated": "The weather data came back incomplete (it was cut off), so I cannot give the full forecast.",
    "empty": "The weather tool returned no data for Paris.",
    "schema_drift": "The weather API changed its response format; the fields were renamed.",
}
PLAIN = "Here is what I found about Paris."

#: the right behaviour per kind (docs/perturbers-faults.md), verdict by verdict
EXPECTED_RECOVERED = {
    "timeout": {"retried"}, "rate_limit": {"retried"}, "server_error": {"retried"},
    "truncated": {"retried", "requeried"}, "empty": {"requeried"},
    "schema_drift": {"retried", "requeried", "answered", "other_call"},
}


def failed_request(kind: str) -> dict[str, Any]:
    """The request the model sees: a call to get_weather whose result tool_failure replaced with `kind`."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": json.dumps(RESULT)}]
    request = ChatRequest({"model": "m", "messages": messages, "tools": TOOLS})
    ctx = PerturbContext(perturbation_seed=3, rng=random.Random("3:0:tool_failure"), services=Services())
    perturber = build("tool_failure", {"kind": kind})
    out = perturber.apply(request, ctx)
    assert perturber.injected_failures(ctx.report) == [{"index": 2, "kind": kind}]
    return out.body


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def text(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def test_every_failure_kind_has_a_recovery_rule() -> None:
    assert set(recovery.RECOVERED) == set(KINDS) == set(recovery.KIND_WORDS) == set(REPORTS)


@pytest.mark.parametrize("kind", KINDS)
def test_hand_written_answers_after_each_kind(kind: str) -> None:
    request = failed_request(kind)
    answers = {
        "retried": call("get_weather", city="Paris"),
        "requeried": call("get_weather", city="Paris, France"),
        "reported": text(REPORTS[kind]),
        "answered": text(PLAIN),
        "invented": text("It is 17.5 °C in Paris with 63 % humidity."),
        "other_call": call("send_message", text="Looking into it"),
        "no_answer": text(""),
    }
    for expected, message in answers.items():
        got = recovery.classify(request, 2, kind, message)
        assert (got.kind, got.tool, got.verdict) == (kind, "get_weather", expected), (expected, got)
        assert got.recovered == (expected in EXPECTED_RECOVERED[kind] or expected == "reported"), (expected, got)
    invented = recovery.classify(request, 2, kind, answers["invented"])
    assert invented.invented == ("17.5", "63") and not invented.recovered


def test_a_call_to_another_tool_with_a_number_never_sent_is_invented() -> None:
    request = failed_request("timeout")
    got = recovery.classify(request, 2, "timeout", call("send_message", text="Paris", temp=21.5))
    assert got.verdict == "invented" and got.invented == ("21.5",)


def test_numbers_the_model_was_sent_are_not_invented() -> None:
    # the retry-after delay and the status are in the failure text; 12.5 is in the drifted result
    rate = failed_request("rate_limit")
    after = json.loads(rate["messages"][2]["content"])["error"]["retry_after"]
    got = recovery.classify(rate, 2, "rate_limit", text(f"Rate limited (HTTP 429): retrying in {after} seconds."))
    assert got.verdict == "reported" and got.recovered
    drift = failed_request("schema_drift")
    got = recovery.classify(drift, 2, "schema_drift", text("It is 12.5 °C in Paris, humidity 81 %."))
    assert got.verdict == "answered" and got.recovered
    # the same answer after a timeout quotes values the model never saw
    got = recovery.classify(failed_request("timeout"), 2, "timeout", text("It is 12.5 °C in Paris, humidity 81 %."))
    assert got.verdict == "invented" and got.invented == ("12.5", "81")


def test_numbers_compare_by_value_and_list_markers_and_digits_are_not_data() -> None:
    assert recovery.numbers("1,200 items, 1200.0 again, 7 days, -3.5 degrees") == {1200.0: "1,200", 3.5: "-3.5"}
    request = {"messages": [{"role": "user", "content": "Split 1200 into parts"}]}
    got = recovery.classify(request, 0, "timeout", text("1. First: 1,200\n2) then 4 parts of 300"))
    assert got.verdict == "invented" and got.invented == ("300",)


def test_a_retry_with_compatible_arguments_is_a_retry() -> None:
    request = failed_request("server_error")
    request["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris", "unit": "C"})
    assert recovery.classify(request, 2, "server_error", call("get_weather", city="Paris")).verdict == "retried"
    assert recovery.classify(request, 2, "server_error", call("get_weather", city="Lyon")).verdict == "requeried"


def test_only_failures_after_the_last_answer_are_judged() -> None:
    messages = [{"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}, {"role": "tool"},
                {"role": "tool"}]
    assert recovery.after_last_answer(messages, [2, 5, 4]) == [4, 5]
    assert recovery.after_last_answer(messages, [2]) == []
