"""Which failed requests are the model's failures and which are toolquake's or the network's.

BFCL counts a request that got no usable answer ("Error during inference") as a wrong answer. So does replay,
for a failure on the backend's side: an error status (400 `context_length_exceeded` and any other refusal of
the request's content), a 500 or a timeout still there after `ATTEMPTS` tries, an answer that is not JSON.
Such a pair is scored (invalid; `error_code` says why) and never sent again.

A failure of the proxy itself, of the network, or of access (connection refused, the proxy's own error codes,
401 / 403 / 404 / 407, 429 and 502 / 503: come back later) says nothing about the model: the pair is recorded
as an error, left out of every number, and retried on the next run until it is scored.

A refusal of the request's *shape* (a hosted API's validation: more tools than it accepts, a parameter the model
does not take such as `temperature` for OpenAI's reasoning models, a tool schema it rejects) is no verdict on the
model either, and sending it again changes nothing: the pair is final and **not comparable** (`NOT_COMPARABLE`),
reported by code and left out of every number. A refusal for the model's *context* (`context_length_exceeded`)
stays the model's failure, as BFCL counts it. `REFUSALS` is the one table that tells them apart
(docs/replay.md, "Refusals of the request's shape").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

#: tries of one request when it times out or the backend answers 500 / 504, before the failure counts
ATTEMPTS = 3
#: seconds to wait before the second try, doubled before each next one
BACKOFF_S = 1.0

#: the proxy's (and replay's) own codes: a failure of toolquake or the network, never the model's
PROXY_CODES = frozenset({
    "unreachable", "upstream_unreachable", "upstream_unhealthy", "warming_up", "internal_error",
    "perturbation_failed", "unknown_profile", "invalid_json", "invalid_type", "request_too_large", "not_found",
    "method_not_allowed", "too_many_requests", "too_many_connections", "request_timeout", "uri_too_long",
    "request_header_fields_too_large", "scorer_error", "backend_error",
})
#: statuses that ask to come back later or deny access: the request itself was not judged
RETRY_LATER = frozenset({401, 403, 404, 407, 408, 429, 502, 503})
#: failures that may pass on a second try (sent again before they count)
TRANSIENT_CODES = frozenset({"timeout", "upstream_timeout"})
TRANSIENT_STATUSES = frozenset({500, 504})
#: the code of a 200 answer that is not a JSON object (or, multi-turn, has no choices)
BAD_RESPONSE = "bad_response"
#: answers the backend gave that cannot be read: the model's failure at once (the proxy says 502)
BAD_ANSWER_CODES = frozenset({BAD_RESPONSE, "upstream_invalid_response"})


#: the verdict (`error_type`) of a pair whose request the backend refused for its shape: final, in no number
NOT_COMPARABLE = "not_comparable"
#: the two kinds of refusal `REFUSALS` tells apart
SHAPE, CONTEXT = "shape", "context"


@dataclass(frozen=True)
class Refusal:
    """One row of `REFUSALS`: an error answer whose `field` ("code", "param" or "message", lower-cased) holds
    `needle` (a code or param equals it, or starts with it followed by `[` or `.`; a message contains it) is a
    refusal of `kind`; `what` says what the backend refuses (the run's warning)."""

    field: str
    needle: str
    kind: str
    what: str


#: how an error answer (status 400, 413 or 422) is classified, first matching row first: context refusals before
#: shape ones (OpenAI gives `context_length_exceeded` the type `invalid_request_error` too). OpenAI's wording
#: (`code`, `param`), vLLM's (a `BadRequestError` whose message says why), llama.cpp's (`exceed_context_size_error`).
REFUSALS: tuple[Refusal, ...] = (
    Refusal("code", "context_length_exceeded", CONTEXT, "the request is longer than the model's context"),
    Refusal("code", "exceed_context_size_error", CONTEXT, "the request is longer than the model's context"),
    Refusal("message", "maximum context length", CONTEXT, "the request is longer than the model's context"),
    Refusal("message", "maximum model length", CONTEXT, "the request is longer than the model's context"),
    Refusal("message", "exceeds the context", CONTEXT, "the request is longer than the model's context"),
    Refusal("code", "array_above_max_length", SHAPE, "the backend refuses so many tools"),
    Refusal("code", "invalid_function_parameters", SHAPE, "the backend rejects a tool's schema"),
    Refusal("code", "unsupported_parameter", SHAPE, "the backend refuses a parameter of the request"),
    Refusal("code", "unsupported_value", SHAPE, "the backend refuses a value of the request"),
    Refusal("param", "tools", SHAPE, "the backend refuses the request's tools"),
    Refusal("param", "tool_choice", SHAPE, "the backend refuses the request's tool_choice"),
    Refusal("param", "parallel_tool_calls", SHAPE, "the backend refuses parallel_tool_calls"),
    Refusal("param", "temperature", SHAPE, "the backend refuses the temperature sent"),
    Refusal("param", "top_p", SHAPE, "the backend refuses top_p"),
    Refusal("param", "seed", SHAPE, "the backend refuses the seed"),
    Refusal("param", "max_tokens", SHAPE, "the backend refuses max_tokens"),
    # vLLM: a server started without tool calling, and its request validation naming the parameter
    Refusal("message", "--enable-auto-tool-choice", SHAPE, "the backend was started without tool calling"),
    Refusal("message", "--tool-call-parser", SHAPE, "the backend was started without tool calling"),
    Refusal("message", "'temperature'", SHAPE, "the backend refuses the temperature sent"),
    Refusal("message", "'tools'", SHAPE, "the backend refuses the request's tools"),
)
#: the statuses a request's validation answers with (a 500 or a 404 is never a refusal of its shape)
REFUSAL_STATUSES = frozenset({400, 413, 422})


def _field_matches(field: str, value: str, needle: str) -> bool:
    if field == "message":
        return needle in value
    return value == needle or (value.startswith(needle) and value[len(needle):len(needle) + 1] in ("[", "."))


def refusal(http_status: int | None, code: str, param: str = "", message: str = "") -> Refusal | None:
    """The `REFUSALS` row an error answer matches (None: not a refusal this table knows, or the proxy's own error:
    those are retried, never classified)."""
    if http_status not in REFUSAL_STATUSES or code in PROXY_CODES:
        return None
    fields = {"code": code.lower(), "param": param.lower(), "message": message.lower()}
    return next((r for r in REFUSALS if _field_matches(r.field, fields[r.field], r.needle)), None)


def _limit_in(message: str) -> str | None:
    """The number after "maximum length" in OpenAI's array-length message ("...maximum length 128, but got...")."""
    at = message.lower().find("maximum length")
    if at < 0:
        return None
    digits = ""
    for ch in message[at + len("maximum length"):at + len("maximum length") + 12]:
        if ch.isdigit():
            digits += ch
        elif digits:
            break
    return digits or None


def refusal_warning(found: Refusal, code: str, param: str, message: str) -> str:
    """The run's one-line warning at the first refusal of the request's shape with this code."""
    what = found.what
    limit = _limit_in(message) if param.lower().startswith("tools") or found.needle == "array_above_max_length" \
        else None
    if limit:
        what = f"the backend refuses more than {limit} tools"
    elif found.needle in ("temperature", "'temperature'") or param.lower() == "temperature":
        what = "the backend refuses the temperature sent (pass --temperature none to send none, as BFCL does)"
    return f"{what}: these pairs measure the API, not the model ({code}; reported as not comparable)"


def is_model_failure(http_status: int | None, code: str) -> bool:
    """A failure on the backend's side (scored as a wrong answer), as opposed to one to retry later."""
    if code in BAD_ANSWER_CODES or code in TRANSIENT_CODES:
        return True
    if code in PROXY_CODES or http_status in RETRY_LATER:
        return False
    return http_status is not None and http_status >= 400


def _transient(http_status: int | None, code: str) -> bool:
    return code in TRANSIENT_CODES or (http_status in TRANSIENT_STATUSES and code not in PROXY_CODES)


def error_of(r: httpx.Response) -> tuple[str, str]:
    """(code, message) of an error answer: the error's `code` when it is a word (OpenAI's
    `context_length_exceeded`), else its `type` (llama.cpp's `exceed_context_size_error`, vLLM's
    `BadRequestError`), else `http_<status>`; the body either OpenAI's `{"error": {...}}` or vLLM's older flat one."""
    code, message, _ = error_fields(r)
    return code, message


def error_fields(r: httpx.Response) -> tuple[str, str, str]:
    """(code, message, param) of an error answer (`error_of`; `param` is OpenAI's, "" when the body has none)."""
    try:
        body: Any = r.json()
    except ValueError:
        body = None
    err = body.get("error", body) if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    code = err.get("code")
    if not isinstance(code, str) or not code or code.isdigit():
        code = err.get("type") if isinstance(err.get("type"), str) and err.get("type") else None
    param = err.get("param") if isinstance(err.get("param"), str) else ""
    return (str(code or f"http_{r.status_code}")[:100], str(err.get("message") or r.text)[:500], param[:100])


@dataclass
class Failed:
    """A request that got no usable answer: why, and whether it counts as the model's failure."""

    code: str
    message: str
    http_status: int | None = None
    #: the model's failure (scored invalid), else retried on the next run
    counts: bool = False
    attempts: int = 1
    #: the proxy's `X-Toolquake-Request-Id` of the last try (None without an answer)
    request_id: str | None = None
    #: a refusal of the request's shape (`REFUSALS`): the run's warning for it; the pair is not comparable
    shape: str | None = None


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
               timeout_s: float | None = None, drop: Callable[[str | None], Any] | None = None
               ) -> httpx.Response | Failed:
    """POST one request; a timeout, 500 or 504 is sent again (up to ATTEMPTS tries, pausing BACKOFF_S, doubled;
    `drop(request_id)` is called for each try sent again). A 200 answer is returned as it is (its body is the
    caller's to read); any other outcome as `Failed`."""
    pause = BACKOFF_S
    for attempt in range(1, ATTEMPTS + 1):
        try:
            r = await client.post(url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            wait = f" in {timeout_s:.0f} s" if timeout_s else ""
            failed = Failed("timeout", f"{type(exc).__name__}: no answer{wait}", counts=True, attempts=attempt)
        except httpx.HTTPError as exc:
            return Failed("unreachable", f"{type(exc).__name__}: {exc}"[:500], attempts=attempt)
        else:
            if r.status_code == 200:
                return r
            code, message, param = error_fields(r)
            found = refusal(r.status_code, code, param, message)
            shape = refusal_warning(found, code, param, message) if found and found.kind == SHAPE else None
            failed = Failed(code, message, r.status_code, is_model_failure(r.status_code, code), attempt,
                            r.headers.get("x-toolquake-request-id"), shape)
        if not _transient(failed.http_status, failed.code) or attempt == ATTEMPTS:
            return failed
        if drop is not None:
            drop(failed.request_id)
        await asyncio.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")  # pragma: no cover
