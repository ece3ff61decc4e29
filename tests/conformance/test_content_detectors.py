"""Calls left in text (the `call_in_content_*` rules and `repair`): what each syntax finds, and the prose,
code and JSON that must not pass for a call."""

from __future__ import annotations

import pytest

from toolquake.proxy.server.conformance.content import find_calls

TOOLS = {"get_weather": {}, "math.factorial": {}, "ping": {}}


@pytest.mark.parametrize("text,rule,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "call_in_content_hermes",
     [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": '
     '"{\\"city\\": \\"Rome\\"}"}</tool_call>', "call_in_content_hermes",
     [("ping", {}), ("get_weather", {"city": "Rome"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', "call_in_content_hermes",
     [("get_weather", {"city": "Oslo"})]),  # the closing tag cut off by max_tokens
    ('[get_weather(city="Oslo", days=3), math.factorial(n=5)]', "call_in_content_pythonic",
     [("get_weather", {"city": "Oslo", "days": 3}), ("math.factorial", {"n": 5})]),
    ('Let me check. [ping()] Done.', "call_in_content_pythonic", [("ping", {})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "call_in_content_json",
     [("get_weather", {"city": "Oslo"})]),
    ('```json\n[{"name": "ping", "arguments": {}}, {"function": {"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}}]\n```', "call_in_content_json", [("ping", {}), ("get_weather", {"city": "Oslo"})]),
])
def test_each_syntax_finds_its_calls(text, rule, calls):
    found = find_calls(text, TOOLS)
    assert found is not None and found.rule == rule and found.calls == calls


@pytest.mark.parametrize("text", [
    "It is 21 degrees in Oslo [1]. See [the forecast](https://example.org).",
    "Squares: [x(i) for i in range(3)] and [f(1)] with positional arguments.",
    '[unknown_tool(a=1)] and {"name": "not_offered", "arguments": {}}',
    '{"name": "get_weather"} has no arguments key; {"city": "Oslo"} names no tool.',
    "Call get_weather with the city, then ping.",
    "",
])
def test_prose_code_and_other_json_are_not_calls(text):
    assert find_calls(text, TOOLS) is None


def test_nothing_is_a_call_when_no_tool_was_offered():
    assert find_calls('[get_weather(city="Oslo")]', {}) is None
