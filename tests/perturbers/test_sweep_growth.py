"""The sweep's axes grow prefix-stably: with the same seed, the content at a larger intensity holds the content at a
smaller one — the same additions, in the same order, grown — for every axis a perturber declares
(`Perturber.numeric_axes`), so that a breaking point is a property of what the model saw."""

from __future__ import annotations

import json
import random

import pytest

from toolquake.perturbers import build, registry
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.tokens import EstimateCounter

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name, desc in (("get_weather", "Current weather of a city."), ("get_time", "Local time in a city."))]


@pytest.fixture(scope="module")
def services() -> Services:
    return Services(token_counter=EstimateCounter())


def _apply(services: Services, axis: str, x: int, request: ChatRequest, seed: int = 7,
           extra: dict | None = None) -> tuple[ChatRequest, dict]:
    """The perturber of `axis` at intensity x, as the sweep builds it (its declared fixed parameters included)."""
    name, decl = next((n, c.numeric_axes[axis]) for n, c in registry().items() if axis in c.numeric_axes)
    step = build(name, {**decl.fixed, decl.param: x, **(extra or {})})
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:{name}"), services=services)
    return step.apply(request, ctx), ctx.report


def _names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def test_every_named_axis_is_declared():
    declared = {a for c in registry().values() for a in c.numeric_axes}
    assert {"tools", "related", "response_tokens", "conversation_tokens"} <= declared


@pytest.mark.parametrize("position", [0.0, 0.3, 1.0])
def test_tools_axis_keeps_the_distractors_of_fewer_tools_in_order(services, position):
    request = ChatRequest({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS})
    lists = {}
    for x in (3, 10, 41, 120):
        out, report = _apply(services, "tools", x, request, extra={"position": position})
        names = _names(out.tools)
        assert len(names) == x == report["tools_after"]
        at = names.index("get_weather")
        assert names[at:at + 2] == ["get_weather", "get_time"]  # the originals together, in their order
        assert at == round(position * (x - 2))  # at the fixed relative position among the distractors
        lists[x] = names[:at] + names[at + 2:]
    for small, large in ((3, 10), (10, 41), (41, 120)):
        assert lists[large][:len(lists[small])] == lists[small]  # a prefix: the same distractors, grown


def test_related_axis_adds_to_the_tools_of_a_smaller_k(services):
    request = ChatRequest({"messages": [{"role": "user", "content": "What is the weather in Paris now?"}],
                           "tools": TOOLS})
    lists = {k: _names(_apply(services, "related", k, request)[0].tools) for k in (1, 3, 6)}
    for small, large in ((1, 3), (3, 6)):
        kept = [n for n in lists[large] if n in set(lists[small])]
        assert kept == lists[small]  # every tool of the smaller k, in the same order among the larger k's
        assert len(lists[large]) == len(lists[small]) + large - small


def test_response_tokens_axis_keeps_the_records_of_a_smaller_budget_first(services):
    records = [{"id": i, "city": c, "temp_c": t} for i, (c, t) in enumerate([("Lyon", 11), ("Nice", 17)])]
    request = ChatRequest({"messages": [
        {"role": "user", "content": "Weather records for France, please."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "list_weather",
                                                                              "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"records": records})},
        {"role": "user", "content": "And Paris?"}], "tools": TOOLS})
    grown = {}
    for x in (100, 400, 1500):
        out, report = _apply(services, "response_tokens", x, request)
        content = out.messages[2]["content"]
        assert EstimateCounter().count_text(content) == report["tokens_total"]
        assert abs(report["tokens_total"] - x) < 40  # the response's own tokens, near the budget
        grown[x] = json.loads(content)["records"]
        assert grown[x][:2] == records  # the originals first (position 1)
    for small, large in ((100, 400), (400, 1500)):
        assert grown[large][:len(grown[small])] == grown[small]


def test_conversation_tokens_axis_keeps_the_turns_of_a_smaller_budget_first(services):
    request = ChatRequest({"messages": [{"role": "system", "content": "You help with the weather."},
                                        {"role": "user", "content": "I am in Paris."},
                                        {"role": "assistant", "content": "Noted."},
                                        {"role": "user", "content": "What is the weather where I am?"}],
                           "tools": TOOLS})
    grown = {}
    for x in (1500, 4000, 9000):
        out, report = _apply(services, "conversation_tokens", x, request)
        assert report["turns_added"] > 0 and abs(report["tokens_total"] - x) < 0.5 * x  # whole turns: near x
        messages = out.messages
        assert messages[:3] == request.messages[:3] and messages[-1] == request.messages[-1]
        grown[x] = messages[3:-1]
    for small, large in ((1500, 4000), (4000, 9000)):
        assert len(grown[small]) < len(grown[large])
        assert grown[large][:len(grown[small])] == grown[small]
