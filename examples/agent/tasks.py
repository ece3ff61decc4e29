"""The example agent's tasks: a request, the call that does it, and the fact its final answer must carry.

Each task runs on one framework and API (`runner`): the OpenAI Agents SDK on chat completions
(`agents-chat`) or on the Responses API (`agents-responses`), or LangGraph's ReAct agent on chat completions
(`langgraph`). A run of a task is checked on what the agent did: the expected call was run (its tool, each
argument among the accepted values: strings compared case-insensitively, numbers by value); and, apart, whether
the fact appears in the final answer (a small model's wording often leaves it out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RUNNERS = ("agents-chat", "agents-responses", "langgraph")


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    runner: str
    #: the tool the task needs and, per argument, the accepted values
    tool: str
    arguments: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: a string the final answer carries when the agent used the tool's result (case-insensitive)
    fact: str = ""


def _same(value: Any, accepted: tuple[Any, ...]) -> bool:
    for a in accepted:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            try:
                if abs(float(str(value).replace(",", "")) - float(a)) < 1e-6:
                    return True
            except ValueError:
                continue
        elif str(value).strip().lower() == str(a).strip().lower():
            return True
    return False


def call_ok(task: Task, calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """Whether one of the calls the agent ran is the task's call (its tool, every argument accepted)."""
    return any(name == task.tool and all(_same(args.get(k), v) for k, v in task.arguments.items())
               for name, args in calls)


def fact_ok(task: Task, final: str) -> bool:
    return task.fact.lower() in (final or "").lower()


TASKS = (
    Task("weather-paris", "What is the weather in Paris?", "agents-chat", "get_weather", {"city": ("Paris",)}, "18"),
    Task("usd-to-eur", "Convert 100 USD to EUR.", "agents-responses", "convert_currency",
         {"amount": (100,), "from_currency": ("USD",), "to_currency": ("EUR",)}, "92"),
    Task("events-tuesday", "What is in my calendar on tuesday?", "langgraph", "list_events", {"day": ("tuesday",)},
         "dentist"),
    Task("km-to-miles", "Convert 10 km to mi.", "agents-chat", "convert_units",
         {"value": (10,), "from_unit": ("km",), "to_unit": ("mi",)}, "6.21"),
    Task("notes-garden", "Search my notes for garden.", "agents-responses", "search_notes",
         {"query": ("garden",)}, "tomatoes"),
    Task("weather-tokyo", "What is the weather in Tokyo?", "langgraph", "get_weather", {"city": ("Tokyo",)}, "24"),
    Task("gbp-to-usd", "Convert 50 GBP to USD.", "agents-chat", "convert_currency",
         {"amount": (50,), "from_currency": ("GBP",), "to_currency": ("USD",)}, "63.59"),
    Task("kg-to-lb", "Convert 5 kg to lb.", "agents-responses", "convert_units",
         {"value": (5,), "from_unit": ("kg",), "to_unit": ("lb",)}, "11.02"),
    Task("notes-atlas", "Search my notes for Atlas.", "langgraph", "search_notes", {"query": ("Atlas",)}, "friday"),
    Task("weather-berlin", "What is the weather in Berlin?", "agents-responses", "get_weather", {"city": ("Berlin",)},
         "rain"),
)
