"""A chat request several test files send: four tools (one of them the right one) and a question, with a tag the
fake upstream records it under."""

from __future__ import annotations

import uuid

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"}},
                                          "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_news", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_stock", "parameters": {"type": "object", "properties": {}}}},
]


MESSAGES = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]


def tag() -> str:
    return uuid.uuid4().hex


def body(**extra) -> dict:
    return {"model": "fake-model", "messages": MESSAGES, "tools": TOOLS, **extra}
