"""The model routes (chat completions and the Responses API): decode, choose the profile, perturb,
forward, relay or restore, count.

A request is two objects from its decoding to its last byte: `Asked` (what it is, fixed) and `Served`
(what happened to it); the log line and the observers (live scoring, replay) are fed from them after
the client was answered. Both APIs go
through the same steps; an `Api` (proxy/server/apis.py) converts its wire form to the one internal,
chat-shaped form and back.
"""

from __future__ import annotations

import random
import time
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
import structlog
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from toolquake.perturbers import ChatRequest
from toolquake.proxy.server import conformance, logs, responses, streaming
from toolquake.proxy.server.apis import CHAT, Api
from toolquake.proxy.server.errors import ProxyError, error_body
from toolquake.proxy.server.pipeline import PerturbationFailed, restore, run_profile, seed_for
from toolquake.proxy.server.state import Asked, ProxyState, Served
from toolquake.proxy.server.upstream import UpstreamError, UpstreamResponse, request_headers, response_headers

log = structlog.get_logger("toolquake.proxy")
JSON = "application/json"
CHAT_ROUTE = "chat_completions"
#: follow-up rounds the proxy may spend answering calls to tools it added (`injected_calls = "answer"`)
MAX_INJECTED_ROUNDS = 3
UNAVAILABLE = ("Error: the tool {name!r} is not available. Do not call it again; use the other tools, "
               "or answer without it.")
_decode = msgspec.json.decode
#: valid JSON whose top level is an object (values checked, not built)
_check_object = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
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


def error_response(exc: ProxyError, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(content=exc.body(), status_code=exc.status, media_type=JSON, headers=extra_headers)


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


def unknown_profile(name: str, known: list[str]) -> ProxyError:
    return ProxyError(404, f"Unknown profile {name!r}. Known profiles: {', '.join(known)}.", code="unknown_profile")


def bad_upstream_answer(what: str) -> ProxyError:
    return ProxyError(502, f"The upstream model server answered 2xx with {what}; see the backend's log.",
                      type="upstream_error", code="upstream_invalid_response")


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


def _calls(answer: dict[str, Any] | None) -> list[dict[str, Any]]:
    choices = (answer or {}).get("choices") or []
    message = (choices[0] or {}).get("message") if choices and isinstance(choices[0], dict) else None
    return [c for c in (message or {}).get("tool_calls") or [] if isinstance(c, dict)]


def _call_name(call: dict[str, Any]) -> str:
    return str((call.get("function") or {}).get("name"))


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

    async def __call__(self, request: Request, profile_name: str | None) -> Response:
        answer = await self.handle(client_headers(request), request.body, profile_name)
        return answer.to_response() if isinstance(answer, Plain) else answer

    async def handle(self, headers: list[tuple[str, str]], read_body: Callable[[], Awaitable[bytes]],
                     profile_name: str | None) -> Plain | Stream:
        """Serve one request (its headers, and how to read its body); the framework's or the lean path's."""
        st = self.st
        request_id, t0 = new_request_id(), time.perf_counter()
        served, asked = Served(), None
        st.metrics.in_flight.inc()
        streamed = False  # a streamed answer finishes (and leaves in_flight) in its background task
        try:
            raw = await read_body()
            asked = self._receive(request_id, t0, headers, raw, profile_name)
            response = await self._serve(asked, served, headers, raw)
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
        self._finish(asked, served, observe=False)
        return Plain(exc.body(), exc.status, {"X-Toolquake-Request-Id": asked.request_id})

    def _receive(self, request_id: str, t0: float, headers: list[tuple[str, str]], raw: bytes,
                 profile_name: str | None) -> Asked:
        """Decode the request: what it is, from here on fixed. A request refused on the way is logged with
        what was known of it by then."""
        st, api = self.st, self.api
        try:
            req = api.decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise Refused(ProxyError(400, f"Invalid request body: {exc}", code="invalid_type"),
                          Asked(request_id, t0, api)) from None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise Refused(invalid_json(exc), Asked(request_id, t0, api)) from None
        stream, model = bool(req.stream), req.model
        name = profile_name or header(headers, "x-toolquake-profile") or st.config.server.default_profile
        profile = st.profiles.get(name)
        if profile is None:
            raise Refused(unknown_profile(name, st.profiles.names()),
                          Asked(request_id, t0, api, stream=stream, model=model))
        observed = bool(st.observers)
        case_header = header(headers, "x-toolquake-case")
        if not observed and (profile.mode != "perturb" or not profile.steps):  # nobody reads the request
            return Asked(request_id, t0, api, profile, stream, model, case_header=case_header,
                         forward_headers=request_headers(headers))
        try:
            body = _decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            # e.g. bad UTF-8 in a key the typed decode skipped
            error = invalid_json(exc)
        else:
            error = None if isinstance(body, dict) else \
                ProxyError(400, "Request body must be a JSON object.", code="invalid_type")
        if error is not None:
            raise Refused(error, Asked(request_id, t0, api, profile, stream, model, case_header=case_header,
                                       observed=observed))
        request, conversion = api.to_internal(body)
        chat = ChatRequest(request)
        case = None
        if st.case_resolver is not None:
            try:
                case = st.case_resolver(case_header, chat)
            except Exception as exc:  # fail-open: an unknown case never breaks the request
                log.warning("case_resolution_failed", error_type=type(exc).__name__)
        seed = seed_for(header(headers, "x-toolquake-seed"), raw,
                        conversation=header(headers, "x-toolquake-conversation"), request=chat)
        return Asked(request_id, t0, api, profile, stream, model, seed, case, case_header, request, body, conversion,
                     request_headers(headers), observed)

    async def _serve(self, asked: Asked, served: Served, headers: list[tuple[str, str]], raw: bytes) -> Plain | Stream:
        st, profile, api = self.st, asked.profile, self.api
        assert profile is not None
        send_raw = raw
        served.sent = asked.request
        if asked.request is not None and profile.mode == "perturb" and profile.steps:
            try:
                served.outcome = await run_profile(profile, ChatRequest(asked.request), asked.seed, st.services,
                                                   asked.case)
            except PerturbationFailed as exc:
                st.metrics.perturbation_failures.labels(exc.perturber).inc()
                raise ProxyError(500, str(exc), type="server_error", code="perturbation_failed") from None
            st.metrics.count_outcome(served.outcome, getattr(st.services.token_counter, "source", "none"))
            served.sent = served.outcome.request.body
            if served.outcome.changed:
                send_raw = _encode(api.to_wire(served.sent, asked.wire_request or {}, asked.conversion))
        served.sent_raw = send_raw
        served.t_upstream = time.perf_counter()
        upstream = await send_upstream(st, "POST", st.upstream.api_url(api.path), asked.forward_headers, send_raw)
        if asked.stream and 200 <= upstream.status_code < 300 \
                and "text/event-stream" in upstream.header("content-type"):
            if self._streams_text(asked, served):
                if self.api is CHAT:
                    return self._stream_text_through(upstream, asked, served)
                return self._stream_text_through_responses(upstream, asked, served)
            if self._rewrites(asked, served):
                return await self._stream_rewritten(upstream, asked, served)
            return self._stream_relay(upstream, asked, served)
        return await self._plain(upstream, asked, served)

    @staticmethod
    def _rewrites(asked: Asked, served: Served) -> bool:
        """The answer must be read whole before the client gets it: a step rewrites it, or calls to tools
        the proxy added are answered by the proxy."""
        if asked.profile is not None and asked.profile.spec.repair:
            return True
        outcome = served.outcome
        if outcome is None:
            return False
        answers_injected = bool(outcome.injected) and asked.profile is not None \
            and asked.profile.spec.injected_calls == "answer"
        return outcome.rewrites_response or answers_injected

    def _streams_text(self, asked: Asked, served: Served) -> bool:
        """A chat stream whose only rewriting step declares `streams_text`, and no added-tool calls to answer:
        its plain text can reach the client as it arrives."""
        outcome = served.outcome
        if outcome is None or len(outcome.restorers) != 1:
            return False
        if outcome.injected and asked.profile is not None and asked.profile.spec.injected_calls == "answer":
            return False
        return outcome.restorers[0][0].streams_text

    def _stream_text_through(self, upstream: UpstreamResponse, asked: Asked, served: Served) -> Stream:
        """Relay the answer's plain text as it arrives, up to what the step releases (text that cannot become
        a call any more); at the end restore the whole answer and send the rest: the remaining text, or the
        calls the text turned into."""
        assert served.outcome is not None
        perturber, pctx = served.outcome.restorers[0]
        m = self.st.metrics
        served.status = 200
        state: dict[str, Any] = {"first": None, "end": None}

        async def relay() -> AsyncIterator[bytes]:
            parser, asm = streaming.SSEParser(), streaming.StreamAssembler()
            raw: list[bytes] = []
            released, sent_role, base = 0, False, None

            def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
                chunk = {**(base or {}), "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                return b"data: " + _encode(chunk) + b"\n\n"

            try:
                async for data in upstream.aiter_raw():
                    raw.append(data)
                    for payload in parser.feed(data):
                        asm.add_payload(payload)
                    if base is None and asm.id is not None:
                        base = {"id": asm.id, "object": "chat.completion.chunk", "created": asm.created or 0,
                                "model": asm.model or ""}
                    text = ((asm.choices.get(0) or {}).get("content")) or ""
                    upto = perturber.stream_release(text, pctx) if text else 0
                    if base is not None and upto > released:
                        out = b""
                        if not sent_role:
                            out += frame({"role": "assistant", "content": ""})
                            sent_role = True
                        out += frame({"content": text[released:upto]})
                        released = upto
                        if state["first"] is None:
                            state["first"] = time.perf_counter()
                            m.ttfb.labels(asked.profile_name, "true").observe(state["first"] - asked.t0)
                        yield out
                for payload in parser.flush():
                    asm.add_payload(payload)
                whole = state["whole"] = b"".join(raw)
                if not any(x in whole for x in self.api.end_markers):
                    served.status = 502
                    yield self._stream_error("invalid_response", "The upstream model server sent "
                                             + ("an empty stream." if not whole.strip() else
                                                "a stream that ended unfinished."), "upstream_invalid_response")
                    return
                answer = asm.result()
                text = ((answer.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
                restored, failed = restore(served.outcome, answer)
                m.count_restore_failures(failed)
                served.response = restored
                # what the client still needs: the restored answer, less the text it already has
                rest = json_copy(restored)
                for choice in rest.get("choices") or []:
                    msg = choice.get("message") or {}
                    if choice.get("index", 0) == 0 and released:
                        content = msg.get("content")
                        if msg.get("tool_calls") or not isinstance(content, str):
                            msg["content"] = None
                        else:
                            msg["content"] = content[released:] if content.startswith(text[:released]) else content
                frames = list(streaming.emit_stream(rest))
                if sent_role:  # the role chunk went out with the first text
                    frames = frames[1:]
                if state["first"] is None and frames:
                    state["first"] = time.perf_counter()
                    m.ttfb.labels(asked.profile_name, "true").observe(state["first"] - asked.t0)
                for f in frames:
                    yield f
            except UpstreamError as exc:
                served.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            served.upstream_s = (state["end"] or time.perf_counter()) - (served.t_upstream or asked.t0)
            self._finish(asked, served)
            m.in_flight.dec()
            if served.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(asked, served, state.get("whole"))

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, asked, served),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    def _stream_text_through_responses(self, upstream: UpstreamResponse, asked: Asked, served: Served) -> Stream:
        """`_stream_text_through` for the Responses API: the message item opens with the first released text;
        the rest (remaining text, then the calls) follows once the answer is complete and restored."""
        assert served.outcome is not None
        perturber, pctx = served.outcome.restorers[0]
        m, api = self.st.metrics, self.api
        served.status = 200
        state: dict[str, Any] = {"first": None, "end": None}

        def first_byte() -> None:
            if state["first"] is None:
                state["first"] = time.perf_counter()
                m.ttfb.labels(asked.profile_name, "true").observe(state["first"] - asked.t0)

        async def relay() -> AsyncIterator[bytes]:
            through, raw = responses.TextThrough(), []
            try:
                async for data in upstream.aiter_raw():
                    raw.append(data)
                    through.feed(data)
                    out = through.release(perturber.stream_release(through.text, pctx)) if through.text else b""
                    if out:
                        first_byte()
                        yield out
                whole = state["whole"] = b"".join(raw)
                native = api.assemble(whole)
                if native is None or not any(x in whole for x in api.end_markers):
                    served.status = 502
                    yield self._stream_error("invalid_response", "The upstream model server sent "
                                             + ("an empty stream." if native is None else
                                                "a stream that ended unfinished."), "upstream_invalid_response")
                    return
                restored, failed = restore(served.outcome, api.answer_to_internal(native))
                m.count_restore_failures(failed)
                served.response = restored
                for frame in through.finish(api.answer_to_wire(restored, native)):
                    first_byte()
                    yield frame
            except UpstreamError as exc:
                served.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            served.upstream_s = (state["end"] or time.perf_counter()) - (served.t_upstream or asked.t0)
            self._finish(asked, served)
            m.in_flight.dec()
            if served.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(asked, served, state.get("whole"))

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, asked, served),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _finish_answer(self, asked: Asked, served: Served, wire: dict[str, Any]) -> dict[str, Any]:
        """Restore what the steps rewrote, handle calls to added tools; the answer to send, in wire form."""
        st, api = self.st, self.api
        internal = api.answer_to_internal(wire)
        changed = False
        if asked.profile is not None and asked.profile.spec.repair:
            internal, served.repaired = conformance.repair_answer(internal, self._offered(asked, served))
            if served.repaired is not None:
                st.metrics.conformance_repairs.labels(st.metrics.model_label(asked.model), api.route,
                                                      "true" if asked.stream else "false", served.repaired).inc()
                changed = True
        if served.outcome is not None and served.outcome.rewrites_response:
            internal, failed = restore(served.outcome, internal)
            st.metrics.count_restore_failures(failed)
            changed = True
        if served.outcome is not None and served.outcome.injected:
            internal, handled = await self._injected(asked, served, internal)
            changed = changed or handled
        served.response = internal
        if not changed:
            return wire
        return api.answer_to_wire(internal, wire)

    async def _injected(self, asked: Asked, served: Served, answer: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Count calls to tools the proxy added; under `answer`, keep them from the client: strip them when
        the model also called the client's own tools, else tell the model they are unavailable and ask
        again (at most MAX_INJECTED_ROUNDS times; then the calls are stripped)."""
        assert served.outcome is not None and asked.profile is not None
        injected = served.outcome.injected
        answer_them = asked.profile.spec.injected_calls == "answer"
        request = served.outcome.request.body
        for _ in range(MAX_INJECTED_ROUNDS + 1):
            calls = _calls(answer)
            bad = [c for c in calls if _call_name(c) in injected]
            if not bad:
                return answer, False if answer is None else bool(served.injected_calls)
            for call in bad:
                served.injected_calls += (_call_name(call),)
                self.st.metrics.injected_calls.labels(asked.profile_name, injected[_call_name(call)]).inc()
            if not answer_them:
                return answer, False
            if len(bad) < len(calls) or _ == MAX_INJECTED_ROUNDS:
                return _strip(answer, {id(c) for c in bad}), True
            message = answer["choices"][0]["message"]
            request = {**request, "stream": False,
                       "messages": [*request.get("messages", []), {**message, "role": "assistant"},
                                    *({"role": "tool", "tool_call_id": c.get("id", ""),
                                       "content": UNAVAILABLE.format(name=_call_name(c))} for c in bad)]}
            request.pop("stream_options", None)
            previous, answer = answer, await self._ask_again(asked, served, request)
            if answer is None:  # the follow-up failed: the client gets the answer without the added calls
                return _strip(previous, {id(c) for c in bad}), True
        return answer, True

    async def _ask_again(self, asked: Asked, served: Served, request: dict[str, Any]) -> dict[str, Any] | None:
        api = self.api
        wire = api.to_wire(request, {**(asked.wire_request or {}), "stream": False}, asked.conversion)
        try:
            resp = await self.st.upstream.send("POST", self.st.upstream.api_url(api.path), asked.forward_headers,
                                               _encode(wire))
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            answer = _decode(data) if resp.status_code == 200 else None
        except (UpstreamError, msgspec.DecodeError, RecursionError) as exc:
            log.warning("injected_followup_failed", request_id=asked.request_id, error_type=type(exc).__name__)
            return None
        return api.answer_to_internal(answer) if isinstance(answer, dict) else None

    async def _plain(self, upstream: UpstreamResponse, asked: Asked, served: Served) -> Plain:
        st = self.st
        try:
            data = await upstream.aread()
        except UpstreamError as exc:
            st.metrics.upstream_errors.labels(exc.kind).inc()
            if exc.kind == "timeout":
                raise ProxyError(504, "The upstream model server stopped answering mid-response.",
                                 type="upstream_error", code="upstream_timeout") from None
            raise ProxyError(502, f"The upstream connection failed mid-response ({exc.cause_name}).",
                             type="upstream_error", code="upstream_unreachable") from None
        finally:
            await upstream.aclose()
        served.upstream_s = time.perf_counter() - (served.t_upstream or asked.t0)
        served.status = upstream.status_code
        resp_headers = response_headers(upstream.headers)
        relayed = data
        if 200 <= served.status < 300:
            # a 2xx answer to a model request is a JSON object; anything else is the backend's bug, said as one.
            # When nobody reads the answer it is only checked (its values validated, not built)
            reads = asked.observed or self._rewrites(asked, served) \
                or (served.outcome is not None and served.outcome.injected)
            try:
                parsed = _decode(data) if reads else _check_object(data)
            except msgspec.ValidationError:
                parsed = None
            except msgspec.DecodeError:
                st.metrics.upstream_errors.labels("invalid_response").inc()
                raise bad_upstream_answer("a body that is not JSON" if data.strip() else "an empty body") from None
            except RecursionError:  # valid JSON nested past the decoder's limit
                st.metrics.upstream_errors.labels("invalid_response").inc()
                raise bad_upstream_answer("JSON nested too deeply") from None
            if not isinstance(parsed, dict):
                st.metrics.upstream_errors.labels("invalid_response").inc()
                raise bad_upstream_answer("JSON that is not an object")
            if reads:
                sent = await self._finish_answer(asked, served, parsed)
                if sent is not parsed:
                    data = _encode(sent)
        total = time.perf_counter() - asked.t0
        resp_headers["X-Toolquake-Overhead-Ms"] = f"{(total - served.upstream_s) * 1000:.3f}"
        resp_headers["X-Toolquake-Request-Id"] = asked.request_id
        st.metrics.child(st.metrics.ttfb, asked.profile_name, "false").observe(total)
        self._finish(asked, served)
        check = partial(self._check, asked, served, relayed) if 200 <= served.status < 300 else None
        return Plain(data, served.status, resp_headers, upstream.header("content-type", JSON), check)

    def _stream_error(self, kind: str, message: str, code: str) -> bytes:
        self.st.metrics.upstream_errors.labels(kind).inc()
        return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"

    def _stream_relay(self, upstream: UpstreamResponse, asked: Asked, served: Served) -> Stream:
        """Relay the upstream SSE chunk by chunk; capture a copy only when someone will score it. A stream
        that ends without its end marker (chat `[DONE]`, a final Responses event) gets an error event."""
        parts: list[bytes] = []
        state: dict[str, Any] = {"first": None, "end": None, "ended": False, "tail": b""}
        served.status = 200
        m = self.st.metrics
        markers = self.api.end_markers
        keep = max(len(x) for x in markers) if markers else 0
        # a copy of the stream is kept for observers, and to count calls to tools the proxy added
        capture = asked.observed or bool(served.outcome is not None and served.outcome.injected) \
            or self.st.config.server.conformance

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if state["first"] is None:
                        state["first"] = time.perf_counter()
                        m.child(m.ttfb, asked.profile_name, "true").observe(state["first"] - asked.t0)
                    if capture:
                        parts.append(chunk)
                    if not state["ended"]:
                        seen = state["tail"] + chunk
                        state["ended"] = any(x in seen for x in markers)
                        state["tail"] = seen[-keep:]
                    yield chunk
                if not state["ended"]:
                    served.status = 502
                    what = "an empty stream" if state["first"] is None else "a stream that ended unfinished"
                    yield self._stream_error("invalid_response", f"The upstream model server sent {what}.",
                                             "upstream_invalid_response")
            except UpstreamError as exc:
                # headers are sent: tell the client in-band, the way OpenAI streams report errors
                served.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            served.upstream_s = (state["end"] or time.perf_counter()) - (served.t_upstream or asked.t0)
            whole = b"".join(parts) if capture and parts else b""
            if whole and (asked.observed or (served.outcome is not None and bool(served.outcome.injected))):
                native = self.api.assemble(whole)
                served.response = self.api.answer_to_internal(native) if native else None
                if served.response is not None and served.outcome is not None and served.outcome.injected:
                    # counted; "pass" changes nothing
                    served.response, _ = await self._injected(asked, served, served.response)
            self._finish(asked, served)
            m.in_flight.dec()
            if whole and served.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(asked, served, whole)

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, asked, served),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _stream_rewritten(self, upstream: UpstreamResponse, asked: Asked, served: Served) -> Stream:
        """The answer must change before the client sees it: read the whole upstream stream, restore,
        re-emit it as a stream of the client's API."""
        m = self.st.metrics
        try:
            data = await upstream.aread()
        except UpstreamError as exc:
            m.upstream_errors.labels(exc.kind).inc()
            raise ProxyError(504 if exc.kind == "timeout" else 502, f"The upstream stream failed ({exc.cause_name}).",
                             type="upstream_error", code=f"upstream_{exc.kind}") from None
        finally:
            await upstream.aclose()
        native = self.api.assemble(data)
        if native is None or not any(x in data for x in self.api.end_markers):
            m.upstream_errors.labels("invalid_response").inc()
            raise bad_upstream_answer("an empty stream" if native is None else "a stream that ended unfinished")
        served.upstream_s = time.perf_counter() - (served.t_upstream or asked.t0)
        served.status = 200
        wire = await self._finish_answer(asked, served, native)
        frames = [data] if wire is native else list(self.api.emit(wire))  # unchanged: the bytes as they came
        first: dict[str, float | None] = {"t": None}

        async def emit() -> AsyncIterator[bytes]:
            for frame in frames:
                if first["t"] is None:
                    first["t"] = time.perf_counter()
                    m.ttfb.labels(asked.profile_name, "true").observe(first["t"] - asked.t0)
                yield frame

        async def cleanup() -> None:
            self._finish(asked, served)
            m.in_flight.dec()
            await self._check(asked, served, data)

        return Stream(emit(), status_code=200, headers=self._stream_headers(upstream, asked, served),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    def _offered(self, asked: Asked, served: Served) -> conformance.Offered:
        """The tools the backend was offered (the request as sent upstream)."""
        if served.outcome is not None and served.outcome.request.body is not None:
            return conformance.Offered.from_request(served.outcome.request.body)
        return conformance.Offered.from_raw(served.sent_raw) if served.sent_raw else conformance.Offered({})

    async def _check(self, asked: Asked, served: Served, relayed: bytes | None) -> None:
        """Check the answer the backend sent (`relayed`: its bytes, after the client got them) against the
        conformance rules; count, log and hand on what it broke. Fail-open: a checker that raises is counted."""
        st, m = self.st, self.st.metrics
        if not st.config.server.conformance or not relayed:
            return
        route, s = self.api.route, "true" if asked.stream else "false"
        try:
            offered = self._offered(asked, served)
            if not asked.stream and conformance.nothing_to_check(route, relayed, offered):
                found = []
            else:
                answer: bytes | Any = relayed if asked.stream else _decode(relayed)
                found = conformance.check(route, asked.stream, answer, offered)
        except Exception as exc:  # fail-open: the client has its answer; the check counts its own failure
            m.conformance_failures.labels(route).inc()
            log.warning("conformance_check_failed", request_id=asked.request_id, error_type=type(exc).__name__)
            return
        model = m.model_label(asked.model)
        for v in found:
            m.conformance_violations.labels(model, route, s, v.rule).inc()
        m.child(m.conformance_checks, model, route, s).inc()  # after its violations: a reader sees both
        if not found:
            return
        served.violations = found
        contents = st.config.server.log_contents
        log.warning("conformance_violations", request_id=asked.request_id, route=route, stream=asked.stream,
                    model=asked.model, violations=[v.as_dict(contents) for v in found])
        for sink in st.conformance_sinks:
            try:
                sink(asked, served, found)
            except Exception as exc:  # fail-open
                log.warning("conformance_sink_failed", error_type=type(exc).__name__, error=str(exc)[:200])

    @staticmethod
    def _stream_headers(upstream: UpstreamResponse, asked: Asked, served: Served) -> dict[str, str]:
        h = response_headers(upstream.headers)
        h.pop("content-type", None)
        h["X-Toolquake-Request-Id"] = asked.request_id
        return h

    def _finish(self, asked: Asked, served: Served, observe: bool = True) -> None:
        """Count, log, and hand the finished request to the observers."""
        st, m = self.st, self.st.metrics
        served.total_s = time.perf_counter() - asked.t0
        s = "true" if asked.stream else "false"
        route = asked.route
        m.child(m.requests, asked.profile_name, route, f"{served.status // 100}xx", s, m.model_label(asked.model)).inc()
        m.child(m.duration, asked.profile_name, route, s).observe(served.total_s)
        if served.upstream_s is not None:
            m.child(m.upstream_duration, route, s).observe(served.upstream_s)
            m.child(m.overhead, route, s).observe(max(served.total_s - served.upstream_s, 0.0))
        outcome = served.outcome
        event: dict[str, Any] = dict(request_id=asked.request_id, route=route, profile=asked.profile_name,
                                     stream=asked.stream, status=served.status,
                                     perturbers=[a.name for a in outcome.applied] if outcome else [],
                                     total_ms=round(served.total_s * 1000, 3))
        if outcome is not None and outcome.failed:
            event["perturbers_failed"] = outcome.failed
        if served.injected_calls:
            event["injected_calls"] = list(served.injected_calls)
        if served.upstream_s is not None:
            event["upstream_ms"] = round(served.upstream_s * 1000, 3)
        if st.config.server.log_contents and asked.request is not None:
            event["messages"] = asked.request.get("messages")
            event["answer"] = served.response
        logs.info(log, "request", event)
        if observe and asked.observed and asked.request is not None:
            for observer in st.observers:
                try:
                    observer(asked, served)
                except Exception as exc:  # fail-open: scoring never breaks serving
                    log.warning("observer_failed", error_type=type(exc).__name__, error=str(exc)[:200])


def json_copy(value: Any) -> Any:
    return _decode(_encode(value))


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
