"""tool_failure: each failure kind applied directly (what replaces the result, what stays), the `last` / `each`
targets, determinism, and through the real proxy (`toolquake serve` + the fake upstream, `openai` SDK) on chat
and Responses, streamed and not: the upstream gets the failure, and turns of one conversation agree.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from typing import Any

import openai
import pytest

from tests.support import recorded
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.tool_failure import EXPECTED_BEHAVIOUR, KINDS

RESULT = {"city": "Paris", "temp_c": 12.5, "wind_speed": 7, "forecast": [{"day": "mon", "high_c": 14}]}
TEXT_RESULT = "It is sunny in Paris with a light breeze from the west and no rain expected today."


def conversation(*results: str) -> list[dict[str, Any]]:
    """A user question, then one assistant call and its tool result per result."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    for n, result in enumerate(results):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": f"get_weather_{n}", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": result})
    return msgs


def apply(params: dict[str, Any], messages: list[dict[str, Any]], seed: int = 7) -> tuple[ChatRequest, ChatRequest,
                                                                                          dict[str, Any]]:
    """(the request given, the request returned, the report), the step's RNG made as the pipeline makes it."""
    request = ChatRequest({"model": "m", "messages": messages})
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:tool_failure"), services=Services())
    return request, build("tool_failure", params).apply(request, ctx), ctx.report


def leaves(value: Any) -> list[Any]:
    """The scalar values of a JSON document, in order, whatever the keys and nesting."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in leaves(v)]
    return [value]


def keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys(v)}
    return set()


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# --- applied directly ------------------------------------------------------------------------------------


def test_timeout_names_the_tool_and_keeps_the_call_id() -> None:
    before, after, report = apply({"kind": "timeout"}, conversation(json.dumps(RESULT)))
    msg = after.messages[-1]
    assert "timed out" in msg["content"] and "get_weather_0" in msg["content"] and "Paris" not in msg["content"]
    assert msg["tool_call_id"] == "call_0" and msg["role"] == "tool"
    assert after.messages[:-1] == before.messages[:-1]
    assert report["replaced"] == [2] and report["kind"] == "timeout"
    assert report["expected_behaviour"] == EXPECTED_BEHAVIOUR["timeout"]


def test_rate_limit_is_a_429_with_retry_after() -> None:
    _, after, report = apply({"kind": "rate_limit"}, conversation(json.dumps(RESULT)))
    error = json.loads(after.messages[-1]["content"])["error"]
    assert error["status"] == 429 and error["retry_after"] > 0
    assert f"Retry after {error['retry_after']} seconds" in error["message"]
    assert report["details"][0]["retry_after"] == error["retry_after"]


def test_server_error_is_a_5xx_body() -> None:
    statuses = set()
    for seed in range(30):
        _, after, _ = apply({"kind": "server_error"}, conversation(TEXT_RESULT), seed=seed)
        error = json.loads(after.messages[-1]["content"])["error"]
        assert 500 <= error["status"] < 600 and str(error["status"]) in error["message"]
        statuses.add(error["status"])
    assert len(statuses) > 1  # the status is drawn, not fixed


def test_truncated_json_is_a_malformed_prefix_of_the_original() -> None:
    original = json.dumps(RESULT)
    compact = json.dumps(RESULT, separators=(",", ":"))
    for seed in range(20):
        _, after, report = apply({"kind": "truncated"}, conversation(original), seed=seed)
        cut = after.messages[-1]["content"]
        assert cut and compact.startswith(cut) and len(cut) < len(compact) and not parses(cut)
        assert report["details"][0]["kept_chars"] == len(cut)


def test_truncated_text_is_a_shorter_prefix() -> None:
    _, after, _ = apply({"kind": "truncated"}, conversation(TEXT_RESULT))
    cut = after.messages[-1]["content"]
    assert cut and TEXT_RESULT.startswith(cut) and 0.3 * len(TEXT_RESULT) <= len(cut) <= 0.7 * len(TEXT_RESULT) + 1


@pytest.mark.parametrize(("original", "empty"), [(json.dumps(RESULT), "{}"), (json.dumps([RESULT]), "[]"),
                                                 (TEXT_RESULT, "")])
def test_empty_keeps_the_shape_and_drops_the_data(original: str, empty: str) -> None:
    _, after, _ = apply({"kind": "empty"}, conversation(original))
    assert after.messages[-1]["content"] == empty


def test_schema_drift_renames_or_nests_but_keeps_every_value() -> None:
    modes = set()
    for seed in range(30):
        _, after, report = apply({"kind": "schema_drift"}, conversation(json.dumps(RESULT)), seed=seed)
        drifted = json.loads(after.messages[-1]["content"])
        detail = report["details"][0]
        modes.add(detail["drift"])
        assert drifted != RESULT
        assert sorted(map(str, leaves(RESULT))) == sorted(map(str, [v for v in leaves(drifted)
                                                                     if v not in ("ok", 1)]))
        if "rename" in detail["drift"]:
            assert keys(drifted).isdisjoint(keys(RESULT))  # every field renamed
            assert set(detail["renamed"]) == keys(RESULT)
        if "nest" in detail["drift"]:
            assert set(drifted) & {"data"} and "city" not in drifted and "City" not in drifted
    assert modes == {"rename", "nest", "rename+nest"}


def test_schema_drift_on_text_keeps_the_text_with_a_note() -> None:
    _, after, report = apply({"kind": "schema_drift"}, conversation(TEXT_RESULT))
    content = after.messages[-1]["content"]
    assert content.endswith(TEXT_RESULT) and "schema" in content.split("\n")[0]
    assert report["details"][0]["drift"] == "note"


def test_list_content_parts_are_read_as_text() -> None:
    msgs = conversation("x")
    msgs[-1]["content"] = [{"type": "text", "text": json.dumps(RESULT)}]
    _, after, _ = apply({"kind": "empty"}, msgs)
    assert after.messages[-1]["content"] == "{}"


@pytest.mark.parametrize("kind", KINDS)
def test_last_replaces_only_the_last_result_and_the_input_is_untouched(kind: str) -> None:
    msgs = conversation(json.dumps(RESULT), TEXT_RESULT, json.dumps([RESULT]))
    pristine = copy.deepcopy(msgs)
    before, after, report = apply({"kind": kind}, msgs)
    assert msgs == pristine  # nothing mutated in place
    assert report["replaced"] == [6] and report["tool_results"] == 3
    assert after.messages[:6] == pristine[:6]
    assert after.messages[6]["content"] != pristine[6]["content"]
    assert report["expected_behaviour"] == EXPECTED_BEHAVIOUR[kind]


def test_every_kind_has_an_expected_behaviour() -> None:
    assert set(EXPECTED_BEHAVIOUR) == set(KINDS)
    assert all("invent" in text for text in EXPECTED_BEHAVIOUR.values())


def test_each_with_probability_one_or_zero() -> None:
    msgs = conversation(TEXT_RESULT, TEXT_RESULT, TEXT_RESULT)
    _, after, report = apply({"kind": "timeout", "target": "each", "probability_each": 1.0}, msgs)
    assert report["replaced"] == [2, 4, 6]
    assert all("timed out" in after.messages[i]["content"] for i in (2, 4, 6))
    before, after, report = apply({"kind": "timeout", "target": "each", "probability_each": 0.0}, msgs)
    assert report["replaced"] == [] and after is before


def test_each_draws_per_result_and_a_longer_conversation_repeats_the_earlier_draws() -> None:
    results = [json.dumps({**RESULT, "n": n}) for n in range(6)]
    counts = []
    for seed in range(40):
        params = {"kind": "server_error", "target": "each", "probability_each": 0.5}
        _, short, short_report = apply(params, conversation(*results[:3]), seed=seed)
        _, long, long_report = apply(params, conversation(*results), seed=seed)
        shared = [i for i in long_report["replaced"] if i < 7]
        assert short_report["replaced"] == shared
        assert short.messages == long.messages[:7]  # same results replaced, with the same failure text
        counts.append(len(long_report["replaced"]))
    assert min(counts) < 6 and max(counts) > 0 and 1.5 < sum(counts) / len(counts) < 4.5


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_failure(kind: str) -> None:
    msgs = conversation(json.dumps(RESULT))
    outs = {json.dumps(apply({"kind": kind}, msgs, seed=11)[1].messages) for _ in range(3)}
    assert len(outs) == 1


def test_no_tool_result_is_skipped_and_unchanged() -> None:
    before, after, report = apply({"kind": "timeout"}, [{"role": "user", "content": "hi"}])
    assert after is before and report["replaced"] == [] and "skipped" in report


@pytest.mark.parametrize("params", [{"kind": "explode"}, {"target": "first"}, {"probability_each": 1.5}])
def test_bad_parameters_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        build("tool_failure", params)


# --- through the proxy -----------------------------------------------------------------------------------

CONFIG = """
[profiles.fail-timeout]
perturbers = [{ name = "tool_failure", params = { kind = "timeout" } }]

[profiles.fail-each]
perturbers = [{ name = "tool_failure", params = { kind = "server_error", target = "each", probability_each = 1.0 } }]
"""
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
QUESTION = "Weather in Paris and then in Lyon?"


@pytest.fixture(scope="module")
def tq(fake_upstream):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG)
    yield proc
    proc.stop()


def client(proxy, profile: str, tag: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test",
                         default_headers={"x-test-tag": tag})


def chat_turn(c: openai.OpenAI, results: list[str], stream: bool) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for n, result in enumerate(results):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": result})
    kw = dict(model="fake-model", messages=msgs, tools=CHAT_TOOLS)
    if stream:
        assert list(c.chat.completions.create(stream=True, **kw))
    else:
        assert c.chat.completions.create(**kw).choices


def responses_turn(c: openai.OpenAI, results: list[str], stream: bool) -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for n, result in enumerate(results):
        items.append({"type": "function_call", "call_id": f"call_{n}", "name": "get_weather", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": f"call_{n}", "output": result})
    kw = dict(model="fake-model", input=items, tools=TOOLS)
    if stream:
        assert list(c.responses.create(stream=True, **kw))[-1].type == "response.completed"
    else:
        assert c.responses.create(**kw).output


def tool_outputs(fake, tag: str, api: str) -> list[list[tuple[str, str]]]:
    """Per request the fake received: (call id, result text) of each tool result, in order."""
    out = []
    for r in recorded(fake, tag):
        if r["method"] != "POST":
            continue
        body = json.loads(r["body"])
        if api == "chat":
            out.append([(m["tool_call_id"], m["content"]) for m in body["messages"] if m.get("role") == "tool"])
        else:
            out.append([(i["call_id"], i["output"]) for i in body["input"]
                        if isinstance(i, dict) and i.get("type") == "function_call_output"])
    return out


TURN = {"chat": chat_turn, "responses": responses_turn}


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_upstream_gets_the_failure_instead_of_the_result(tq, fake_upstream, api: str, stream: bool) -> None:
    tag = uuid.uuid4().hex
    TURN[api](client(tq, "fail-timeout", tag), [json.dumps(RESULT)], stream)
    (sent,) = tool_outputs(fake_upstream, tag, api)
    ((call_id, text),) = sent
    assert call_id == "call_0" and "timed out" in text and "get_weather" in text and "Paris" not in text


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_two_turns_of_one_conversation_get_the_same_failure(tq, fake_upstream, api: str) -> None:
    """server_error carries a drawn status and request id: the second turn repeats the first turn's failure for
    the first result (the seed is the conversation's, not the body's) and draws its own for the new one."""
    tag = uuid.uuid4().hex
    c = client(tq, "fail-each", tag)
    first_result, second_result = json.dumps(RESULT), json.dumps({**RESULT, "city": "Lyon"})
    TURN[api](c, [first_result], False)
    TURN[api](c, [first_result, second_result], True)
    turn1, turn2 = tool_outputs(fake_upstream, tag, api)
    assert len(turn1) == 1 and len(turn2) == 2
    assert turn2[0] == turn1[0]
    errors = [json.loads(text)["error"] for _, text in turn2]
    assert all(500 <= e["status"] < 600 for e in errors)
    assert errors[0]["request_id"] != errors[1]["request_id"]


def test_a_request_without_tool_results_is_forwarded_unchanged(tq, fake_upstream) -> None:
    tag = uuid.uuid4().hex
    client(tq, "fail-timeout", tag).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS)
    (got,) = [json.loads(r["body"]) for r in recorded(fake_upstream, tag) if r["method"] == "POST"]
    assert got["messages"] == [{"role": "user", "content": QUESTION}]
