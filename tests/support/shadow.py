"""The shadow-mode setup several test files share: two look-alike tools, a question, a profile that reverses the
tool order, and a client for it."""

from __future__ import annotations

import openai


def _tool(name: str, **defaults) -> dict:
    props = {"city": {"type": "string"}, "days": {"type": "integer"}}
    for k, v in defaults.items():
        props[k] = {"type": "string", "default": v}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": ["city"]}}}


TOOLS = [_tool("weather_forecast"), _tool("humidity_forecast")]


MESSAGES = [{"role": "user", "content": "How humid will Miami be this week?"}]


def config(db, *, sample_rate: float = 1.0, max_concurrent: int = 4, noise_rate: float = 0.0,
           store_contents: bool = False) -> str:
    return f"""
[server]
model_allowlist = ["fake-model"]

[profiles.shadow-reversed]
mode = "shadow"
sample_rate = {sample_rate}
max_concurrent = {max_concurrent}
noise_rate = {noise_rate}
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]

[scoring]
store = "{db}"
store_contents = {str(store_contents).lower()}
"""


def client(proxy, profile: str = "shadow-reversed") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-shadow-test", max_retries=0)
