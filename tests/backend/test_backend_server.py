"""The embedded server (proxy/backend/server.py) with the real SmolLM2-135M model: every tool_choice mode,
streamed and not, on chat completions and the Responses API; the message shapes frameworks send; errors;
token counting; determinism; agent loops to a final answer, directly and through the proxy.

One model load for the module (a module-scoped LocalBackend); answers are short (max_tokens <= 64).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support import Proc, start_proxy
from tests.support.backend import MODEL

pytestmark = [pytest.mark.slow, *MODEL]

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                  "required": ["city"]}
CONVERT_PARAMS = {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "celsius_to_fahrenheit": CONVERT_PARAMS}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current temperature in a city, "
                                      "in Celsius.", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "celsius_to_fahrenheit", "description": "Convert a temperature from "
                                      "Celsius to Fahrenheit.", "parameters": CONVERT_PARAMS}},
]
RESP_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
QUESTION = "What is the temperature in Paris in Fahrenheit?"
MODES = ["auto", "required", "none", "named"]


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments)
    if name == "get_weather":
        return json.dumps({"city": args["city"], "celsius": 18})
    return json.dumps({"fahrenheit": float(args["celsius"]) * 9 / 5 + 32})


@pytest.fixture(scope="module")
def backend():
    from toolquake.proxy.backend.local import LocalBackend

    with LocalBackend(n_ctx=4096, max_tokens=64) as b:
        yield b


@pytest.fixture(scope="module")
def proxied(backend) -> Proc:
    proc = start_proxy(backend.url, None, None, "--no-scoring")
    yield proc
    proc.stop()


def client(base_url: str):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def chat_tool_choice(mode: str) -> Any:
    return {"type": "function", "function": {"name": "celsius_to_fahrenheit"}} if mode == "named" else mode


def chat_answer(base_url: str, mode: str, stream: bool) -> tuple[str | None, list[tuple[str, str]], str]:
    """(text, [(name, arguments)], finish_reason) from the chat API, assembled from the stream if streamed."""
    c = client(base_url)
    kwargs = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                  tool_choice=chat_tool_choice(mode), max_tokens=48, temperature=0)
    if not stream:
        r = c.chat.completions.create(**kwargs)
        m = r.choices[0].message
        return m.content, [(t.function.name, t.function.arguments) for t in m.tool_calls or []], \
            r.choices[0].finish_reason
    text, calls, finish = [], {}, None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.content:
            text.append(d.content)
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function and tc.function.name:
                assert tc.id, "the first delta of a tool call carries its id"
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return ("".join(text) or None), [(v["name"], v["arguments"]) for _, v in sorted(calls.items())], finish


def responses_answer(base_url: str, mode: str, stream: bool) -> tuple[str | None, list[tuple[str, str]], str]:
    c = client(base_url)
    choice = {"type": "function", "name": "celsius_to_fahrenheit"} if mode == "named" else mode
    kwargs = dict(model="smollm2-135m-instruct", input=QUESTION, tools=RESP_TOOLS, tool_choice=choice,
                  max_output_tokens=48, temperature=0)
    if not stream:
        r = c.responses.create(**kwargs)
    else:
        kinds, r, args_deltas = [], None, {}
        for event in c.responses.create(stream=True, **kwargs):
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args_deltas[event.item_id] = args_deltas.get(event.item_id, "") + event.delta
            if event.type in ("response.completed", "response.incomplete"):
                r = event.response
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        for item in r.output:
            if item.type == "function_call":
                assert args_deltas[item.id] == item.arguments, "the deltas add up to the final arguments"
    calls = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    texts = [p.text for i in r.output if i.type == "message" for p in i.content if p.type == "output_text"]
    return ("".join(texts) or None), calls, r.status


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_each_tool_choice_mode_gives_the_shape_it_promises(backend, api, mode, stream):
    answer = chat_answer if api == "chat" else responses_answer
    text, calls, finish = answer(backend.api_url, mode, stream)
    for name, arguments in calls:
        check_call(name, arguments)  # valid JSON that fits the tool's schema
    if mode == "none":
        assert calls == [] and text, "tool_choice none never calls"
    elif mode == "named":
        assert [n for n, _ in calls] == ["celsius_to_fahrenheit"] and not text
    elif mode == "required":
        assert len(calls) == 1 and not text  # parallel_tool_calls not asked for: one call
    else:
        assert bool(calls) != bool(text), "auto: a call or a text reply, decided by the model"
    if api == "chat" and calls:
        assert finish == "tool_calls"


def test_parallel_tool_calls_false_caps_required_at_one_call_and_true_allows_more(backend):
    c = client(backend.api_url)
    msgs = [{"role": "user", "content": "Get the weather in Paris and in Rome."}]
    one = c.chat.completions.create(model=backend.model, messages=msgs, tools=CHAT_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert len(one.choices[0].message.tool_calls) == 1
    many = c.chat.completions.create(model=backend.model, messages=msgs, tools=CHAT_TOOLS, tool_choice="required",
                                     parallel_tool_calls=True, max_tokens=64, temperature=0)
    calls = many.choices[0].message.tool_calls or []
    assert calls, many.choices[0]
    for tc in calls[:-1] if many.choices[0].finish_reason == "length" else calls:
        check_call(tc.function.name, tc.function.arguments)


def test_every_message_shape_frameworks_send_is_accepted(backend):
    """content null after a tool call, content parts, developer role, tool results, legacy function messages."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": '{"celsius": 18}'}]},
        {"role": "assistant", "content": "", "function_call": {"name": "celsius_to_fahrenheit",
                                                               "arguments": '{"celsius": 18}'}},
        {"role": "function", "name": "celsius_to_fahrenheit", "content": '{"fahrenheit": 64.4}'},
    ]
    r = httpx.post(f"{backend.api_url}/chat/completions", timeout=120,
                   json={"model": backend.model, "messages": messages, "tools": CHAT_TOOLS, "max_tokens": 32})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    items = [{"role": "system", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": '{"celsius": 18}'},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    r = httpx.post(f"{backend.api_url}/responses", timeout=120,
                   json={"model": backend.model, "input": items, "tools": RESP_TOOLS, "max_output_tokens": 32})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response" and r.json()["output"]


@pytest.mark.parametrize("path,body,status,code", [
    ("/chat/completions", {"messages": []}, 400, "invalid_value"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS,
                           "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "invalid_value"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     400, "invalid_value"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_value"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "invalid_value"),
    ("/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400, "unsupported_parameter"),
    ("/nothing", {}, 404, "not_found"),
])
def test_bad_requests_get_openai_shaped_errors(backend, path, body, status, code):
    r = httpx.post(f"{backend.api_url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"


def test_invalid_json_is_a_400(backend):
    r = httpx.post(f"{backend.api_url}/chat/completions", content=b"{nope", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_models_and_vllm_shaped_tokenize(backend):
    models = httpx.get(f"{backend.api_url}/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [backend.model]
    short = httpx.post(f"{backend.url}/tokenize", json={"model": backend.model, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=10).json()
    longer = httpx.post(f"{backend.url}/tokenize", json={"model": backend.model, "tools": CHAT_TOOLS, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=10).json()
    assert short["count"] == len(short["tokens"]) > 0 and short["max_model_len"] == 4096
    assert longer["count"] > short["count"] + 50  # the tools are part of what the model reads
    text = httpx.post(f"{backend.url}/detokenize", json={"tokens": short["tokens"]}, timeout=10).json()["prompt"]
    assert "hi" in text
    n = httpx.post(f"{backend.url}/extras/tokenize/count", json={"input": "hello world"}, timeout=10).json()["count"]
    assert n == len(httpx.post(f"{backend.url}/tokenize", json={"prompt": "hello world"}).json()["tokens"])


def test_the_proxy_counts_tokens_with_the_backend_tokenizer(backend):
    from toolquake.perturbers.helpers.tokens import UpstreamCounter

    counter = UpstreamCounter(backend.api_url)
    few = counter.count_request({"messages": [{"role": "user", "content": "hi"}]})
    more = counter.count_request({"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS})
    assert 0 < few < more


def test_greedy_answers_are_reproducible_at_temperature_zero(backend):
    body = {"model": backend.model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 16,
            "temperature": 0}
    a = httpx.post(f"{backend.api_url}/chat/completions", json=body, timeout=60).json()
    b = httpx.post(f"{backend.api_url}/chat/completions", json=body, timeout=60).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] != ""


def test_usage_says_how_many_prompt_tokens_were_not_evaluated_again(backend):
    """The second of two requests with the same tools starts from what the first evaluated: `cached_tokens` in
    the usage of both APIs (OpenAI's fields), whole blocks, fewer than the prompt."""
    from toolquake.proxy.backend.prompt_cache import BLOCK

    def chat(question: str) -> dict[str, Any]:
        body = {"model": backend.model, "messages": [{"role": "user", "content": question}], "tools": CHAT_TOOLS,
                "max_tokens": 8, "temperature": 0}
        return httpx.post(f"{backend.api_url}/chat/completions", json=body, timeout=60).json()["usage"]

    chat("What is the temperature in Oslo?")
    usage = chat("What is the temperature in Lima?")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert BLOCK <= cached < usage["prompt_tokens"] and cached % BLOCK == 0, usage
    body = {"model": backend.model, "input": "What is the temperature in Quito?", "tools": RESP_TOOLS,
            "max_output_tokens": 8, "temperature": 0}
    usage = httpx.post(f"{backend.api_url}/responses", json=body, timeout=60).json()["usage"]
    assert BLOCK <= usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"], usage


def chat_loop(base_url: str) -> tuple[list[str], str]:
    """The raw openai SDK running a two-tool agent loop: (tools called, final answer)."""
    c = client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    called = []
    for _ in range(6):
        r = c.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=CHAT_TOOLS,
                                      max_tokens=64, temperature=0)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True) | {"content": m.content})  # content: null, as agents send
        if not m.tool_calls:
            return called, m.content
        for tc in m.tool_calls:
            called.append(tc.function.name)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": run_tool(tc.function.name,
                                                                                        tc.function.arguments)})
    pytest.fail(f"no final answer after 6 turns; calls: {called}")


def responses_loop(base_url: str) -> tuple[list[str], str]:
    c = client(base_url)
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    called = []
    for _ in range(6):
        r = c.responses.create(model="smollm2-135m-instruct", input=items, tools=RESP_TOOLS, max_output_tokens=64,
                               temperature=0)
        calls = [i for i in r.output if i.type == "function_call"]
        if not calls:
            return called, r.output_text
        for call in calls:
            called.append(call.name)
            items.append({"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments})
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": run_tool(call.name, call.arguments)})
    pytest.fail(f"no final answer after 6 turns; calls: {called}")


@pytest.mark.parametrize("via", ["direct", "proxy"])
@pytest.mark.parametrize("loop", [chat_loop, responses_loop], ids=["chat", "responses"])
def test_openai_sdk_agent_loop_ends_with_a_final_answer(backend, proxied, loop, via):
    base = backend.api_url if via == "direct" else f"{proxied.url}/v1"
    called, final = loop(base)
    assert called and set(called) <= set(SCHEMAS), called
    assert isinstance(final, str) and final.strip()
