"""Backend conformance: the rules of the OpenAI wire format for tool calls, checked on each answer a backend
relays (chat completions and the Responses API, streamed or not), and the `repair` of calls left in text.

The checker only reads: the proxy calls it with the bytes it already relayed (or the answer it already
parsed) once the client has them. Rules and their names: `rules.RULES`, docs/conformance.md.
"""

from __future__ import annotations

from typing import Any

from toolquake.proxy.server.conformance import chat, responses
from toolquake.proxy.server.conformance.arguments import Offered
from toolquake.proxy.server.conformance.repair import repair_answer
from toolquake.proxy.server.conformance.rules import CONTENT_RULES, RULES, Violation

__all__ = ["CONTENT_RULES", "RULES", "Offered", "Violation", "check", "nothing_to_check", "repair_answer"]

#: bytes every complete answer with a call (or a finish_reason that claims one) holds, by route
_CALL_MARKERS = {"chat_completions": b"tool_calls", "responses": b"function_call"}


def nothing_to_check(route: str, answer: bytes, offered: Offered) -> bool:
    """True when no rule can fire on this complete (not streamed) answer, so `check` need not decode it: the
    request offered no tool (no call may be left in the text) and the answer's bytes hold no call marker
    (`tool_calls` / `function_call`) nor a `\\u` escape that could spell one."""
    return not offered.calls_allowed and _CALL_MARKERS[route] not in answer and b"\\u" not in answer


def check(route: str, stream: bool, answer: bytes | dict[str, Any], offered: Offered) -> list[Violation]:
    """The violations in one answer of `route` ("chat_completions" | "responses"), the first of each rule per
    call: `answer` is the raw SSE body of a stream, or the decoded JSON of a complete answer."""
    module = responses if route == "responses" else chat
    if stream:
        found = module.check_stream(answer if isinstance(answer, bytes) else b"", offered)
    else:
        found = module.check_answer(answer, offered)
    # one violation per rule and call: a rule every delta of a call breaks counts once
    first: dict[tuple[str, int | None], Violation] = {}
    for v in found:
        first.setdefault((v.rule, v.call), v)
    return list(first.values())
