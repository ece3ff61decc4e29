"""Calls to tools the proxy added (tools a step injected that the client never offered): counted, and under
a profile's `injected_calls = "answer"` kept from the client. Strip them when the model also called the
client's own tools, else tell the model they are unavailable and ask again (at most MAX_INJECTED_ROUNDS
times; then the calls are stripped)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from toolquake.proxy.server.answer.base import ANSWER, WHOLE, AnswerStep
from toolquake.proxy.server.upstream import AnswerTooLarge, UpstreamError

if TYPE_CHECKING:
    from toolquake.proxy.server.state import Asked, Served

log = structlog.get_logger("toolquake.proxy")
#: follow-up rounds the proxy may spend answering calls to tools it added (`injected_calls = "answer"`)
MAX_INJECTED_ROUNDS = 3
UNAVAILABLE = ("Error: the tool {name!r} is not available. Do not call it again; use the other tools, "
               "or answer without it.")
_decode = msgspec.json.decode
_encode = msgspec.json.encode


class InjectedCalls(AnswerStep):
    """WHOLE when the proxy answers the calls itself (the client must not see them); else ANSWER (counted)."""

    name = "injected_calls"

    def needs(self, asked: Asked, served: Served) -> str | None:
        if served.outcome is None or not served.outcome.injected:
            return None
        return WHOLE if asked.profile is not None and asked.profile.spec.injected_calls == "answer" else ANSWER

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        assert served.outcome is not None and asked.profile is not None
        injected = served.outcome.injected
        answer_them = asked.profile.spec.injected_calls == "answer"
        request = served.outcome.request.body
        for round_ in range(MAX_INJECTED_ROUNDS + 1):
            calls = _calls(answer)
            bad = [c for c in calls if _call_name(c) in injected]
            if not bad:
                return answer if served.injected_calls else None
            for call in bad:
                served.injected_calls += (_call_name(call),)
                self.st.metrics.injected_calls.labels(asked.profile_name, injected[_call_name(call)]).inc()
            if not answer_them:
                return None
            if len(bad) < len(calls) or round_ == MAX_INJECTED_ROUNDS:
                return _strip(answer, {id(c) for c in bad})
            message = answer["choices"][0]["message"]
            request = {**request, "stream": False,
                       "messages": [*request.get("messages", []), {**message, "role": "assistant"},
                                    *({"role": "tool", "tool_call_id": c.get("id", ""),
                                       "content": UNAVAILABLE.format(name=_call_name(c))} for c in bad)]}
            request.pop("stream_options", None)
            if served.trace is not None:
                served.trace.tools_answered(bad)
            previous, followup = answer, await self._ask_again(asked, served, request, round_ + 1)
            if followup is None:  # the follow-up failed: the client gets the answer without the added calls
                return _strip(previous, {id(c) for c in bad})
            answer = followup
        return answer

    async def _ask_again(self, asked: Asked, served: Served, request: dict[str, Any],
                         round_: int) -> dict[str, Any] | None:
        api, upstream, trace = asked.api, self.st.upstream, served.trace
        assert api is not None
        wire = api.to_wire(request, {**(asked.wire_request or {}), "stream": False}, asked.conversion)
        span, headers = (None, asked.forward_headers) if trace is None else \
            trace.call(f"POST /v1/{api.path}", asked, asked.forward_headers, {"toolquake.followup.round": round_})
        status, answer = 0, None
        try:
            resp = await upstream.send("POST", upstream.api_url(api.path), headers, _encode(wire))
            try:
                data = await resp.aread(self.st.config.server.max_answer_bytes)
            finally:
                await resp.aclose()
            status = resp.status_code
            answer = _decode(data) if resp.status_code == 200 else None
        except (UpstreamError, AnswerTooLarge, msgspec.DecodeError, RecursionError) as exc:
            log.warning("injected_followup_failed", request_id=asked.request_id, error_type=type(exc).__name__)
            answer = None
        answer = api.answer_to_internal(answer) if isinstance(answer, dict) else None
        if trace is not None:
            trace.called(span, status, answer)
        return answer


def _calls(answer: dict[str, Any] | None) -> list[dict[str, Any]]:
    choices = (answer or {}).get("choices") or []
    message = (choices[0] or {}).get("message") if choices and isinstance(choices[0], dict) else None
    return [c for c in (message or {}).get("tool_calls") or [] if isinstance(c, dict)]


def _call_name(call: dict[str, Any]) -> str:
    return str((call.get("function") or {}).get("name"))


def _strip(answer: dict[str, Any], drop: set[int]) -> dict[str, Any]:
    """The answer without the given tool calls (by identity); no call left → a plain text answer."""
    choice = answer["choices"][0]
    message = dict(choice.get("message") or {})
    kept = [c for c in message.get("tool_calls") or [] if id(c) not in drop]
    if kept:
        message["tool_calls"] = kept
    else:
        message.pop("tool_calls", None)
        message["content"] = message.get("content") or ""
    finish = "tool_calls" if kept else "stop"
    return {**answer, "choices": [{**choice, "message": message, "finish_reason": finish}, *answer["choices"][1:]]}
