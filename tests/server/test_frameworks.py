"""Real agent frameworks that only change their base_url: a two-tool loop to a final answer through the proxy.

The model is the fake upstream's scripted agent (`X-Fake-Agent: get_weather,get_time`: call the first
tool, then the second after its result, then answer with both results). The frameworks run their own
loops (tool dispatch, tool results sent back) on chat completions and on the Responses API, streamed
and not, through the default profile, `shuffled`, an invented-tool profile (the proxy answers the
model's call to a tool it added), `format-python` (no native tools upstream) and a shadow profile.
Assertions: the loop ended with the final answer quoting both tool results, each tool ran once, and
what the upstream received carried the perturbation on every turn.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from tests.support import recorded

PLAN = "get_weather,get_time"
ADDED = "zz_lookup_archive"  # the tool tests/plugins/adds_tool.py adds
CONFIG = """
[server]
plugins = ["tests.plugins.adds_tool"]

[profiles.shuffled]
perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]

[profiles.invented]
perturbers = [{ name = "test_adds_tool" }]

[profiles.format-python]
perturbers = [{ name = "format_rewrite", params = { return_format = "python", function_doc_format = "json" } }]

[profiles.shadowed]
mode = "shadow"
perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]
"""
PROFILES = ["off", "shuffled", "invented", "format-python", "shadowed"]


@pytest.fixture(scope="module")
def tq(fake_upstream):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG, None, "--results-db", "off")
    yield proc
    proc.stop()


class Ran:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def weather(self, city: str) -> str:
        self.calls.append(("get_weather", city))
        return f"rain in {city}"

    def time(self, city: str) -> str:
        self.calls.append(("get_time", city))
        return f"9:00 in {city}"


def tool_orders(fake, t: str) -> list[list[str]]:
    sent = [json.loads(r["body"]) for r in recorded(fake, t) if r["method"] == "POST"]
    return [[(tool.get("function") or tool).get("name") for tool in body.get("tools") or []] for body in sent]


def calls_made(body: dict) -> list[str]:
    """Names of the calls already in a request's conversation (chat tool_calls, Responses function_call items)."""
    chat = [c["function"]["name"] for m in body.get("messages") or [] for c in m.get("tool_calls") or []]
    items = body.get("input") if isinstance(body.get("input"), list) else []
    return chat + [i.get("name") for i in items if isinstance(i, dict) and i.get("type") == "function_call"]


def check(fake, t: str, ran: Ran, final: str, profile: str) -> None:
    assert [name for name, _ in ran.calls] == ["get_weather", "get_time"], ran.calls
    assert "rain in" in final and "9:00 in" in final, final
    orders = tool_orders(fake, t)
    assert len(orders) >= 3  # three model turns (more under shadow: the twins)
    expected = {"off": [["get_weather", "get_time"]], "shuffled": [["get_time", "get_weather"]],
                "invented": [["zz_lookup_archive", "get_weather", "get_time"]], "format-python": [[]],
                "shadowed": [["get_weather", "get_time"], ["get_time", "get_weather"]]}[profile]
    assert all(order in expected for order in orders), orders
    if profile == "invented":  # each of the three turns: the call to the added tool, then the proxy's follow-up
        bodies = [json.loads(r["body"]) for r in recorded(fake, t) if r["method"] == "POST"]
        follow_ups = [b for b in bodies if ADDED in calls_made(b)]
        assert len(follow_ups) >= 3, [calls_made(b) for b in bodies]
    if profile == "shadowed":  # the client's turns unperturbed; the twins, sent after the fact, reversed
        deadline = time.monotonic() + 10
        while ["get_time", "get_weather"] not in orders and time.monotonic() < deadline:
            time.sleep(0.1)
            orders = tool_orders(fake, t)
        assert ["get_time", "get_weather"] in orders and ["get_weather", "get_time"] in orders


def headers(t: str, profile: str = "off") -> dict[str, str]:
    # under `invented` the model calls the tool the proxy added first, at every turn: the proxy answers those
    # calls itself (injected_calls = "answer"), so the framework only ever sees calls to its own tools
    plan = f"{ADDED},{PLAN}" if profile == "invented" else PLAN
    return {"x-test-tag": t, "x-fake-agent": plan}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_loop_completes(tq, fake_upstream, profile, api):
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    t, ran = uuid.uuid4().hex, Ran()
    client = AsyncOpenAI(base_url=f"{tq.url}/p/{profile}/v1", api_key="sk-test", default_headers=headers(t, profile))
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
        model="fake-model", openai_client=client)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return ran.weather(city)

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        return ran.time(city)

    agent = Agent(name="assistant", instructions="Answer with the tools.", model=model, tools=[get_weather, get_time])
    result = asyncio.run(Runner.run(agent, "Weather and time in Oslo?"))
    check(fake_upstream, t, ran, str(result.final_output), profile)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_langgraph_react_agent_loop_completes(tq, fake_upstream, profile, api, stream):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    t, ran = uuid.uuid4().hex, Ran()

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return ran.weather(city)

    @tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        return ran.time(city)

    llm = ChatOpenAI(model="fake-model", base_url=f"{tq.url}/p/{profile}/v1", api_key="sk-test",
                     default_headers=headers(t, profile), use_responses_api=api == "responses", streaming=stream)
    graph = create_react_agent(llm, [get_weather, get_time])
    out = graph.invoke({"messages": [("user", "Weather and time in Oslo?")]})
    final = out["messages"][-1].content
    check(fake_upstream, t, ran, final if isinstance(final, str) else json.dumps(final), profile)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_agent_loop_completes(tq, fake_upstream, profile, api):
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    t, ran = uuid.uuid4().hex, Ran()
    client = AsyncOpenAI(base_url=f"{tq.url}/p/{profile}/v1", api_key="sk-test", default_headers=headers(t, profile))
    provider = OpenAIProvider(openai_client=client)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatModel)("fake-model", provider=provider)
    agent = Agent(model, instructions="Answer with the tools.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return ran.weather(city)

    @agent.tool_plain
    def get_time(city: str) -> str:
        """The local time in a city."""
        return ran.time(city)

    result = agent.run_sync("Weather and time in Oslo?")
    check(fake_upstream, t, ran, str(result.output), profile)
