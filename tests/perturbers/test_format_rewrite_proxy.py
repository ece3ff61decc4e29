"""format_rewrite end to end: the `openai` SDK → `toolquake serve` → the fake upstream answering in text."""

from __future__ import annotations

import json
import uuid
from typing import Any

import openai
import pytest

from tests.support import Proc, recorded
from tests.support.llama_server import start_llama_server
from toolquake.perturbers.helpers.callformat_render import render_calls

CONFIG = """
[profiles.fmt-python]
mode = "perturb"
perturbers = [{ name = "format_rewrite" }]

[profiles.fmt-xml-tag]
mode = "perturb"
perturbers = [{ name = "format_rewrite", params = { return_format = "verbose_xml", function_doc_format = "xml", tool_call_tag = true, parse = "lenient" } }]

[profiles.fmt-json-md]
mode = "perturb"
perturbers = [{ name = "format_rewrite", params = { return_format = "json", function_doc_format = "python", prompt_format = "markdown", prompt_style = "experimental" } }]
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name."},
                    "days": {"type": "integer", "description": "Days ahead."},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": {"city": "Tokyo"}},
]
MESSAGES = [
    {"role": "system", "content": "You are a travel agent."},
    {"role": "user", "content": "Weather in Paris for 3 days, and the time in Tokyo?"},
]


@pytest.fixture(scope="module")
def fmt_proxy(fake_upstream: Proc) -> Proc:
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG)
    yield proc
    proc.stop()


def client(proxy: Proc, profile: str, answer_text: str, tag: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy.url}/p/{profile}/v1",
        api_key="k",
        default_headers={"X-Fake-Answer": json.dumps({"text": answer_text}), "X-Test-Tag": tag},
    )


def upstream_body(fake: Proc, tag: str) -> dict[str, Any]:
    (req,) = [r for r in recorded(fake, tag) if r["method"] == "POST"]
    return json.loads(req["body"])


def streamed(chunks: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Reassemble what an SDK stream delivered: content, tool calls by index, finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "profile,fmt,tag_on",
    [("fmt-python", "python", False), ("fmt-xml-tag", "verbose_xml", True), ("fmt-json-md", "json", False)],
)
def test_sdk_client_gets_tool_calls_while_upstream_got_only_text_instructions(
    fmt_proxy, fake_upstream, profile, fmt, tag_on
):
    tag = uuid.uuid4().hex
    answer = render_calls(CALLS, fmt, tag_on)
    resp = client(fmt_proxy, profile, answer, tag).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, tool_choice="auto"
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls] == [
        (c["name"], c["arguments"]) for c in CALLS
    ]
    assert all(tc.id and tc.type == "function" for tc in choice.message.tool_calls)
    sent = upstream_body(fake_upstream, tag)
    assert "tools" not in sent and "tool_choice" not in sent
    system = sent["messages"][0]
    assert system["role"] == "system" and system["content"].endswith("\n\nYou are a travel agent.")
    assert "Weather forecast for a city." in system["content"] and "get_time" in system["content"]
    assert sent["messages"][1:] == MESSAGES[1:]


def test_streaming_client_gets_tool_call_deltas_and_done(fmt_proxy, fake_upstream):
    tag = uuid.uuid4().hex
    stream = client(fmt_proxy, "fmt-xml-tag", render_calls(CALLS, "verbose_xml", True), tag).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, stream=True
    )
    content, calls, finish = streamed(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(c["name"], c["arguments"]) for c in CALLS]
    assert all(c["id"] for c in calls)
    assert upstream_body(fake_upstream, tag)["stream"] is True


def test_undecodable_answer_reaches_the_client_as_text_streamed_or_not(fmt_proxy):
    text = "Which city do you mean?"
    resp = client(fmt_proxy, "fmt-python", text, uuid.uuid4().hex).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    assert resp.choices[0].message.content == text and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"
    stream = client(fmt_proxy, "fmt-python", text, uuid.uuid4().hex).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, stream=True
    )
    assert streamed(stream) == (text, [], "stop")


def test_lenient_profile_recovers_calls_each_wrapped_in_their_own_tags(fmt_proxy):
    per_call = "\n".join(render_calls([c], "verbose_xml", True) for c in CALLS)
    resp = client(fmt_proxy, "fmt-xml-tag", per_call, uuid.uuid4().hex).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    assert [tc.function.name for tc in resp.choices[0].message.tool_calls] == ["get_weather", "get_time"]


def test_a_multi_step_conversation_keeps_working(fmt_proxy, fake_upstream):
    """Second step: the agent sends back the calls it got and the tool results; the upstream sees them as text."""
    tag = uuid.uuid4().hex
    first = client(fmt_proxy, "fmt-python", render_calls(CALLS, "python"), tag).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS
    )
    calls = first.choices[0].message.tool_calls
    history = (
        MESSAGES
        + [first.choices[0].message.model_dump(exclude_none=True)]
        + [
            {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"},
            {"role": "tool", "tool_call_id": calls[1].id, "content": "09:00"},
        ]
    )
    tag2 = uuid.uuid4().hex
    second = client(
        fmt_proxy, "fmt-python", "It will rain in Paris; it is 9 am in Tokyo.", tag2
    ).chat.completions.create(model="fake-model", messages=history, tools=TOOLS)
    assert second.choices[0].message.content.startswith("It will rain")
    sent = upstream_body(fake_upstream, tag2)["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[2]["content"] == "[get_weather(city='Paris', days=3), get_time(city='Tokyo')]"
    assert sent[3]["content"] == repr(
        [
            {"role": "tool", "name": "get_weather(city='Paris', days=3)", "content": "rain"},
            {"role": "tool", "name": "get_time(city='Tokyo')", "content": "09:00"},
        ]
    )


@pytest.mark.needs_corpus
def test_a_bfcl_case_shows_dotted_names_upstream_and_the_client_gets_its_own_names(fmt_proxy, fake_upstream):
    from toolquake.bfcl import corpus

    body = corpus.case_request(corpus.load_case("multiple_0"), model="fake-model")
    tag = uuid.uuid4().hex
    c = openai.OpenAI(
        base_url=f"{fmt_proxy.url}/p/fmt-python/v1",
        api_key="k",
        default_headers={
            "X-Fake-Answer": json.dumps({"text": "[triangle_properties.get(side1=5, side2=4, side3=3)]"}),
            "X-Test-Tag": tag,
            "X-Toolquake-Case": "multiple_0",
        },
    )
    resp = c.chat.completions.create(**body)
    (tc,) = resp.choices[0].message.tool_calls
    assert tc.function.name == "triangle_properties_get" == body["tools"][0]["function"]["name"]
    assert json.loads(tc.function.arguments) == {"side1": 5, "side2": 4, "side3": 3}
    sent = upstream_body(fake_upstream, tag)
    assert '"name": "triangle_properties.get"' in sent["messages"][0]["content"]
    assert "triangle_properties_get" not in sent["messages"][0]["content"]


@pytest.mark.slow
@pytest.mark.model
def test_a_real_model_answers_in_text_and_the_client_gets_a_valid_openai_answer(proxy_factory) -> None:
    """SmolLM2-135M behind llama.cpp's OpenAI server, prompted by format_rewrite (python calls). The
    model is tiny: whatever it writes must reach the client as valid tool_calls or as text, streamed
    or not, and greedy decoding makes the streamed answer decode the same way as the plain one. Asked
    to repeat a call, it does (on the machines this was written on), so the tool_calls path runs."""
    server = start_llama_server(4096)
    try:
        proxy = proxy_factory(CONFIG, None, server.url)
        sdk = openai.OpenAI(base_url=f"{proxy.url}/p/fmt-python/v1", api_key="k", timeout=300)
        ask = [{"role": "user", "content": "Repeat exactly, with nothing else: [get_time(city='Tokyo')]"}]
        args = dict(model="smollm2", messages=ask, tools=TOOLS, temperature=0, max_tokens=48, seed=1)
        plain = sdk.chat.completions.create(**args)
        content, calls, finish = streamed(sdk.chat.completions.create(**args, stream=True))
    finally:
        server.stop()
    message = plain.choices[0].message
    if message.tool_calls:
        assert plain.choices[0].finish_reason == "tool_calls" and message.content is None
        for tc in message.tool_calls:
            assert tc.id and isinstance(json.loads(tc.function.arguments), dict)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (tc.function.name, json.loads(tc.function.arguments)) for tc in message.tool_calls
        ]
        assert finish == "tool_calls"
    else:
        assert isinstance(message.content, str) and plain.choices[0].finish_reason in ("stop", "length")
        assert (content, calls) == (message.content, [])
        assert finish == plain.choices[0].finish_reason
