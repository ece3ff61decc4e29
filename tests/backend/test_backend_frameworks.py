"""Agent frameworks run their own two-tool loops to a final answer against the real embedded model
(SmolLM2-135M under the grammar), directly and through the proxy: the OpenAI Agents SDK, LangGraph's ReAct
agent (LangChain's ChatOpenAI) and Pydantic AI, on chat completions and the Responses API.

Assertions: the model called at least one tool (run by the framework with arguments that fit its signature),
only the two offered, and the loop ended with a non-empty text answer. What the 135M model answers is not
judged. One model load for the module.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support import start_proxy
from tests.support.backend import MODEL

pytestmark = [pytest.mark.slow, *MODEL]

QUESTION = "What is the temperature in Paris in Fahrenheit?"
INSTRUCTIONS = "Use the tools, then answer the user."


class Ran:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def weather(self, city: str) -> str:
        self.calls.append("get_weather")
        return f"18 degrees Celsius in {city}"

    def convert(self, celsius: float) -> str:
        self.calls.append("celsius_to_fahrenheit")
        return f"{float(celsius) * 9 / 5 + 32:.1f} degrees Fahrenheit"


@pytest.fixture(scope="module")
def backend():
    from toolquake.proxy.backend.local import LocalBackend

    with LocalBackend(n_ctx=4096, max_tokens=64) as b:
        yield b


@pytest.fixture(scope="module")
def proxied(backend):
    proc = start_proxy(backend.url, None, None, "--no-scoring")
    yield proc
    proc.stop()


def base_url(backend, proxied, via: str) -> str:
    return backend.api_url if via == "direct" else f"{proxied.url}/v1"


def check(ran: Ran, final: object) -> None:
    assert isinstance(final, str) and final.strip(), final
    assert ran.calls, "the model called no tool: the loop never ran"
    assert set(ran.calls) <= {"get_weather", "celsius_to_fahrenheit"}, ran.calls


VIAS = ["direct", "proxy"]
APIS = ["chat", "responses"]


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("api", APIS)
def test_openai_agents_sdk_loop_ends_with_a_final_answer(backend, proxied, api, via):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = Ran()
    client = AsyncOpenAI(base_url=base_url(backend, proxied, via), api_key="none", max_retries=0)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
        model=backend.model, openai_client=client)

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current temperature in a city, in Celsius."""
        return ran.weather(city)

    @function_tool
    def celsius_to_fahrenheit(celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        return ran.convert(celsius)

    agent = Agent(name="assistant", instructions=INSTRUCTIONS, model=model, tools=[get_weather, celsius_to_fahrenheit],
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=8))
    check(ran, result.final_output)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_langgraph_react_agent_loop_ends_with_a_final_answer(backend, proxied, api, via, stream):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    ran = Ran()

    @tool
    def get_weather(city: str) -> str:
        """Get the current temperature in a city, in Celsius."""
        return ran.weather(city)

    @tool
    def celsius_to_fahrenheit(celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        return ran.convert(celsius)

    llm = ChatOpenAI(model=backend.model, base_url=base_url(backend, proxied, via), api_key="none", temperature=0,
                     max_tokens=64, use_responses_api=api == "responses", streaming=stream, max_retries=0)
    graph = create_react_agent(llm, [get_weather, celsius_to_fahrenheit])
    out = graph.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 16})
    final = out["messages"][-1]
    assert not getattr(final, "tool_calls", None)
    check(ran, final.content if isinstance(final.content, str) else final.text)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("api", APIS)
def test_pydantic_ai_agent_loop_ends_with_a_final_answer(backend, proxied, api, via):
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    ran = Ran()
    client = AsyncOpenAI(base_url=base_url(backend, proxied, via), api_key="none", max_retries=0)
    provider = OpenAIProvider(openai_client=client)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatModel)(backend.model, provider=provider)
    agent = Agent(model, instructions=INSTRUCTIONS, model_settings=ModelSettings(temperature=0, max_tokens=64))

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current temperature in a city, in Celsius."""
        return ran.weather(city)

    @agent.tool_plain
    def celsius_to_fahrenheit(celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit."""
        return ran.convert(celsius)

    result = agent.run_sync(QUESTION)
    check(ran, result.output)
