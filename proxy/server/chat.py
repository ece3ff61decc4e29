"""The model routes (chat completions and the Responses API), as route glue: decode the request, choose its
profile, perturb, forward, and hand the upstream's answer to the answer path (proxy/server/answer/).

A request is two objects from its decoding to its last byte: `Asked` (what it is, fixed once decoded) and
`Served` (what happened to it); the log line and the observers (live scoring, replay) are fed from them
after the client was answered. Both APIs go through the same steps; an `Api` (proxy/server/apis.py)
converts its wire form to the one internal, chat-shaped form and back.
"""

from __future__ import annotations

import codecs
import random
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
import structlog
from litestar import Request, Response
from litestar.response import Stream

from toolquake.perturbers import ChatRequest
from toolquake.proxy.server.answer.observe import finish
from toolquake.proxy.server.answer.path import AnswerPath
from toolquake.proxy.server.answer.plain import JSON, Plain
from toolquake.proxy.server.apis import Api
from toolquake.proxy.server.config import shown_name
from toolquake.proxy.server.errors import ProxyError
from toolquake.proxy.server.pipeline import PerturbationFailed, perturbation_seed_for, run_profile
from toolquake.proxy.server.state import UNDECIDED, Asked, ProxyState, Served
from toolquake.proxy.server.upstream import UpstreamError, UpstreamResponse, request_headers

if TYPE_CHECKING:
    from toolquake.proxy.server.profiles import Profile, ProfileStore

__all__ = ["ChatHandler", "Plain", "client_headers", "error_response", "send_upstream", "unknown_profile"]

log = structlog.get_logger("toolquake.proxy")
#: the most profiles an unknown-profile error names
UNKNOWN_PROFILE_NAMES = 8
_decode = msgspec.json.decode
_encode = msgspec.json.encode


def client_headers(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]


def new_request_id() -> str:
    """16 hex digits, unique enough to find one request in the logs (not a secret)."""
    return f"{random.getrandbits(64):016x}"


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The first value of header `name` (lower-case)."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def invalid_json(exc: Exception) -> ProxyError:
    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return ProxyError(400, f"Request body is not valid JSON: {reason}", code="invalid_json")


#: bytes of a large body checked as UTF-8 at a time (never a whole second copy of it as text)
_UTF8_SLICE = 1 << 16


def check_utf8(raw: bytes) -> None:
    """Raise UnicodeDecodeError where `raw` is not UTF-8: the typed decode does not look inside the fields it
    skips, and a body that is not UTF-8 is not JSON. Linear; in slices beyond 64 KiB."""
    if raw.isascii():
        return
    if len(raw) <= _UTF8_SLICE:
        raw.decode()
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    for i in range(0, len(raw), _UTF8_SLICE):
        decoder.decode(raw[i:i + _UTF8_SLICE], final=i + _UTF8_SLICE >= len(raw))


def error_response(exc: ProxyError, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(content=exc.body(), status_code=exc.status, media_type=JSON, headers=extra_headers)


def unknown_profile(name: str, profiles: ProfileStore) -> ProxyError:
    """404 for a profile that does not exist, naming at most UNKNOWN_PROFILE_NAMES of the operator's profiles (any
    client can ask: never one the admin API added, nor all of a long list)."""
    known = profiles.configured_now()
    listed = ", ".join(known[:UNKNOWN_PROFILE_NAMES])
    more = f" (and {len(known) - UNKNOWN_PROFILE_NAMES} more)" if len(known) > UNKNOWN_PROFILE_NAMES else ""
    return ProxyError(404, f"Unknown profile {shown_name(name)}. Known profiles: {listed}{more}.",
                      code="unknown_profile")


async def send_upstream(st: ProxyState, method: str, url: str, headers: list[tuple[str, str]],
                        content: bytes | None, params: str = "") -> UpstreamResponse:
    """Send to the backend; failures become the proxy's own 502/504 (and are counted)."""
    try:
        return await st.upstream.send(method, url, headers, content, params)
    except UpstreamError as exc:
        st.metrics.upstream_errors.labels(exc.kind).inc()
        if exc.kind == "timeout":
            raise ProxyError(504, "The upstream model server did not answer in time. Retry, or raise "
                             "[server] read_timeout.", type="upstream_error", code="upstream_timeout") from None
        raise ProxyError(502, f"The upstream model server could not be reached ({exc.cause_name}). "
                         "Check [server] upstream and that the backend is running.",
                         type="upstream_error", code="upstream_unreachable") from None


class Refused(Exception):
    """A request refused while it was decoded, with what was known of it by then (for its log line)."""

    def __init__(self, error: ProxyError, asked: Asked) -> None:
        super().__init__(error.message)
        self.error = error
        self.asked = asked


class ChatHandler:
    """Serves one model request (of `api`) end to end."""

    def __init__(self, st: ProxyState, api: Api) -> None:
        self.st = st
        self.api = api
        self.answers = AnswerPath(st)

    async def __call__(self, request: Request, profile_name: str | None) -> Response:
        answer = await self.handle(client_headers(request), request.body, profile_name)
        return answer.to_response() if isinstance(answer, Plain) else answer

    async def handle(self, headers: list[tuple[str, str]], read_body: Callable[[], Awaitable[bytes]],
                     profile_name: str | None) -> Plain | Stream:
        """Serve one request (its headers, and how to read its body); the framework's or the lean path's."""
        st = self.st
        request_id, t0 = new_request_id(), time.perf_counter()
        served, asked = Served(), None
        served.trace = st.tracing.begin(headers, t0)  # None: not traced (hooks.Tracer)
        st.metrics.in_flight.inc()
        streamed = False  # a streamed answer finishes (and leaves in_flight) in its background task
        try:
            raw = await read_body()
            asked = self._receive(request_id, t0, headers, raw, profile_name)
            response = await self._serve(asked, served, raw)
            streamed = isinstance(response, Stream)
            return response
        except Refused as refused:
            return self._refuse(refused.asked, served, refused.error)
        except ProxyError as exc:
            return self._refuse(asked or Asked(request_id, t0, self.api), served, exc)
        finally:
            if not streamed:
                st.metrics.in_flight.dec()

    def _refuse(self, asked: Asked, served: Served, exc: ProxyError) -> Plain:
        served.status = exc.status
        finish(self.st, asked, served, observe=False)
        return Plain(exc.body(), exc.status, {"X-Toolquake-Request-Id": asked.request_id})

    def _receive(self, request_id: str, t0: float, headers: list[tuple[str, str]], raw: bytes,
                 profile_name: str | None) -> Asked:
        """Decode the request: what it is, from here on fixed. A request refused on the way is logged with
        what was known of it by then."""
        st, api = self.st, self.api
        st.metrics.child(st.metrics.request_decodes, "typed").inc()
        try:
            typed = api.decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise Refused(ProxyError(400, f"Invalid request body: {exc}", code="invalid_type"),
                          Asked(request_id, t0, api)) from None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise Refused(invalid_json(exc), Asked(request_id, t0, api)) from None
        stream, model = bool(typed.stream), typed.model
        name = profile_name or header(headers, "x-toolquake-profile") or st.config.server.default_profile
        profile = st.profiles.get(name)
        if profile is None:
            raise Refused(unknown_profile(name, st.profiles),
                          Asked(request_id, t0, api, stream=stream, model=model))
        case_header = header(headers, "x-toolquake-case")
        read, case = self._reads(profile, case_header, typed)
        if not read:  # nobody reads the request: validated only (its bytes as UTF-8 too), and forwarded as it is
            try:
                check_utf8(raw)
            except UnicodeDecodeError as exc:
                raise Refused(invalid_json(exc), Asked(request_id, t0, api, profile, stream, model,
                                                       case_header=case_header)) from None
            return Asked(request_id, t0, api, profile, stream, model, case_header=case_header,
                         forward_headers=request_headers(headers))
        return self._decode(Asked(request_id, t0, api, profile, stream, model, case_header=case_header,
                                  forward_headers=request_headers(headers),
                                  observed=bool(st.observers or st.case_observers)), headers, raw, case)

    def _reads(self, profile: Profile, case_header: str | None, typed: Any) -> tuple[bool, Any]:
        """Whether the request must be decoded whole (its profile perturbs it, or an observer reads it), and its
        case when that is known without decoding it (else UNDECIDED: the decoded request decides)."""
        st = self.st
        if st.observers or profile.perturbs or st.tracing.contents:  # spans with contents carry the request
            return True, UNDECIDED
        if not st.case_observers:
            return False, None
        if profile.mode == "shadow":  # every request of a shadow profile gets a twin
            return True, UNDECIDED
        if st.case_resolver is None:
            return False, None
        try:
            case = st.case_resolver.quick(case_header, self.api.case_hint(typed))
        except Exception as exc:  # fail-open: an unknown case never breaks the request
            log.warning("case_resolution_failed", error_type=type(exc).__name__)
            return False, None
        return case is not None, case

    def _decode(self, light: Asked, headers: list[tuple[str, str]], raw: bytes, case: Any) -> Asked:
        """The request decoded whole (for its perturbers and observers), its case (resolved here when still
        UNDECIDED) and its perturbation seed."""
        st, api = self.st, self.api
        st.metrics.child(st.metrics.request_decodes, "whole").inc()
        try:
            body = _decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            # e.g. bad UTF-8 in a key the typed decode skipped
            error = invalid_json(exc)
        else:
            error = None if isinstance(body, dict) else \
                ProxyError(400, "Request body must be a JSON object.", code="invalid_type")
        if error is not None:
            raise Refused(error, light._replace(forward_headers=()))
        request, conversion = api.to_internal(body)
        chat = ChatRequest(request)
        if case is UNDECIDED:
            case = None
            if st.case_resolver is not None:
                try:
                    case = st.case_resolver(light.case_header, chat)
                except Exception as exc:  # fail-open: an unknown case never breaks the request
                    log.warning("case_resolution_failed", error_type=type(exc).__name__)
        seed = perturbation_seed_for(header(headers, "x-toolquake-seed"), raw,
                                     conversation=header(headers, "x-toolquake-conversation"), request=chat)
        return light._replace(perturbation_seed=seed, case=case, request=request, wire_request=body,
                              conversion=conversion)

    async def _serve(self, asked: Asked, served: Served, raw: bytes) -> Plain | Stream:
        st, profile, api = self.st, asked.profile, self.api
        assert profile is not None
        send_raw = raw
        served.sent = asked.request
        if asked.request is not None and profile.perturbs:
            try:
                served.outcome = await run_profile(profile, ChatRequest(asked.request), asked.perturbation_seed,
                                                   st.services, asked.case)
            except PerturbationFailed as exc:
                st.metrics.count_failure(exc, profile.name)
                raise ProxyError(500, str(exc), type="server_error", code="perturbation_failed") from None
            st.metrics.count_outcome(served.outcome, getattr(st.services.token_counter, "source", "none"),
                                     profile.name)
            served.sent = served.outcome.request.body
            if served.outcome.changed:
                send_raw = _encode(api.to_wire(served.sent, asked.wire_request or {}, asked.conversion))
        served.sent_raw = send_raw
        served.t_upstream = time.perf_counter()
        headers = asked.forward_headers if served.trace is None else \
            served.trace.sending(asked, served, asked.forward_headers)
        upstream = await send_upstream(st, "POST", st.upstream.api_url(api.path), headers, send_raw)
        return await self.answers.serve(asked, served, upstream)
