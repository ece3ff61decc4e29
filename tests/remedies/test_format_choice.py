"""format_choice, in-process: the configuration named three ways and checked at load, the tools rendered as
format_rewrite renders them, a text answer in that format restored into tool_calls, the decodes for grading."""

from __future__ import annotations

import json
import random
import tomllib
from typing import Any

import pytest

from tests.support import ROOT
from toolquake.perturbers import build as build_perturber
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.callformat_render import render_calls
from toolquake.perturbers.helpers.callformats import CONFIGURATIONS
from toolquake.remedies import build
from toolquake.remedies.format_choice import ARM_IDS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
BODY = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Weather in Oslo for 3 days?"}],
        "tools": [WEATHER]}


def ctx() -> PerturbContext:
    return PerturbContext(perturbation_seed=5, rng=random.Random(5), services=Services())


def test_the_arm_ids_are_seed002s_profiles():
    profiles = tomllib.loads((ROOT / "proxy" / "profiles.toml").read_text())["profiles"]
    assert sorted(ARM_IDS) == sorted(n for n in profiles if n.startswith("fmt-"))
    for name, fmt in ARM_IDS.items():
        params = profiles[name]["perturbers"][0]["params"]
        assert all(getattr(fmt, key) == value for key, value in params.items() if key != "parse"), name


@pytest.mark.parametrize("config", ["fmt-14-vxml-tag-xml", "14", CONFIGURATIONS[13].config_string])
def test_named_by_arm_number_or_string_it_renders_as_format_rewrite_does(config):
    remedy, c1 = build("format_choice", {"config": config}), ctx()
    fmt = CONFIGURATIONS[13]
    rewrite, c2 = build_perturber("format_rewrite", {
        "return_format": fmt.return_format, "function_doc_format": fmt.function_doc_format,
        "tool_call_tag": fmt.tool_call_tag, "prompt_format": fmt.prompt_format,
        "prompt_style": fmt.prompt_style}), ctx()
    ours, theirs = remedy.apply(ChatRequest(BODY), c1), rewrite.apply(ChatRequest(BODY), c2)
    assert ours.body == theirs.body and "tools" not in ours.body
    assert c1.report["config"] == fmt.config_string


@pytest.mark.parametrize("config", ["27", "fmt-99-python", "", "ret_fmt=json&tool_call_tag=True&func_doc_fmt=json"
                                    "&prompt_fmt=markdown&style=classic"])
def test_a_configuration_outside_the_26_is_refused_at_load(config):
    with pytest.raises(ValueError):
        build("format_choice", {"config": config})


def answer(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("number", [1, 6, 9, 16, 24, 26])
def test_a_text_answer_in_that_format_comes_back_as_tool_calls(number):
    fmt = CONFIGURATIONS[number - 1]
    remedy, c = build("format_choice", {"config": str(number)}), ctx()
    remedy.apply(ChatRequest(BODY), c)
    text = render_calls([{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}], fmt.return_format,
                        fmt.tool_call_tag)
    restored = remedy.restore(answer(text), c)
    choice = restored["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    strict, lenient = remedy.answer_decodes(c)
    assert strict.ok and strict.calls == [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]
    assert type(remedy).affects_grading()
    assert remedy.stream_release("Let me check. ", c) == len("Let me check. ")
