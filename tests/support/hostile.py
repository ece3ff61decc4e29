"""Hostile text for the linearity checks of the perturbers and the remedies (issue 28 item 1): repeated units that
made some scan backtrack or restart at every position, the places in a chat request a client controls, and ordinary
prose of the same size as the baseline."""

from __future__ import annotations

import json
from typing import Any

#: repeated, each of these made some scan backtrack or restart at every position
UNITS = ("a+", "a-", "((((", "))))", "a.a.", "https://", "x://", "@a.", "a+@", "a.@", "www.", "-1", "1.", "/a",
         "a_", "aB", "a1 ", "'a'b", "\"a", "\"\n", "``", "\u201c", "\u2018", "\u201ca\u201d\u201c", "  ", "\t\n",
         "[{\"", "{\"a\":", "<a>", "</", "a\u202e\x00", "\u202e\u2066\x00\x1b",
         "Note that the provided function is in ", "(a) ", "a. A", "\\", "%s{}")
FIELDS = ("user", "system", "tool_result", "tool_description", "tool_name", "param_description", "param_default")
SMALL = 64 * 1024
LARGE = 8 * SMALL
#: CPU milliseconds per KiB of hostile text at most (measured: well under 1 on a busy 2-core machine)
MS_PER_KIB = 5.0


def _tool(name: str, description: str, param_description: str = "The city.", default: Any = None) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "string", "description": param_description}
    if default is not None:
        prop["default"] = default
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"city": prop, "days": {"type": "integer", "description": "How many."}},
        "required": ["city"]}}}


def request_with(field: str, text: str) -> dict[str, Any]:
    """A two-tool, two-turn chat request (one tool call and its JSON result) with `text` in `field`."""
    tools = [_tool("get_weather", "Get the weather for a city. Returns the temperature (in Celsius)."),
             _tool("find_book", "Find a book by its title.", "The title.")]
    result = json.dumps({"results": [{"id": f"r{i}", "city": "Paris", "temp": 20 + i} for i in range(3)]})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "user", "content": "And in Rome, for 3 days?"}]
    if field == "user":
        messages[-1]["content"] = text
    elif field == "system":
        messages[0]["content"] = text
    elif field == "tool_result":
        messages[3]["content"] = text
    elif field == "tool_description":
        tools = [_tool("get_weather", text), _tool("find_book", text, "The title.")]
    elif field == "tool_name":
        tools[1] = _tool(text, "Find a book by its title.")
    elif field == "param_description":
        tools[0] = _tool("get_weather", "Get the weather.", text)
    elif field == "param_default":
        tools[0] = _tool("get_weather", "Get the weather.", "The city.", text)
    return {"model": "m", "messages": messages, "tools": tools}


def hostile(unit: str, size: int) -> str:
    return "x" + unit * (size // len(unit)) + "x"


#: ordinary prose, repeated to a size: what a large but benign request holds
PROSE = "The weather in Paris is mild today, with light rain expected in the evening. "


def ordinary(size: int) -> str:
    return (PROSE * (size // len(PROSE) + 1))[:size]
