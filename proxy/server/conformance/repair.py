"""The `repair` profile step: a call left in the text of an answer becomes a proper `tool_calls` entry."""

from __future__ import annotations

import itertools
import json
from typing import Any

from toolquake.proxy.server.conformance.arguments import Offered
from toolquake.proxy.server.conformance.content import find_calls

_ids = itertools.count(1)


def repair_answer(answer: dict[str, Any], offered: Offered) -> tuple[dict[str, Any], str | None]:
    """A chat-shaped answer whose first choice has no calls but calls of offered tools in its text, with those
    calls as `tool_calls` (the text around them kept, `finish_reason: "tool_calls"`); and the rule repaired.
    The answer unchanged and None when there is nothing to repair."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not offered.calls_allowed or not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return answer, None
    choice = choices[0]
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    text = message.get("content")
    if message.get("tool_calls") or not isinstance(text, str):
        return answer, None
    found = find_calls(text, offered.tools)
    if found is None or not found.calls:
        return answer, None
    calls = [{"id": f"call_tqrepair{next(_ids)}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
             for name, args in found.calls]
    rest = (text[:found.start] + text[found.end:]).strip()
    fixed = {**message, "content": rest or None, "tool_calls": calls}
    return {**answer, "choices": [{**choice, "message": fixed, "finish_reason": "tool_calls"}, *choices[1:]]}, \
        found.rule
