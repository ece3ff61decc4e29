"""A whole (not streamed) answer: read, checked to be a JSON object, rewritten by the steps that need it,
counted, and handed back as a `Plain` that the lean path writes itself or the framework route turns into a
Response."""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
import structlog
from litestar import Response
from litestar.background_tasks import BackgroundTask

from toolquake.proxy.server.answer.observe import finish
from toolquake.proxy.server.errors import ProxyError
from toolquake.proxy.server.upstream import AnswerTooLarge, UpstreamError, response_headers

if TYPE_CHECKING:
    from toolquake.proxy.server.answer.base import AnswerStep, Plan
    from toolquake.proxy.server.answer.path import AnswerPath
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.state import Asked, ProxyState, Served
    from toolquake.proxy.server.upstream import UpstreamResponse

log = structlog.get_logger("toolquake.proxy")
JSON = "application/json"
_decode = msgspec.json.decode
#: valid JSON whose top level is an object (values checked, not built)
_check_object = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode = msgspec.json.encode


class Plain:
    """A whole answer of a model route: the lean path writes it itself (proxy/server/lean.py), the framework
    route turns it into a Response (`to_response`). `background`: a coroutine function run after the client
    has the answer."""

    __slots__ = ("content", "status_code", "headers", "media_type", "background")

    def __init__(self, content: bytes, status_code: int, headers: dict[str, str] | None = None,
                 media_type: str = JSON, background: Callable[[], Awaitable[None]] | None = None) -> None:
        self.content = content
        self.status_code = status_code
        self.headers = headers if headers is not None else {}
        self.media_type = media_type
        self.background = background

    def to_response(self) -> Response:
        return Response(content=self.content, status_code=self.status_code, headers=self.headers,
                        media_type=self.media_type,
                        background=BackgroundTask(self.background) if self.background is not None else None)


def bad_upstream_answer(what: str) -> ProxyError:
    return ProxyError(502, f"The upstream model server answered 2xx with {what}; see the backend's log.",
                      type="upstream_error", code="upstream_invalid_response")


def answer_too_large(st: ProxyState, asked: Asked, served: Served) -> ProxyError:
    """An answer past `[server] max_answer_bytes` that a step must read whole (to restore or rewrite it): the
    client gets this error in its place, and nothing more of the answer is read."""
    limit = st.config.server.max_answer_bytes
    st.metrics.upstream_errors.labels("too_large").inc()
    served.uninspected = "too_large"
    log.warning("answer_too_large", request_id=asked.request_id, route=asked.route, stream=asked.stream,
                max_answer_bytes=limit, relayed=False)
    return ProxyError(502, f"The upstream model server's answer is larger than {limit} bytes ([server] "
                      "max_answer_bytes), and this request's profile must read it whole to change it.",
                      type="upstream_error", code="upstream_answer_too_large")


async def plain_answer(path: AnswerPath, asked: Asked, served: Served, upstream: UpstreamResponse,
                       plan: Plan) -> Plain:
    """The answer read whole and sent as a `Plain`; `AnswerTooLarge` (the response left open) where it runs past
    `[server] max_answer_bytes` and no step must change it: the caller relays it uninspected."""
    st = path.st
    kept = False
    try:
        data = await upstream.aread(st.config.server.max_answer_bytes)
    except AnswerTooLarge:
        if plan.whole:
            raise answer_too_large(st, asked, served) from None
        kept = True
        raise
    except UpstreamError as exc:
        st.metrics.upstream_errors.labels(exc.kind).inc()
        if exc.kind == "timeout":
            raise ProxyError(504, "The upstream model server stopped answering mid-response.",
                             type="upstream_error", code="upstream_timeout") from None
        raise ProxyError(502, f"The upstream connection failed mid-response ({exc.cause_name}).",
                         type="upstream_error", code="upstream_unreachable") from None
    finally:
        if not kept:
            await upstream.aclose()
    served.upstream_s = time.perf_counter() - (served.t_upstream or asked.t0)
    served.status = upstream.status_code
    headers = response_headers(upstream.headers)
    relayed = data
    ok = 200 <= served.status < 300
    if ok:
        reads = plan.reads(asked)
        parsed = _parse(st.metrics, data, reads, plan.check, asked, served)
        if reads:
            sent = await path.rewrite(asked, served, plan, parsed)
            if sent is not parsed:
                data = _encode(sent)
    total = time.perf_counter() - asked.t0
    headers["X-Toolquake-Overhead-Ms"] = f"{(total - served.upstream_s) * 1000:.3f}"
    headers["X-Toolquake-Request-Id"] = asked.request_id
    st.metrics.child(st.metrics.ttfb, asked.profile_name, "false").observe(total)
    after = partial(path.after_bytes, asked, served, plan, relayed) if ok and plan.bytes else None
    if after is not None and served.trace is not None:  # the span waits for the checks after the last byte
        served.trace.hold()
    finish(st, asked, served)
    return Plain(data, served.status, headers, upstream.header("content-type", JSON), after)


def _parse(m: Metrics, data: bytes, reads: bool, check: AnswerStep | None, asked: Asked, served: Served) -> Any:
    """A 2xx answer to a model request is a JSON object; anything else is the backend's bug, said as one.
    When nobody reads the answer it is only checked (its values validated, not built), by the decode of the step
    that reads it in the check (`check`, `AnswerStep.on_check`) where there is one."""
    try:
        if reads:
            parsed = _decode(data)
        elif check is None or (parsed := check.on_check(asked, served, data)) is None:
            parsed = _check_object(data)
    except msgspec.ValidationError:
        parsed = None
    except msgspec.DecodeError:
        m.upstream_errors.labels("invalid_response").inc()
        raise bad_upstream_answer("a body that is not JSON" if data.strip() else "an empty body") from None
    except RecursionError:  # valid JSON nested past the decoder's limit
        m.upstream_errors.labels("invalid_response").inc()
        raise bad_upstream_answer("JSON nested too deeply") from None
    if not isinstance(parsed, dict):
        m.upstream_errors.labels("invalid_response").inc()
        raise bad_upstream_answer("JSON that is not an object")
    return parsed
