"""Which failed requests are the model's failures and which are toolquake's or the network's.

BFCL counts a request that got no usable answer ("Error during inference") as a wrong answer. So does replay,
for a failure on the backend's side: an error status (400 `context_length_exceeded` and any other refusal of
the request's content), a 500 or a timeout still there after `ATTEMPTS` tries, an answer that is not JSON.
Such a pair is scored (invalid; `error_code` says why) and never sent again.

A failure of the proxy itself, of the network, or of access (connection refused, the proxy's own error codes,
401 / 403 / 404 / 407, 429 and 502 / 503: come back later) says nothing about the model: the pair is recorded
as an error, left out of every number, and retried on the next run until it is scored.
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
    try:
        body: Any = r.json()
    except ValueError:
        body = None
    err = body.get("error", body) if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {}
    code = err.get("code")
    if not isinstance(code, str) or not code or code.isdigit():
        code = err.get("type") if isinstance(err.get("type"), str) and err.get("type") else None
    return str(code or f"http_{r.status_code}")[:100], str(err.get("message") or r.text)[:500]


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
            code, message = error_of(r)
            failed = Failed(code, message, r.status_code, is_model_failure(r.status_code, code), attempt,
                            r.headers.get("x-toolquake-request-id"))
        if not _transient(failed.http_status, failed.code) or attempt == ATTEMPTS:
            return failed
        if drop is not None:
            drop(failed.request_id)
        await asyncio.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")  # pragma: no cover
