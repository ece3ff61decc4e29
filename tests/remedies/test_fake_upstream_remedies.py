"""The fake upstream's remedy modes (`--hidden-tools`, `--needle`): the backends the remedies' end-to-end tests run
against, asked directly with the OpenAI SDK; and each remedy's request (applied in-process) winning its answer back
from them."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.fake_upstream import LOST_TEXT
from tests.support import Proc, start_fake_upstream
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.remedies import build

pytestmark = pytest.mark.processes

RIGHT = {"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
NEEDLE = "station-7731 reads -4 C"


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder: Path = tmp_path_factory.mktemp("remedy-fake")
    hidden = folder / "hidden.jsonl"
    hidden.write_text(json.dumps({"match": "weather in Oslo", "answer": RIGHT, "max_tools": 4}) + "\n")
    needle = folder / "needle.jsonl"
    needle.write_text(json.dumps({"match": "station 7731", "answer": RIGHT, "needle": NEEDLE,
                                  "within_tokens": 200}) + "\n")
    proc = start_fake_upstream("--hidden-tools", str(hidden), "--needle", str(needle))
    yield proc
    proc.stop()


def ask(fake: Proc, **body) -> openai.types.chat.ChatCompletionMessage:
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model="m", **body).choices[0].message


def test_hidden_tools_right_only_within_its_number_of_tools_and_with_the_tool_offered(fake):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    few = [tool("get_weather")] + [tool(f"other_{i}") for i in range(3)]
    right = ask(fake, messages=messages, tools=few)
    assert right.tool_calls[0].function.name == "get_weather"
    assert json.loads(right.tool_calls[0].function.arguments) == {"city": "Oslo"}
    many = ask(fake, messages=messages, tools=few + [tool("other_9")])
    assert many.tool_calls is None and many.content == LOST_TEXT
    dropped = ask(fake, messages=messages, tools=[tool(f"other_{i}") for i in range(3)])
    assert dropped.tool_calls is None and dropped.content == LOST_TEXT


def test_needle_right_only_within_the_first_tokens_of_the_last_tool_message(fake):
    def conversation(content: str) -> list[dict]:
        return [{"role": "user", "content": "What does station 7731 read?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": content}]

    near = ask(fake, messages=conversation(f"{NEEDLE}\n" + "filler line\n" * 500), tools=[tool("get_weather")])
    assert near.tool_calls[0].function.name == "get_weather"
    far = ask(fake, messages=conversation("filler line\n" * 500 + NEEDLE), tools=[tool("get_weather")])
    assert far.tool_calls is None and far.content == LOST_TEXT
    absent = ask(fake, messages=conversation("filler line\n" * 5), tools=[tool("get_weather")])
    assert absent.content == LOST_TEXT


def remedied(name: str, params: dict, body: dict) -> dict:
    ctx = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=Services())
    return build(name, params).apply(ChatRequest(body), ctx).body


def test_tool_search_wins_back_the_hidden_tools_answer(fake):
    body = {"messages": [{"role": "user", "content": "What is the weather in Oslo today?"}],
            "tools": [tool(f"lookup_{i}") for i in range(30)] + [tool("get_weather")] + [tool("x") for _ in range(9)]}
    assert ask(fake, **body).content == LOST_TEXT
    sent = remedied("tool_search", {"k": 4, "method": "bm25"}, body)
    assert len(sent["tools"]) == 4
    assert ask(fake, **sent).tool_calls[0].function.name == "get_weather"


def test_response_trim_wins_back_the_needle_answer(fake):
    lines = [f"station-{i} reads {i % 20} C" for i in range(3000)]
    lines[2400] = NEEDLE
    body = {"messages": [{"role": "user", "content": "What does station 7731 read?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "\n".join(lines)}],
            "tools": [tool("get_weather")]}
    assert ask(fake, **body).content == LOST_TEXT
    sent = remedied("response_trim", {"budget_tokens": 150}, body)
    assert ask(fake, **sent).tool_calls[0].function.name == "get_weather"
