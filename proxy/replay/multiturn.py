"""The multi-turn agent loop (BFCL V3, seed 004), run against the proxy so profiles perturb every step.

Per turn: the turn's user message is added; the model is called through the proxy with the case's
tools; the calls it makes are executed in order on the case's API simulators (scorers.backends) and
their results go back as `tool` messages; the turn ends when a step makes no call (text, or an answer
that does not decode); a turn that goes past 20 steps is force-terminated and the run stops. In
miss_func cases the held-out functions join the tools at the turn that reveals them, with BFCL's
sentence as the user message; long_context cases start the simulators with their long-context data.

`run_case(...)` returns a `scorers.multiturn.MultiTurnResult`; `scorers.multiturn.check(case, result)`
scores it (the checker re-executes everything on fresh simulators, as BFCL does).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from toolquake.bfcl.convert import openai_name, to_openai_tools, with_language_hints
from toolquake.bfcl.decode import DecodeFailure, calls_from_message
from toolquake.bfcl.simulators import BackendError, Backends, Call, shared
from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.live import recovery
from toolquake.proxy.replay.failures import BAD_RESPONSE, NOT_COMPARABLE, Failed, is_model_failure, post
from toolquake.scorers.multiturn import (
    BACKEND_ERROR,
    MAXIMUM_STEPS,
    MultiTurnResult,
    Step,
    check,
    final_call,
    long_context_of,
)

__all__ = ["ADDITIONAL_FUNCTIONS_PROMPT", "check", "given_request", "next_call_grade", "replay_fields", "run_case",
           "tools_for"]

#: BFCL's user message for FC models when held-out functions are revealed (miss_func)
ADDITIONAL_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"
DEFAULT_TIMEOUT_S = 600.0


def tools_for(case: Any, functions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """OpenAI tools for the functions offered so far (with BFCL's generation-time language note)."""
    return to_openai_tools(with_language_hints(functions, case.category))


def _assistant_message(message: Mapping[str, Any], turn: int, step: int) -> dict[str, Any]:
    """The assistant message as it goes back into the history (tool calls given ids when they lack one)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    tool_calls = message.get("tool_calls")
    if tool_calls and isinstance(tool_calls, list):
        out["tool_calls"] = []
        for i, tc in enumerate(tool_calls):
            if not isinstance(tc, dict):
                out["tool_calls"].append(tc)  # kept as sent: it fails to decode, which ends the turn
                continue
            tc = dict(tc)
            if not tc.get("id"):
                tc["id"] = f"call_{turn}_{step}_{i}"
            tc.setdefault("type", "function")
            out["tool_calls"].append(tc)
    return out


def _usage(body: Mapping[str, Any], key: str) -> int | None:
    usage = body.get("usage")
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


class _QueryFailed(Exception):
    def __init__(self, code: str, message: str, status: int | None = None, shape: str | None = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.shape = shape


async def _query(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
                 ) -> tuple[dict[str, Any], str | None, float]:
    """One step's request (a timeout, 500 or 504 sent again, `failures.post`); its answer, request id, latency."""
    t0 = time.perf_counter()
    resp = await post(client, url, body, headers)
    if isinstance(resp, Failed):
        raise _QueryFailed(resp.code, f"{resp.message} (from {url})"[:500], resp.http_status, resp.shape)
    latency_ms = (time.perf_counter() - t0) * 1000
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict) or not data.get("choices"):
        raise _QueryFailed(BAD_RESPONSE, f"{url} answered without choices", resp.status_code)
    return data, resp.headers.get("x-toolquake-request-id"), latency_ms


@dataclass
class _Play:
    """What every step of one case's run sends with, and where its calls are executed."""

    http: httpx.AsyncClient
    url: str
    headers: dict[str, str]
    world: Any
    model: str
    extra_body: Mapping[str, Any] | None
    keep_contents: bool
    max_steps: int


async def run_case(case: Any, base_url: str, *, model: str = "default", profile: str | None = None,
                   headers: Mapping[str, str] | None = None, client: httpx.AsyncClient | None = None,
                   backends: Backends | None = None, max_steps: int = MAXIMUM_STEPS, keep_contents: bool = False,
                   timeout_s: float = DEFAULT_TIMEOUT_S, extra_body: Mapping[str, Any] | None = None
                   ) -> MultiTurnResult:
    """Play one multi-turn case against an OpenAI-compatible endpoint (normally the proxy).

    `base_url` is the OpenAI base URL (`http://proxy:8080/v1` or `.../p/<profile>/v1`); `profile`, when
    given, is sent as `X-Toolquake-Profile`. Every request carries `X-Toolquake-Case: <case id>`.
    A failed request stops the run (`result.error`, `error_code`, `error_status`; scored as
    `multi_turn:inference_error` when `failures.is_model_failure` says it is the backend's).
    """
    backends = backends or shared()
    classes = list(case.extra.get("involved_classes") or [])
    if not classes:
        raise ValueError(f"{case.id} is not a multi-turn case (no involved_classes)")
    send_headers = {**(headers or {}), "X-Toolquake-Case": case.id}
    if profile:
        send_headers["X-Toolquake-Profile"] = profile
    own_client = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        world = await asyncio.to_thread(backends.world, classes, case.extra.get("initial_config") or {},
                                        long_context_of(case))
    except BackendError:
        if own_client:
            await http.aclose()
        raise
    play = _Play(http, base_url.rstrip("/") + "/chat/completions", send_headers, world, model, extra_body,
                 keep_contents, max_steps)
    try:
        return await _play_turns(case, play)
    finally:
        await asyncio.to_thread(world.close)
        if own_client:
            await http.aclose()


async def _play_turns(case: Any, play: _Play) -> MultiTurnResult:
    """The case's turns in order, the functions held back by BFCL added at their turn."""
    held = case.extra.get("missed_function") or {}
    functions = [dict(f) for f in case.functions]
    tools, name_map = tools_for(case, functions)
    result = MultiTurnResult(case_id=case.id)
    messages: list[dict[str, Any]] = []
    for t, turn_messages in enumerate(case.turns):
        if str(t) in held:
            functions.extend(dict(f) for f in held[str(t)])
            tools, name_map = tools_for(case, functions)
            if not turn_messages:
                turn_messages = [{"role": "user", "content": ADDITIONAL_FUNCTIONS_PROMPT}]
        messages.extend(dict(m) for m in turn_messages)
        steps: list[Step] = []
        result.turns.append(steps)
        if not await _play_turn(play, t, messages, tools, name_map, steps, result):
            return result
    return result


async def _play_turn(play: _Play, t: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     name_map: dict[str, str], steps: list[Step], result: MultiTurnResult) -> bool:
    """Steps of turn `t` until the model makes no call; False when the run stops here (an HTTP failure, or more
    than `max_steps` steps: `result` says which)."""
    for n in itertools.count():
        body: dict[str, Any] = {**(play.extra_body or {}), "model": play.model, "messages": list(messages)}
        if tools:
            body["tools"] = tools
        try:
            data, request_id, latency_ms = await _query(play.http, play.url, body, play.headers)
        except _QueryFailed as exc:
            result.error = f"turn {t}, step {n}: {exc}"[:500]
            result.error_code, result.error_status, result.error_shape = exc.code, exc.status, exc.shape
            return False
        choice = data["choices"][0]
        message = choice.get("message") if isinstance(choice, dict) else None
        message = message if isinstance(message, dict) else {}
        assistant = _assistant_message(message, t, n)
        messages.append(assistant)
        decoded = calls_from_message(assistant, name_map)
        text = message.get("content") if play.keep_contents else None
        meta = dict(request_id=request_id, latency_ms=round(latency_ms, 3),
                    prompt_tokens=_usage(data, "prompt_tokens"),
                    completion_tokens=_usage(data, "completion_tokens"))
        if isinstance(decoded, DecodeFailure) or not decoded:
            reason = decoded.reason if isinstance(decoded, DecodeFailure) else "no call"
            steps.append(Step(decode_error=reason, text=text, **meta))
            return True
        results = await asyncio.to_thread(play.world.execute, [Call.of(c) for c in decoded])
        steps.append(Step(calls=decoded, text=text, results=results, **meta))
        for tc, output in zip(assistant["tool_calls"], results):
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": output})
        if n + 1 > play.max_steps:
            result.force_terminated = True
            return False
    return True  # pragma: no cover (itertools.count never ends)


#: the assistant's text that closes a given turn whose ground truth makes no call (as `ground_truth_result` says it)
_NO_CALL_TEXT = "I cannot do that with the functions I have."


def given_request(case: Any, model: str, backends: Backends | None = None
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """Seed 003 challenge 3's request (§3.3: the conversation u_1 … u_n is given, the model makes llm_n): the
    chat request for the first step of the case's last turn, with every earlier turn as the ground truth played
    it, and the OpenAI→BFCL name map of its tools.

    Each earlier turn is its user message(s), then each ground-truth call as one assistant step (one tool call,
    keyword arguments, id `call_<turn>_<i>`) answered by its `tool` message: the simulators' result, the calls
    executed in order on one world from the case's `initial_config`. A turn whose ground truth makes no call is
    answered by an assistant text. miss_func's held-out functions join the tools at their turn (BFCL's sentence
    as its user message), as in the played loop. Raises `BackendError` when the simulators fail."""
    from toolquake.scorers.multiturn import ground_truth_result

    backends = backends or shared()
    played = ground_truth_result(case, backends)
    held = case.extra.get("missed_function") or {}
    functions = [dict(f) for f in case.functions]
    messages: list[dict[str, Any]] = []
    last = len(case.turns) - 1
    world = backends.world(list(case.extra.get("involved_classes") or []), case.extra.get("initial_config") or {},
                           long_context_of(case))
    try:
        for t, turn_messages in enumerate(case.turns):
            if str(t) in held:
                functions.extend(dict(f) for f in held[str(t)])
                if not turn_messages:
                    turn_messages = [{"role": "user", "content": ADDITIONAL_FUNCTIONS_PROMPT}]
            messages.extend(dict(m) for m in turn_messages)
            if t == last:
                break
            calls = [c for step in played.turns[t] for c in step.calls or []]
            if not calls:
                messages.append({"role": "assistant", "content": _NO_CALL_TEXT})
                continue
            for i, (call, output) in enumerate(zip(calls, world.execute([Call.of(c) for c in calls]))):
                call_id = f"call_{t}_{i}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": openai_name(call["name"]), "arguments": json.dumps(call["arguments"])}}]})
                messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    finally:
        world.close()
    tools, name_map = tools_for(case, functions)
    body: dict[str, Any] = {"model": model, "messages": messages}
    if tools:
        body["tools"] = tools
    return body, name_map


def next_call_grade(case: Any, answer: Mapping[str, Any] | None, name_map: Mapping[str, str]) -> dict[str, Any]:
    """The grade of a given conversation's answer (`given_request`): `scorers.multiturn.next_call` on the calls of
    its first choice; no answer (the backend failed) is BFCL's inference error, wrong wherever the turn expects a
    call. {"valid", "error_type", "taxonomy", "errors", "next_call": {"valid", "error_type", "turn",
    "expected_calls", "calls"}}."""
    from toolquake.scorers.multiturn import INFERENCE, INFERENCE_ERROR, next_call

    if answer is None:
        turn = len(case.ground_truth) - 1
        expected = len(case.ground_truth[turn])
        if not expected:  # no call expected: no answer makes none, as BFCL grades irrelevance
            return {"valid": True, "error_type": None, "taxonomy": None, "errors": [],
                    "next_call": {"valid": True, "error_type": None, "turn": turn, "expected_calls": 0, "calls": 0}}
        return {"valid": False, "error_type": INFERENCE_ERROR, "taxonomy": INFERENCE,
                "errors": ["the request got no usable answer (scored as BFCL scores an inference error)"],
                "next_call": {"valid": False, "error_type": INFERENCE_ERROR, "turn": turn,
                              "expected_calls": expected, "calls": 0}}
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    v = next_call(case, calls_from_message(message if isinstance(message, dict) else None, dict(name_map)))
    return {"valid": v.valid, "error_type": v.error_type, "taxonomy": v.taxonomy, "errors": list(v.errors),
            "next_call": {"valid": v.valid, "error_type": v.error_type, "turn": v.turn, **v.details}}


def _summary(result: MultiTurnResult) -> dict[str, Any]:
    """What a results row keeps of a run: per turn, each step's calls or why it made none (no results)."""
    return {"turns": [[{"calls": s.calls} if s.calls else {"decode_error": s.decode_error} for s in turn]
                      for turn in result.turns],
            "force_terminated": result.force_terminated}


def _recoveries(ex: Any) -> list[Any]:
    """The recovery verdicts on one step's answer, when a step of the profile replaced tool results with failures."""
    sent = ex.sent or {}
    failures = recovery.injected(list(ex.outcome.applied), sent.get("messages") or [])
    return recovery.verdicts(sent, ex.response, failures)


async def replay_fields(case: Any, base_url: str, *, model: str, client: httpx.AsyncClient,
                        headers: Mapping[str, str] | None = None, extra_body: Mapping[str, Any] | None = None,
                        take: Callable[[str | None], Any] | None = None, strict: bool = False,
                        backends: Backends | None = None) -> dict[str, Any]:
    """One multi-turn (case, profile) pair for the replay driver: its results-row fields.

    `status` is "scored" with BFCL's verdict (error type, taxonomy: state_mismatch, response_mismatch,
    force_terminated, decode_failure, inference_error: a request failed on the backend's side, its code in
    `error_code`) and, in `answer.final_call`, seed 003's AST verdict on the last turn's calls
    (`scorers.multiturn.final_call`: {"valid", "error_type", "turn"}), or "error" when a request failed on the
    proxy's or the network's side (retried on the next run). `take(request_id)` collects what the perturbers
    did at each step (the in-process proxy); after a tool result a step replaced with a failure, the answer's
    recovery verdict is kept in `perturbers.recovery` (turn, step, kind, tool, verdict, recovered).
    """
    try:
        result = await run_case(case, base_url, model=model, client=client, headers=headers, extra_body=extra_body,
                                backends=backends)
    except BackendError as exc:  # the simulators failed, not the model: retried on the next run
        return {"status": "error", "error_code": "backend_error", "error": str(exc)[:500]}
    steps = [s for turn in result.turns for s in turn]
    applied: dict[str, int] = {}
    failed: dict[str, int] = {}
    recoveries: list[dict[str, Any]] = []
    perturbed_steps, unperturbed = 0, {}  # steps a perturber changed; why the others were left as they were
    for t, turn in enumerate(result.turns):
        for n, step in enumerate(turn):
            ex = take(step.request_id) if take is not None else None
            outcome = getattr(ex, "outcome", None)
            for a in getattr(outcome, "applied", None) or ():
                applied[a.name] = applied.get(a.name, 0) + 1
                kept = (a.report or {}).get(NOT_PERTURBED)
                if kept is None:
                    perturbed_steps += 1
                else:
                    unperturbed.setdefault(str(kept), 0)
            for name in getattr(outcome, "failed", None) or ():
                failed[str(name)] = failed.get(str(name), 0) + 1
            if outcome is not None:
                try:
                    recoveries += [{"turn": t, "step": n, **v.as_dict()} for v in _recoveries(ex)]
                except Exception as exc:  # a scorer bug loses this verdict, never the pair's BFCL verdict
                    recoveries.append({"turn": t, "step": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
    # a case no step of which the profile perturbed (every applied step said why not) is "not perturbed"
    kept = {NOT_PERTURBED: "; ".join(unperturbed)[:300]} if applied and not perturbed_steps and unperturbed else {}
    fields: dict[str, Any] = {
        "answer": _summary(result),
        "perturbers": {"steps": len(steps), "applied": applied, "failed": failed,
                       **({"recovery": recoveries} if recoveries else {}), **kept},
        "request_id": steps[0].request_id if steps else None,
        "latency_ms": sum(s.latency_ms or 0.0 for s in steps) or None,
        "prompt_tokens": sum(s.prompt_tokens or 0 for s in steps) or None,
        "completion_tokens": sum(s.completion_tokens or 0 for s in steps) or None,
    }
    if result.error is not None and result.error_shape:  # refused for its shape: final, no verdict
        return {**fields, "status": "scored", "error_type": NOT_COMPARABLE, "error_code": result.error_code,
                "error": result.error, "http_status": result.error_status, "warning": result.error_shape}
    if result.error is not None and not is_model_failure(result.error_status, result.error_code or ""):
        return {**fields, "status": "error", "error_code": result.error_code or "unreachable", "error": result.error}
    if result.error is not None:  # the backend's failure: BFCL's multi_turn:inference_error, scored below
        fields.update(error_code=result.error_code, error=result.error, http_status=result.error_status)
    verdict = await asyncio.to_thread(check, case, result, strict=strict, backends=backends)
    if verdict.error_type == BACKEND_ERROR:  # not the model's fault: retried on the next run
        return {**fields, "status": "error", "error_code": "backend_error", "error": verdict.errors[0][:500]}
    final = final_call(case, result)  # seed 003 challenge 3's AST verdict on the last turn, beside BFCL's
    fields["answer"]["final_call"] = {"valid": final.valid, "error_type": final.error_type, "turn": final.turn}
    return {**fields, "status": "scored", "valid": verdict.valid, "error_type": verdict.error_type,
            "taxonomy": verdict.taxonomy, "errors": list(verdict.errors)}
