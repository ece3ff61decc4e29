"""The embedded server's request handling without the model: schemas per tool_choice, BFCL schema
sanitising, answer decoding, both APIs' messages into one prompt. The grammars are compiled by llama.cpp's
own converter when it is installed (the model is never loaded)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from toolquake.proxy.backend import grammar as g
from toolquake.proxy.backend import template as t

WEATHER = g.Tool("get_weather", "Weather in a city.", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]})
BFCL = g.Tool("calc.area", "Area.", {"type": "dict", "properties": {
    "base": {"type": "integer", "description": "b"}, "sides": {"type": "tuple", "items": {"type": "float"}},
    "unit": {"type": "string", "enum": ["m", "cm"], "default": "m"}, "extra": {"type": "any"}},
    "required": ["base"]})


def test_sanitize_maps_bfcl_types_and_closes_objects():
    s = g.sanitize(BFCL.parameters)
    assert s["type"] == "object" and s["additionalProperties"] is False and s["required"] == ["base"]
    assert s["properties"]["sides"] == {"type": "array", "items": {"type": "number"}}
    assert s["properties"]["unit"] == {"enum": ["m", "cm"]}  # the enum constrains; description/default dropped
    assert s["properties"]["extra"] == {}


@pytest.mark.parametrize("choice,mode,names", [
    ("auto", "auto", ["get_weather", "calc.area"]),
    (None, "auto", ["get_weather", "calc.area"]),
    ("required", "required", ["get_weather", "calc.area"]),
    ("none", "none", ["get_weather", "calc.area"]),
    ({"type": "function", "function": {"name": "calc.area"}}, "required", ["calc.area"]),
])
def test_tool_choice_picks_mode_and_tools(choice, mode, names):
    got_mode, tools = g.choose([WEATHER, BFCL], choice, "chat")
    assert got_mode == mode and [x.name for x in tools] == names


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "nope"}}])
def test_bad_tool_choices_are_refused(choice):
    with pytest.raises(g.ToolChoiceError):
        g.choose([WEATHER], choice, "chat")


def test_required_without_tools_is_refused_and_responses_named_choice_works():
    with pytest.raises(g.ToolChoiceError):
        g.choose([], "required", "chat")
    assert g.choose([WEATHER, BFCL], {"type": "function", "name": "get_weather"}, "responses")[1] == [WEATHER]


def test_answer_schemas_per_mode():
    assert g.answer_schema("none", [WEATHER], True) is None
    req = g.answer_schema("required", [WEATHER], False)
    assert req["properties"]["tool_calls"]["maxItems"] == 1
    assert req["properties"]["tool_calls"]["items"]["properties"]["name"] == {"const": "get_weather"}
    auto = g.answer_schema("auto", [WEATHER, BFCL], True)
    assert [list(s["properties"]) for s in auto["anyOf"]] == [["tool_calls"], ["response"]]
    assert "maxItems" not in auto["anyOf"][0]["properties"]["tool_calls"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_compiles_every_schema():
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    for mode in ("auto", "required"):
        gbnf = json_schema_to_gbnf(json.dumps(g.answer_schema(mode, [WEATHER, BFCL], True)))
        assert '\\"get_weather\\"' in gbnf and '\\"calc.area\\"' in gbnf


def test_decode_answer_calls_replies_and_cut_replies():
    assert g.decode_answer('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}') == (None, [("f", '{"a": 1}')])
    assert g.decode_answer('{"response": "hi \\"you\\""}') == ('hi "you"', [])
    assert g.decode_answer('{"response": "cut here \\u00') == ("cut here ", [])
    assert g.decode_answer('{"tool_calls": [{"name": "f", "argu') == ('{"tool_calls": [{"name": "f", "argu', [])


def test_chat_and_responses_render_the_same_conversation_alike():
    chat = t.from_chat([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    resp = t.from_responses([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"}], "Be brief.")
    a, b = (t.render(m, "auto", [WEATHER], False) for m in (chat, resp))
    assert a == b
    assert a.startswith("<|im_start|>system\nBe brief.\n\nYou have access to the following functions:")
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in a
    assert "<|im_start|>user\nResult of get_weather: 18 C<|im_end|>" in a and a.endswith("<|im_start|>assistant\n")
    assert "functions" not in t.render(chat, "none", [WEATHER], False)


def test_image_parts_are_refused():
    with pytest.raises(ValueError, match="image_url"):
        t.from_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
