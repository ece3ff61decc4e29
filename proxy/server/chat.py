"""The model routes (chat completions and the Responses API): decode, choose the profile, perturb,
forward, relay or restore, count.

One `RequestContext` carries a request from arrival to its last byte; the log line and the
observers (live scoring, replay) are fed from it after the client was answered. Both APIs go
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
from toolquake.proxy.server.state import ProxyState, RequestContext
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
        ctx = RequestContext(request_id=new_request_id(), t0=time.perf_counter(), api=self.api)
        st.metrics.in_flight.inc()
        streamed = False  # a streamed answer finishes (and leaves in_flight) in its background task
        try:
            raw = await read_body()
            try:
                req = self.api.decoder.decode(raw)
            except msgspec.ValidationError as exc:
                raise ProxyError(400, f"Invalid request body: {exc}", code="invalid_type") from None
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise invalid_json(exc) from None
            ctx.stream, ctx.model = bool(req.stream), req.model
            name = profile_name or header(headers, "x-toolquake-profile") or st.config.server.default_profile
            ctx.profile = st.profiles.get(name)
            if ctx.profile is None:
                raise unknown_profile(name, st.profiles.names())
            response = await self._serve(ctx, headers, raw)
            streamed = isinstance(response, Stream)
            return response
        except ProxyError as exc:
            ctx.status = exc.status
            self._finish(ctx, observe=False)
            return Plain(exc.body(), exc.status, {"X-Toolquake-Request-Id": ctx.request_id})
        finally:
            if not streamed:
                st.metrics.in_flight.dec()

    async def _serve(self, ctx: RequestContext, headers: list[tuple[str, str]], raw: bytes) -> Plain | Stream:
        st, profile, api = self.st, ctx.profile, self.api
        assert profile is not None
        ctx.observed = bool(st.observers)
        ctx.case_header = header(headers, "x-toolquake-case")
        send_raw = raw
        perturbing = profile.mode == "perturb" and bool(profile.steps)
        chat = None
        if perturbing or ctx.observed:
            try:
                body = _decode(raw)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise invalid_json(exc) from None  # e.g. bad UTF-8 in a key the typed decode skipped
            if not isinstance(body, dict):
                raise ProxyError(400, "Request body must be a JSON object.", code="invalid_type")
            ctx.wire_request = body
            ctx.request, ctx.conversion = api.to_internal(body)
            chat = ChatRequest(ctx.request)
            if st.case_resolver is not None:
                try:
                    ctx.case = st.case_resolver(ctx.case_header, chat)
                except Exception as exc:  # fail-open: an unknown case never breaks the request
                    log.warning("case_resolution_failed", error_type=type(exc).__name__)
        if perturbing or ctx.observed:  # nobody else reads the seed
            ctx.seed = seed_for(header(headers, "x-toolquake-seed"), raw,
                                conversation=header(headers, "x-toolquake-conversation"), request=chat)
        if perturbing and chat is not None:
            try:
                ctx.outcome = await run_profile(profile, chat, ctx.seed, st.services, ctx.case)
            except PerturbationFailed as exc:
                st.metrics.perturbation_failures.labels(exc.perturber).inc()
                raise ProxyError(500, str(exc), type="server_error", code="perturbation_failed") from None
            st.metrics.count_outcome(ctx.outcome, getattr(st.services.token_counter, "source", "none"))
            if ctx.outcome.changed:
                send_raw = _encode(api.to_wire(ctx.outcome.request.body, ctx.wire_request or {}, ctx.conversion))
        ctx.forward_headers = request_headers(headers)
        ctx.sent_raw = send_raw
        ctx.t_upstream = time.perf_counter()
        upstream = await send_upstream(st, "POST", st.upstream.api_url(api.path), ctx.forward_headers, send_raw)
        if ctx.stream and 200 <= upstream.status_code < 300 and "text/event-stream" in upstream.header("content-type"):
            if self._streams_text(ctx):
                if self.api is CHAT:
                    return self._stream_text_through(upstream, ctx)
                return self._stream_text_through_responses(upstream, ctx)
            if self._rewrites(ctx):
                return await self._stream_rewritten(upstream, ctx)
            return self._stream_relay(upstream, ctx)
        return await self._plain(upstream, ctx)

    @staticmethod
    def _rewrites(ctx: RequestContext) -> bool:
        """The answer must be read whole before the client gets it: a step rewrites it, or calls to tools
        the proxy added are answered by the proxy."""
        if ctx.profile is not None and ctx.profile.spec.repair:
            return True
        outcome = ctx.outcome
        if outcome is None:
            return False
        answers_injected = bool(outcome.injected) and ctx.profile is not None \
            and ctx.profile.spec.injected_calls == "answer"
        return outcome.rewrites_response or answers_injected

    def _streams_text(self, ctx: RequestContext) -> bool:
        """A chat stream whose only rewriting step declares `streams_text`, and no added-tool calls to answer:
        its plain text can reach the client as it arrives."""
        outcome = ctx.outcome
        if outcome is None or len(outcome.restorers) != 1:
            return False
        if outcome.injected and ctx.profile is not None and ctx.profile.spec.injected_calls == "answer":
            return False
        return outcome.restorers[0][0].streams_text

    def _stream_text_through(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
        """Relay the answer's plain text as it arrives, up to what the step releases (text that cannot become
        a call any more); at the end restore the whole answer and send the rest: the remaining text, or the
        calls the text turned into."""
        assert ctx.outcome is not None
        perturber, pctx = ctx.outcome.restorers[0]
        m = self.st.metrics
        ctx.status = 200
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
                            m.ttfb.labels(ctx.profile_name, "true").observe(state["first"] - ctx.t0)
                        yield out
                for payload in parser.flush():
                    asm.add_payload(payload)
                whole = state["whole"] = b"".join(raw)
                if not any(x in whole for x in self.api.end_markers):
                    ctx.status = 502
                    yield self._stream_error("invalid_response", "The upstream model server sent "
                                             + ("an empty stream." if not whole.strip() else
                                                "a stream that ended unfinished."), "upstream_invalid_response")
                    return
                answer = asm.result()
                text = ((answer.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
                restored, failed = restore(ctx.outcome, answer)
                m.count_restore_failures(failed)
                ctx.response = restored
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
                    m.ttfb.labels(ctx.profile_name, "true").observe(state["first"] - ctx.t0)
                for f in frames:
                    yield f
            except UpstreamError as exc:
                ctx.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            ctx.upstream_s = (state["end"] or time.perf_counter()) - (ctx.t_upstream or ctx.t0)
            self._finish(ctx)
            m.in_flight.dec()
            if ctx.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(ctx, state.get("whole"))

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    def _stream_text_through_responses(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
        """`_stream_text_through` for the Responses API: the message item opens with the first released text;
        the rest (remaining text, then the calls) follows once the answer is complete and restored."""
        assert ctx.outcome is not None
        perturber, pctx = ctx.outcome.restorers[0]
        m, api = self.st.metrics, self.api
        ctx.status = 200
        state: dict[str, Any] = {"first": None, "end": None}

        def first_byte() -> None:
            if state["first"] is None:
                state["first"] = time.perf_counter()
                m.ttfb.labels(ctx.profile_name, "true").observe(state["first"] - ctx.t0)

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
                    ctx.status = 502
                    yield self._stream_error("invalid_response", "The upstream model server sent "
                                             + ("an empty stream." if native is None else
                                                "a stream that ended unfinished."), "upstream_invalid_response")
                    return
                restored, failed = restore(ctx.outcome, api.answer_to_internal(native))
                m.count_restore_failures(failed)
                ctx.response = restored
                for frame in through.finish(api.answer_to_wire(restored, native)):
                    first_byte()
                    yield frame
            except UpstreamError as exc:
                ctx.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            ctx.upstream_s = (state["end"] or time.perf_counter()) - (ctx.t_upstream or ctx.t0)
            self._finish(ctx)
            m.in_flight.dec()
            if ctx.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(ctx, state.get("whole"))

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _finish_answer(self, ctx: RequestContext, wire: dict[str, Any]) -> dict[str, Any]:
        """Restore what the steps rewrote, handle calls to added tools; the answer to send, in wire form."""
        st, api = self.st, self.api
        internal = api.answer_to_internal(wire)
        changed = False
        if ctx.profile is not None and ctx.profile.spec.repair:
            internal, ctx.repaired = conformance.repair_answer(internal, self._offered(ctx))
            if ctx.repaired is not None:
                st.metrics.conformance_repairs.labels(st.metrics.model_label(ctx.model), api.route,
                                                      "true" if ctx.stream else "false", ctx.repaired).inc()
                changed = True
        if ctx.outcome is not None and ctx.outcome.rewrites_response:
            internal, failed = restore(ctx.outcome, internal)
            st.metrics.count_restore_failures(failed)
            changed = True
        if ctx.outcome is not None and ctx.outcome.injected:
            internal, handled = await self._injected(ctx, internal)
            changed = changed or handled
        ctx.response = internal
        if not changed:
            return wire
        return api.answer_to_wire(internal, wire)

    async def _injected(self, ctx: RequestContext, answer: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Count calls to tools the proxy added; under `answer`, keep them from the client: strip them when
        the model also called the client's own tools, else tell the model they are unavailable and ask
        again (at most MAX_INJECTED_ROUNDS times; then the calls are stripped)."""
        assert ctx.outcome is not None and ctx.profile is not None
        injected = ctx.outcome.injected
        answer_them = ctx.profile.spec.injected_calls == "answer"
        request = ctx.outcome.request.body
        for _ in range(MAX_INJECTED_ROUNDS + 1):
            calls = _calls(answer)
            bad = [c for c in calls if _call_name(c) in injected]
            if not bad:
                return answer, False if answer is None else ctx.injected_calls != []
            for call in bad:
                ctx.injected_calls.append(_call_name(call))
                self.st.metrics.injected_calls.labels(ctx.profile_name, injected[_call_name(call)]).inc()
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
            previous, answer = answer, await self._ask_again(ctx, request)
            if answer is None:  # the follow-up failed: the client gets the answer without the added calls
                return _strip(previous, {id(c) for c in bad}), True
        return answer, True

    async def _ask_again(self, ctx: RequestContext, request: dict[str, Any]) -> dict[str, Any] | None:
        api = self.api
        wire = api.to_wire(request, {**(ctx.wire_request or {}), "stream": False}, ctx.conversion)
        try:
            resp = await self.st.upstream.send("POST", self.st.upstream.api_url(api.path), ctx.forward_headers,
                                               _encode(wire))
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            answer = _decode(data) if resp.status_code == 200 else None
        except (UpstreamError, msgspec.DecodeError, RecursionError) as exc:
            log.warning("injected_followup_failed", request_id=ctx.request_id, error_type=type(exc).__name__)
            return None
        return api.answer_to_internal(answer) if isinstance(answer, dict) else None

    async def _plain(self, upstream: UpstreamResponse, ctx: RequestContext) -> Plain:
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
        ctx.upstream_s = time.perf_counter() - (ctx.t_upstream or ctx.t0)
        ctx.status = upstream.status_code
        resp_headers = response_headers(upstream.headers)
        relayed = data
        if 200 <= ctx.status < 300:
            # a 2xx answer to a model request is a JSON object; anything else is the backend's bug, said as one.
            # When nobody reads the answer it is only checked (its values validated, not built)
            reads = ctx.observed or self._rewrites(ctx) or (ctx.outcome is not None and ctx.outcome.injected)
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
                sent = await self._finish_answer(ctx, parsed)
                if sent is not parsed:
                    data = _encode(sent)
        total = time.perf_counter() - ctx.t0
        resp_headers["X-Toolquake-Overhead-Ms"] = f"{(total - ctx.upstream_s) * 1000:.3f}"
        resp_headers["X-Toolquake-Request-Id"] = ctx.request_id
        st.metrics.child(st.metrics.ttfb, ctx.profile_name, "false").observe(total)
        self._finish(ctx)
        check = partial(self._check, ctx, relayed) if 200 <= ctx.status < 300 else None
        return Plain(data, ctx.status, resp_headers, upstream.header("content-type", JSON), check)

    def _stream_error(self, kind: str, message: str, code: str) -> bytes:
        self.st.metrics.upstream_errors.labels(kind).inc()
        return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"

    def _stream_relay(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
        """Relay the upstream SSE chunk by chunk; capture a copy only when someone will score it. A stream
        that ends without its end marker (chat `[DONE]`, a final Responses event) gets an error event."""
        parts: list[bytes] = []
        state: dict[str, Any] = {"first": None, "end": None, "ended": False, "tail": b""}
        ctx.status = 200
        m = self.st.metrics
        markers = self.api.end_markers
        keep = max(len(x) for x in markers) if markers else 0
        # a copy of the stream is kept for observers, and to count calls to tools the proxy added
        capture = ctx.observed or bool(ctx.outcome is not None and ctx.outcome.injected) \
            or self.st.config.server.conformance

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    if state["first"] is None:
                        state["first"] = time.perf_counter()
                        m.child(m.ttfb, ctx.profile_name, "true").observe(state["first"] - ctx.t0)
                    if capture:
                        parts.append(chunk)
                    if not state["ended"]:
                        seen = state["tail"] + chunk
                        state["ended"] = any(x in seen for x in markers)
                        state["tail"] = seen[-keep:]
                    yield chunk
                if not state["ended"]:
                    ctx.status = 502
                    what = "an empty stream" if state["first"] is None else "a stream that ended unfinished"
                    yield self._stream_error("invalid_response", f"The upstream model server sent {what}.",
                                             "upstream_invalid_response")
            except UpstreamError as exc:
                # headers are sent: tell the client in-band, the way OpenAI streams report errors
                ctx.status = 504 if exc.kind == "timeout" else 502
                yield self._stream_error(exc.kind, f"The upstream stream failed ({exc.cause_name}).",
                                         f"upstream_{exc.kind}")
            finally:
                state["end"] = time.perf_counter()
                await upstream.aclose()

        gen = relay()

        async def cleanup() -> None:
            await gen.aclose()
            await upstream.aclose()
            ctx.upstream_s = (state["end"] or time.perf_counter()) - (ctx.t_upstream or ctx.t0)
            whole = b"".join(parts) if capture and parts else b""
            if whole and (ctx.observed or (ctx.outcome is not None and bool(ctx.outcome.injected))):
                native = self.api.assemble(whole)
                ctx.response = self.api.answer_to_internal(native) if native else None
                if ctx.response is not None and ctx.outcome is not None and ctx.outcome.injected:
                    ctx.response, _ = await self._injected(ctx, ctx.response)  # counted; "pass" changes nothing
            self._finish(ctx)
            m.in_flight.dec()
            if whole and ctx.status == 200:  # after the request is counted: the check is no part of its duration
                await self._check(ctx, whole)

        return Stream(gen, status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    async def _stream_rewritten(self, upstream: UpstreamResponse, ctx: RequestContext) -> Stream:
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
        ctx.upstream_s = time.perf_counter() - (ctx.t_upstream or ctx.t0)
        ctx.status = 200
        wire = await self._finish_answer(ctx, native)
        frames = [data] if wire is native else list(self.api.emit(wire))  # unchanged: the bytes as they came
        first: dict[str, float | None] = {"t": None}

        async def emit() -> AsyncIterator[bytes]:
            for frame in frames:
                if first["t"] is None:
                    first["t"] = time.perf_counter()
                    m.ttfb.labels(ctx.profile_name, "true").observe(first["t"] - ctx.t0)
                yield frame

        async def cleanup() -> None:
            self._finish(ctx)
            m.in_flight.dec()
            await self._check(ctx, data)

        return Stream(emit(), status_code=200, headers=self._stream_headers(upstream, ctx),
                      media_type="text/event-stream", background=BackgroundTask(cleanup))

    def _offered(self, ctx: RequestContext) -> conformance.Offered:
        """The tools the backend was offered (the request as sent upstream)."""
        if ctx.outcome is not None and ctx.outcome.request.body is not None:
            return conformance.Offered.from_request(ctx.outcome.request.body)
        return conformance.Offered.from_raw(ctx.sent_raw) if ctx.sent_raw else conformance.Offered({})

    async def _check(self, ctx: RequestContext, relayed: bytes | None) -> None:
        """Check the answer the backend sent (`relayed`: its bytes, after the client got them) against the
        conformance rules; count, log and hand on what it broke. Fail-open: a checker that raises is counted."""
        st, m = self.st, self.st.metrics
        if not st.config.server.conformance or not relayed:
            return
        route, s = self.api.route, "true" if ctx.stream else "false"
        try:
            offered = self._offered(ctx)
            if not ctx.stream and conformance.nothing_to_check(route, relayed, offered):
                found = []
            else:
                answer: bytes | Any = relayed if ctx.stream else _decode(relayed)
                found = conformance.check(route, ctx.stream, answer, offered)
        except Exception as exc:  # fail-open: the client has its answer; the check counts its own failure
            m.conformance_failures.labels(route).inc()
            log.warning("conformance_check_failed", request_id=ctx.request_id, error_type=type(exc).__name__)
            return
        model = m.model_label(ctx.model)
        for v in found:
            m.conformance_violations.labels(model, route, s, v.rule).inc()
        m.child(m.conformance_checks, model, route, s).inc()  # after its violations: a reader sees both
        if not found:
            return
        ctx.violations = found
        contents = st.config.server.log_contents
        log.warning("conformance_violations", request_id=ctx.request_id, route=route, stream=ctx.stream,
                    model=ctx.model, violations=[v.as_dict(contents) for v in found])
        for sink in st.conformance_sinks:
            try:
                sink(ctx, found)
            except Exception as exc:  # fail-open
                log.warning("conformance_sink_failed", error_type=type(exc).__name__, error=str(exc)[:200])

    @staticmethod
    def _stream_headers(upstream: UpstreamResponse, ctx: RequestContext) -> dict[str, str]:
        h = response_headers(upstream.headers)
        h.pop("content-type", None)
        h["X-Toolquake-Request-Id"] = ctx.request_id
        return h

    def _finish(self, ctx: RequestContext, observe: bool = True) -> None:
        """Count, log, and hand the finished request to the observers."""
        st, m = self.st, self.st.metrics
        ctx.total_s = time.perf_counter() - ctx.t0
        s = "true" if ctx.stream else "false"
        route = ctx.route
        m.child(m.requests, ctx.profile_name, route, f"{ctx.status // 100}xx", s, m.model_label(ctx.model)).inc()
        m.child(m.duration, ctx.profile_name, route, s).observe(ctx.total_s)
        if ctx.upstream_s is not None:
            m.child(m.upstream_duration, route, s).observe(ctx.upstream_s)
            m.child(m.overhead, route, s).observe(max(ctx.total_s - ctx.upstream_s, 0.0))
        outcome = ctx.outcome
        event: dict[str, Any] = dict(request_id=ctx.request_id, route=route, profile=ctx.profile_name,
                                     stream=ctx.stream, status=ctx.status,
                                     perturbers=[a.name for a in outcome.applied] if outcome else [],
                                     total_ms=round(ctx.total_s * 1000, 3))
        if outcome is not None and outcome.failed:
            event["perturbers_failed"] = outcome.failed
        if ctx.injected_calls:
            event["injected_calls"] = ctx.injected_calls
        if ctx.upstream_s is not None:
            event["upstream_ms"] = round(ctx.upstream_s * 1000, 3)
        if st.config.server.log_contents and ctx.request is not None:
            event["messages"] = ctx.request.get("messages")
            event["answer"] = ctx.response
        logs.info(log, "request", event)
        if observe and ctx.observed and ctx.request is not None:
            for observer in st.observers:
                try:
                    observer(ctx)
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
