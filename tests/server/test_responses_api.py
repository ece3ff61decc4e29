"""The Responses API and live-agent safety: perturbed like chat, relayed as streamed, conversation-stable
seeds, calls to tools the proxy invented, and upstream oddities answered cleanly.

Real processes: `toolquake serve` and the fake upstream (which speaks `/v1/responses`); the client is
the `openai` SDK. Assertions are on what the upstream received and what the client got.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.support import metric_value, recorded, start_proxy, wait_for

NAMES = ["get_weather", "get_time", "get_news", "get_stock", "get_flight", "get_hotel"]
TOOLS = [{"type": "function", "name": n, "description": f"{n} for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
         for n in NAMES]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
CONFIG = """
[server]
plugins = ["tests.plugins.adds_tool"]

[profiles.shuffled]
perturbers = [{ name = "tool_order", params = { mode = "shuffle" } }]

[profiles.format-python]
perturbers = [{ name = "format_rewrite", params = { return_format = "python", function_doc_format = "json" } }]

[profiles.format-live]
perturbers = [{ name = "format_rewrite", params = { return_format = "python", parse = "live" } }]

[profiles.invented]
perturbers = [{ name = "test_adds_tool" }]

[profiles.invented-pass]
injected_calls = "pass"
perturbers = [{ name = "test_adds_tool" }]
"""


@pytest.fixture(scope="module")
def tq(fake_upstream):
    proc = start_proxy(fake_upstream.url, CONFIG)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def unscored(fake_upstream):
    """The same profiles with scoring off (`--no-scoring`): nobody observes the answers."""
    proc = start_proxy(fake_upstream.url, CONFIG, None, "--no-scoring")
    yield proc
    proc.stop()


def tag() -> str:
    return uuid.uuid4().hex


def client(proxy, profile: str, t: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test",
                         default_headers={"x-test-tag": t, **headers})


def sent_bodies(fake, t: str, path: str = "/v1/responses") -> list[dict]:
    return [json.loads(r["body"]) for r in recorded(fake, t) if r["path"] == path]


def metrics(proxy) -> str:
    return httpx.get(f"{proxy.url}/metrics").text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_request_is_perturbed_and_counted_under_its_own_route(tq, fake_upstream, stream):
    t = tag()
    before = metric_value(metrics(tq), "toolquake_requests_total", route="responses", profile="shuffled",
                          stream=str(stream).lower())
    c = client(tq, "shuffled", t)
    if stream:
        events = list(c.responses.create(model="fake-model", input="Weather in Paris?", tools=TOOLS, stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        answer = events[-1].response
    else:
        answer = c.responses.create(model="fake-model", input="Weather in Paris?", tools=TOOLS)
    (got,) = sent_bodies(fake_upstream, t)
    order = [tool["name"] for tool in got["tools"]]
    assert sorted(order) == sorted(NAMES) and order != NAMES  # the tools arrived shuffled, in Responses shape
    assert all("function" not in tool for tool in got["tools"])
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [call.name for call in calls] == [order[0]]  # the fake calls the first tool it was sent
    after = metric_value(metrics(tq), "toolquake_requests_total", route="responses", profile="shuffled",
                         stream=str(stream).lower())
    assert after == before + 1


def test_unknown_fields_and_items_survive_perturbation_in_place(tq, fake_upstream):
    t = tag()
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "x_vendor": {"kept": True}},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    body = {"model": "fake-model", "input": items, "tools": [*TOOLS, {"type": "web_search"}],
            "instructions": "Be brief.", "store": False, "x_custom": {"a": [1, 2]}}
    r = httpx.post(f"{tq.url}/p/shuffled/v1/responses", json=body, headers={"x-test-tag": t})
    assert r.status_code == 200, r.text
    (got,) = sent_bodies(fake_upstream, t)
    assert got["input"] == items and got["instructions"] == "Be brief."
    assert got["x_custom"] == {"a": [1, 2]} and got["store"] is False
    assert got["tools"][-1] == {"type": "web_search"}
    assert sorted(tool["name"] for tool in got["tools"][:-1]) == sorted(NAMES)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_format_rewrite_on_responses_sends_no_tools_and_gives_back_calls(tq, fake_upstream, stream):
    t = tag()
    text = json.dumps({"text": "[get_time(city='Tokyo')]"})
    c = client(tq, "format-python", t, **{"x-fake-answer": text})
    if stream:
        events = list(c.responses.create(model="fake-model", input="Time in Tokyo?", tools=TOOLS, stream=True))
        answer = events[-1].response
        assert any(e.type == "response.function_call_arguments.delta" for e in events)
    else:
        answer = c.responses.create(model="fake-model", input="Time in Tokyo?", tools=TOOLS)
    (got,) = sent_bodies(fake_upstream, t)
    assert "tools" not in got and "get_time" in json.dumps(got["input"])  # docs moved into the prompt
    (call,) = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments) == {"city": "Tokyo"}


def test_unknown_profile_header_on_responses_is_404(tq):
    r = httpx.post(f"{tq.url}/v1/responses", json={"model": "m", "input": "hi"},
                   headers={"x-toolquake-profile": "no-such-profile"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_profile"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_every_turn_of_one_conversation_gets_the_same_perturbation(tq, fake_upstream, api):
    t = tag()
    if api == "chat":
        c = client(tq, "shuffled", t).chat.completions
        first = c.create(model="fake-model", messages=[{"role": "user", "content": "Plan my trip to Rome."}],
                         tools=CHAT_TOOLS)
        call = first.choices[0].message.tool_calls[0]
        c.create(model="fake-model", tools=CHAT_TOOLS, messages=[
            {"role": "user", "content": "Plan my trip to Rome."},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        path, key = "/v1/chat/completions", lambda tool: tool["function"]["name"]
    else:
        c = client(tq, "shuffled", t).responses
        first = c.create(model="fake-model", input="Plan my trip to Rome.", tools=TOOLS)
        call = first.output[0]
        c.create(model="fake-model", tools=TOOLS, input=[
            {"role": "user", "content": "Plan my trip to Rome."},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        path, key = "/v1/responses", lambda tool: tool["name"]
    turns = sent_bodies(fake_upstream, t, path)
    assert len(turns) == 2
    orders = [[key(tool) for tool in body["tools"]] for body in turns]
    assert orders[0] == orders[1] and orders[0] != NAMES


def test_the_conversation_header_keys_the_perturbation(tq, fake_upstream):
    t = tag()
    for question in ("First question?", "A different opening question?"):
        client(tq, "shuffled", t, **{"x-toolquake-conversation": "run-42"}).responses.create(
            model="fake-model", input=question, tools=TOOLS)
    orders = [[tool["name"] for tool in body["tools"]] for body in sent_bodies(fake_upstream, t)]
    assert len(orders) == 2 and orders[0] == orders[1]
    # without the header the two openings are two conversations: their own seeds, their own orders
    u = tag()
    for question in ("First question?", "A different opening question?"):
        client(tq, "shuffled", u).responses.create(model="fake-model", input=question, tools=TOOLS)
    others = [[tool["name"] for tool in body["tools"]] for body in sent_bodies(fake_upstream, u)]
    assert len(others) == 2 and others[0] != others[1]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_calls_to_an_invented_tool_are_answered_by_the_proxy(tq, fake_upstream, api, stream):
    """`injected_calls = "answer"` (the default): the model called the tool the proxy added; the proxy told
    it the tool is unavailable and asked again; the client only ever sees a call to its own tool."""
    t = tag()
    before = metric_value(metrics(tq), "toolquake_injected_tool_calls_total", profile="invented",
                          perturber="test_adds_tool")
    c = client(tq, "invented", t, **{"x-fake-call-foreign": ",".join(NAMES)})
    if api == "chat":
        kw = dict(model="fake-model", messages=[{"role": "user", "content": "Archive?"}], tools=CHAT_TOOLS)
        if stream:
            chunks = list(c.chat.completions.create(stream=True, **kw))
            names = [d.function.name for ch in chunks for choice in ch.choices for d in choice.delta.tool_calls or []
                     if d.function and d.function.name]
        else:
            names = [tc.function.name for tc in c.chat.completions.create(**kw).choices[0].message.tool_calls]
        path = "/v1/chat/completions"
    else:
        kw = dict(model="fake-model", input="Archive?", tools=TOOLS)
        answer = list(c.responses.create(stream=True, **kw))[-1].response if stream else c.responses.create(**kw)
        names = [item.name for item in answer.output if item.type == "function_call"]
        path = "/v1/responses"
    assert names == [NAMES[0]]
    first, second = sent_bodies(fake_upstream, t, path)
    assert "zz_lookup_archive" in json.dumps(first["tools"]) and "is not available" in json.dumps(second)
    after = metric_value(metrics(tq), "toolquake_injected_tool_calls_total", profile="invented",
                         perturber="test_adds_tool")
    assert after == before + 1


def test_pass_policy_lets_the_client_see_the_invented_call_and_counts_it(tq, fake_upstream):
    t = tag()
    before = metric_value(metrics(tq), "toolquake_injected_tool_calls_total", profile="invented-pass")
    c = client(tq, "invented-pass", t, **{"x-fake-call-foreign": ",".join(NAMES)})
    message = c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Archive?"}],
                                        tools=CHAT_TOOLS).choices[0].message
    assert [tc.function.name for tc in message.tool_calls] == ["zz_lookup_archive"]
    assert len(sent_bodies(fake_upstream, t, "/v1/chat/completions")) == 1
    assert metric_value(metrics(tq), "toolquake_injected_tool_calls_total", profile="invented-pass") == before + 1


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
])
@pytest.mark.parametrize("fault", ["empty-stream", "no-done"])
def test_an_empty_or_unfinished_stream_ends_with_an_error_event_and_is_counted(tq, path, body, fault):
    before = metric_value(metrics(tq), "toolquake_upstream_errors_total", kind="invalid_response")
    with httpx.stream("POST", f"{tq.url}{path}", json=body, headers={"x-fake-fault": fault}) as r:
        data = b"".join(r.iter_raw())
    last = [line for line in data.split(b"\n") if line.startswith(b"data: ")][-1]
    error = json.loads(last[len(b"data: "):])["error"]
    assert error["code"] == "upstream_invalid_response"
    assert ("empty" in error["message"]) == (fault == "empty-stream")
    assert metric_value(metrics(tq), "toolquake_upstream_errors_total", kind="invalid_response") == before + 1


def timed_stream(proxy, profile: str, answer_text: str, delay_ms: int = 120) -> tuple[list, list[float], float]:
    """The SDK's chunks of a paced stream, when each arrived, and when the stream ended (seconds)."""
    import time

    c = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test", default_headers={
        "x-fake-answer": json.dumps({"text": answer_text}), "x-fake-fault": f"chunk-delay:{delay_ms}"})
    t0 = time.perf_counter()
    chunks, times = [], []
    for chunk in c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Tokyo?"}],
                                           tools=[{"type": "function", "function": {k: v for k, v in TOOLS[1].items()
                                                                                    if k != "type"}}], stream=True):
        chunks.append(chunk)
        times.append(time.perf_counter() - t0)
    return chunks, times, time.perf_counter() - t0


def test_format_rewrite_streams_plain_text_as_it_arrives(tq):
    proxy = tq
    text = "It is nine in the morning in Tokyo, and the trains are on time today."
    chunks, times, total = timed_stream(proxy, "format-python", text)
    content = [(i, ch.choices[0].delta.content) for i, ch in enumerate(chunks)
               if ch.choices and ch.choices[0].delta.content]
    assert "".join(c for _, c in content) == text  # all of it, once, in order
    first = times[content[0][0]]
    assert len(content) > 3 and first < total / 3  # the text came as it was written, not at the end


@pytest.mark.parametrize("profile, text, prefix", [
    ("format-python", "[get_time(city='Tokyo')]", ""),
    ("format-live", "Sure: [get_time(city='Tokyo')]", "Sure: "),
])
def test_format_rewrite_stream_turns_call_syntax_into_tool_calls(tq, profile, text, prefix):
    proxy = tq
    chunks, _, _ = timed_stream(proxy, profile, text, delay_ms=20)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == prefix  # the prose before the call, nothing of the call
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in calls if tc.function.name] == ["get_time"]
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Tokyo"}
    finish_reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish_reasons == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_invented_calls_are_counted_without_any_observer(unscored, fake_upstream, stream):
    """With scoring off nobody observes the answers; a call to an added tool is still counted."""
    proxy = unscored
    wanted = dict(profile="invented-pass", perturber="test_adds_tool")
    before = metric_value(metrics(proxy), "toolquake_injected_tool_calls_total", **wanted)
    t = tag()
    c = client(proxy, "invented-pass", t, **{"x-fake-call-foreign": ",".join(NAMES)})
    out = c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Archive?"}],
                                    tools=CHAT_TOOLS, stream=stream)
    if stream:
        list(out)
    wait_for(lambda: metric_value(metrics(proxy), "toolquake_injected_tool_calls_total", **wanted) == before + 1,
             what="the invented call to be counted")


def timed_responses_stream(proxy, profile: str, answer_text: str, delay_ms: int = 120) -> tuple[list, list[float]]:
    import time

    c = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test", default_headers={
        "x-fake-answer": json.dumps({"text": answer_text}), "x-fake-fault": f"chunk-delay:{delay_ms}"})
    t0 = time.perf_counter()
    events, times = [], []
    for event in c.responses.create(model="fake-model", input="Tokyo?", tools=[TOOLS[1]], stream=True):
        events.append(event)
        times.append(time.perf_counter() - t0)
    return events, times


def test_format_rewrite_streams_plain_text_through_on_the_responses_api(tq):
    proxy = tq
    text = "It is nine in the morning in Tokyo, and the trains are on time today."
    events, times = timed_responses_stream(proxy, "format-python", text)
    deltas = [(i, e.delta) for i, e in enumerate(events) if e.type == "response.output_text.delta"]
    assert "".join(d for _, d in deltas) == text and len(deltas) > 3
    assert times[deltas[0][0]] < times[-1] / 3  # the text came as it was written, not at the end
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == text


def test_format_rewrite_responses_stream_turns_call_syntax_into_a_function_call(tq):
    proxy = tq
    events, _ = timed_responses_stream(proxy, "format-live", "Sure: [get_time(city='Tokyo')]", delay_ms=20)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure: "
    final = events[-1].response
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments) == {"city": "Tokyo"}
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
