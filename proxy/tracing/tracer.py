"""OpenTelemetry traces (`[tracing]`, docs/tracing.md): one span per proxied model request, following the GenAI
semantic conventions (`gen_ai.*`) plus toolquake's own attributes (`toolquake.*`), with child spans for the
upstream call, the proxy's follow-ups, shadow twins and scoring.

Imported only when tracing is on (the wing's `attach`, proxy/tracing/__init__.py); the server calls it through
`hooks.TraceHooks` alone. The spans are toolquake's own records (proxy/tracing/spans.py: the W3C trace
context, the SDK's samplers and one exporter thread posting OTLP/HTTP protobuf in batches); nothing on the
request path waits on the collector, and an export that fails is counted
(`toolquake_tracing_failures_total{stage="export"}`), never raised. The client's `traceparent`/`tracestate`
are honoured (the request span joins the agent's trace) and each call the proxy makes upstream carries its own
span's context. A request the sampler leaves out makes no span and builds no attribute; its context still goes
upstream (sampled flag 0). A request's span ends at the request's last byte but is exported once what is
judged after it (conformance, live verdict, shadow consistency) has been added to it: each of those holds the
span (`hold`/`release`); a trace dropped unreleased ends its span when collected.
"""

from __future__ import annotations

import asyncio
import random
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple
from urllib.parse import urlsplit

import msgspec
import structlog
from prometheus_client import Counter

from toolquake import __version__
from toolquake.proxy.server.config import TRACE_CONTENT_CHARS, ConfigError, TracingConfig
from toolquake.proxy.server.hooks import TraceHooks, Tracer
from toolquake.proxy.server.state import Asked
from toolquake.proxy.tracing import otlp
from toolquake.proxy.tracing.spans import (
    CLIENT,
    ERROR,
    INTERNAL,
    SERVER,
    Context,
    Exporter,
    Sampler,
    Span,
    new_id,
    parse_pairs,
    scan,
    traceparent,
)

if TYPE_CHECKING:
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.state import Served

log = structlog.get_logger("toolquake.tracing")
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
#: string values of a perturber's report exported as they are (others only when numbers or booleans)
REPORT_STRINGS = frozenset({"kind", "target", "source", "token_counter", "config", "parse", "fact_kind",
                            "not_perturbed", "skipped"})
_encode = msgspec.json.encode
_time_ns = time.time_ns
_perf_counter = time.perf_counter
_getrandbits = random.getrandbits  # reseeded in a forked worker by the random module itself
_MASK64 = (1 << 64) - 1
_SPAN_ATTRIBUTES = b"\x4a"  # Span.attributes' tag (otlp.attributes)
_LOCAL_UNSET, _REMOTE_UNSET = otlp.tail(0, "", False), otlp.tail(0, "", True)
_SHAPES, _SHAPE_BYTES = 4096, 2048  # `Tracing.shapes`: at most 8 MiB of attributes
_LAYOUTS = 512  # `Tracing.layouts`: about 2 KiB each, and its shape (at most 2 KiB + a name of 2 KiB): 3 MiB
_UPSTREAM_MS, _OVERHEAD_MS = (otlp.float_attribute(k, 0.0)[:-8] for k in ("toolquake.upstream_ms",
                                                                          "toolquake.overhead_ms"))
_pack_double = struct.Struct("<d").pack
_uvarint = otlp.uvarint
_ZERO8, _ONE8, _ONE16 = bytes(8), (1).to_bytes(8, "big"), (1).to_bytes(16, "big")  # no id is 0 (`RequestTrace`)
_MAKING = threading.Lock()  # a request's `Span` is made once (`RequestTrace.span`)


def sampler(name: str, arg: str) -> Sampler:
    """OTEL_TRACES_SAMPLER / _ARG as the SDK reads them (parent-based always-on by default)."""
    return Sampler(name, arg)


def endpoint(otel: dict[str, str]) -> str:
    """The OTLP/HTTP traces URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else the base endpoint + /v1/traces)."""
    protocol = otel.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or otel.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
        or "http/protobuf"
    if protocol.strip().lower() != "http/protobuf":
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: toolquake exports OTLP over HTTP "
                          "(http/protobuf) only; point it at the collector's HTTP port (4318)")
    if otel.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return otel["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = otel.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def forward(trace_id: int, span_id: int, sampled: bool, tracestate: str | None,
            headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` with the client's trace headers replaced by a span's context (for the backend)."""
    out = [h for h in headers if h[0].lower() not in TRACE_HEADERS]
    out.append(("traceparent", traceparent(trace_id, span_id, sampled)))
    if tracestate:
        out.append(("tracestate", tracestate))
    return out


class Tracing(Tracer):
    """One server's tracer (one per worker process: `start` runs at the app's start-up, after any fork), the
    server's `hooks.Tracer`. `redact`: set by `live.attach` (`use_redactor`) when `contents` is on (prompts and
    answers are exported redacted, or not at all)."""

    def __init__(self, config: TracingConfig, metrics: Metrics, upstream: str) -> None:
        self.config = config
        otel = config.otel
        self.endpoint = endpoint(otel)
        self.sampler = sampler(otel.get("OTEL_TRACES_SAMPLER", ""), otel.get("OTEL_TRACES_SAMPLER_ARG", ""))
        failures = Counter("toolquake_tracing_failures", "Tracing that failed, fail-open: spans the exporter could "
                           "not send or dropped on a full queue (stage=export), requests whose tracing raised and "
                           "were served without it (stage=span), spans that went without their contents because "
                           "too much waited to be redacted (stage=contents).", ["stage"], registry=metrics.registry)
        self.export_failures, self.span_failures = failures.labels("export"), failures.labels("span")
        self.contents_skipped = failures.labels("contents")
        #: characters of contents waiting to be redacted (`RequestTrace.contents`; on the event loop only)
        self.contents_waiting = 0
        url = urlsplit(upstream)  # never its user:password, path or query
        self.server = {"server.address": url.hostname or "", "server.port": url.port or
                       (443 if url.scheme == "https" else 80)}
        self.redact: Callable[[Any], Any] | None = None
        resource: dict[str, Any] = dict(parse_pairs(otel.get("OTEL_RESOURCE_ATTRIBUTES", "")))
        resource["service.name"] = otel.get("OTEL_SERVICE_NAME") or resource.get("service.name") or "toolquake"
        resource.setdefault("service.version", __version__)
        resource.update({"telemetry.sdk.language": "python", "telemetry.sdk.name": "toolquake",
                         "telemetry.sdk.version": __version__})
        self.service = resource["service.name"]
        self.exporter = Exporter(self.endpoint, otel, resource, __version__, self.export_failures,
                                 config.max_queue_bytes)
        self.started = False
        #: a request span's attributes shared by a route and profile, an upstream call's by a route: encoded once
        self.fixed_cache: dict[tuple[Any, str, str], bytes] = {}
        self.upstream_cache: dict[Any, tuple[bytes, bytes]] = {}
        #: the upstream call's span name and all its attributes, by route and status (`plain_span`)
        self.up_shared: dict[tuple[Any, int], tuple[bytes, bytes]] = {}
        #: what `plain_span` writes of a request span that other requests share (its name field, and its attributes
        #: but its own values), by what it depends on: bounded in entries and each in bytes
        self.shapes: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        #: how a shape's unperturbed spans are laid out, by the shape, the ids' lengths and the parent (`_laid_out`)
        self.layouts: dict[tuple[Any, ...], otlp.UnperturbedLayout] = {}
        #: epoch ns minus perf_counter() ns, and when that was read (`epoch`)
        self.clock_at, self.clock_offset = float("-inf"), 0

    @property
    def contents(self) -> bool:  # type: ignore[override]
        """Spans carry prompts and answers (`[tracing] contents`)."""
        return self.config.contents

    def use_redactor(self, redact: Callable[[Any], Any]) -> None:
        self.redact = redact

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """The exporter's sender (in each worker, after any fork): a task of the server's event loop `loop`, else
        a thread of its own (replay, sweep)."""
        self.exporter.start(loop)
        self.started = True
        log.info("tracing", endpoint=self.endpoint, service=self.service, contents=self.config.contents,
                 sampler=self.sampler.name)

    def shutdown(self) -> None:
        """Export what is left (bounded by the exporter's timeout), then stop its thread."""
        if self.started:
            self.started = False
            self.exporter.shutdown()

    async def ashutdown(self) -> None:
        """`shutdown` of a sender started on the event loop."""
        if self.started:
            self.started = False
            await self.exporter.ashutdown()

    def root(self, name: str, kind: int, parent: Context | None, attributes: dict[str, Any] | None = None,
             start: int | None = None) -> tuple[int, Span | None]:
        """A trace's first span in this process (a child of `parent`, the client's, when there is one): its trace
        id, and the span, or None when the sampler leaves it out."""
        trace_id = parent.trace_id if parent is not None else new_id(128)
        if not self.sampler(trace_id, parent):
            return trace_id, None
        span = Span(self.exporter, trace_id, parent.span_id if parent is not None else 0, parent is not None,
                    name, kind, start or _time_ns(), attributes, parent.tracestate if parent is not None else None)
        return trace_id, span

    def begin(self, headers: list[tuple[str, str]], t0: float) -> RequestTrace | None:
        """The span of a model request that just arrived (a child of the client's span when it sent one). One
        random draw gives the trace id (when the client sent none), the span's id and its upstream call's. The
        span itself is the trace's own fields (a `Span` is made only when something is noted on it)."""
        if not self.started:
            return None
        try:
            parent, sent = scan(headers)
            ids = _getrandbits(256)
            if parent is None:  # the sampler's rule for a root, inline (`Sampler.__call__`)
                trace_id = ids >> 128 or 1
                sampled = (trace_id & _MASK64) < self.sampler.bound
            else:
                trace_id = parent.trace_id
                sampled = self.sampler(trace_id, parent)
            if t0 - self.clock_at > 1.0:
                self.epoch(t0)
            return RequestTrace(self, sampled, trace_id, parent, self.clock_offset + int(t0 * 1e9), t0, ids,
                                not sent)
        except Exception as exc:
            self.failed(exc)
            return None

    def epoch(self, t: float) -> int:
        """A perf_counter() time as epoch nanoseconds: the offset between the two clocks read once a second."""
        if t - self.clock_at > 1.0:
            self.clock_at = _perf_counter()
            self.clock_offset = _time_ns() - int(self.clock_at * 1e9)
        return self.clock_offset + int(t * 1e9)

    def fixed(self, asked: Asked) -> bytes:
        """The request span's attributes that are the same for every request of a route and profile, encoded
        once (a bounded cache)."""
        api, profile = asked.api, asked.profile
        key = (api, profile.name, profile.mode) if profile is not None else (api, "-", "off")
        fixed = self.fixed_cache.get(key)
        if fixed is None:
            if len(self.fixed_cache) >= 256:
                self.fixed_cache.clear()
            fixed = self.fixed_cache[key] = otlp.attributes(_SPAN_ATTRIBUTES, {
                **self.server, "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "toolquake.route": asked.route, "toolquake.profile": key[1], "toolquake.mode": key[2]})
        return fixed

    def upstream_fixed(self, api: Any) -> tuple[bytes, bytes]:
        """The upstream call's span name (its field) and its attributes but the status, encoded once per route."""
        named = self.upstream_cache.get(api)
        if named is None:
            path = f"/v1/{api.path}" if api is not None else "/v1"
            named = self.upstream_cache[api] = (otlp.name_field(f"POST {path}"), otlp.attributes(
                _SPAN_ATTRIBUTES, {"http.request.method": "POST", "url.path": path, **self.server}))
        return named

    def upstream_span(self, trace: RequestTrace, status: int, start: int, end: int) -> None:
        """The upstream call's span (a client span under the request's), written straight to the wire format."""
        exporter = self.exporter
        if not trace.sampled or not exporter.room():
            return
        name, fixed = self.upstream_fixed(trace.asked.api if trace.asked is not None else None)
        exporter.put_encoded(otlp.framed_parts(
            otlp.head(trace.trace_id, trace.up_id, trace.span_id, trace.tracestate, name, CLIENT, start, end), fixed,
            otlp.int_attribute("http.response.status_code", status), _LOCAL_UNSET))

    def plain_span(self, trace: RequestTrace) -> bool:
        """The span of a plain request (`is_plain`: its attributes are the request's own values only) written
        straight to the wire format: what it shares with other requests (its route and profile's attributes, then
        its model, stream flag, status, the answer's summary but its id and token counts, the conformance check)
        from bounded caches, then its own values (ids, times, the response's id, the token counts, the durations).
        A request that went upstream with no trace state: both spans from the layout of its shape, the lengths of
        its values and its parent (`otlp.UnperturbedLayout`, `layout_for`), found by one lookup; any other, or one
        whose shape is too large to lay out, by `write_encoded`. False (nothing written) where the request is not
        plain: only its attributes gathered in a dict can say it (`RequestTrace.fill`)."""
        asked = trace.asked
        if asked is None or not is_plain(trace, asked):
            return False
        if trace.up_start is not None and trace.upstream_s is not None and trace.tracestate is None:
            values = own_values(asked.request_id, trace.summary)
            layout = self.layout_for(trace, asked, values)
            if layout is not None:
                self.write_laid_out(trace, layout, values)
                return True
        self.write_encoded(trace, asked)
        return True

    def layout_for(self, trace: RequestTrace, asked: Asked, values: OwnValues) -> otlp.UnperturbedLayout | None:
        """The layout of a plain request's spans, by everything it depends on: what the shape's bytes say (route,
        profile, model, stream, status, the conformance check, the answer's summary but its id and counts), the
        lengths of its own `values` and its parent. None: the shape is too large to keep."""
        summary, rules, profile = trace.summary, trace.rules, asked.profile
        model, reasons, names = (None, None, None) if summary is None else \
            (summary.model, summary.finish_reasons, summary.tool_calls)  # no summary at all: its key's parts None
        rid, resp, resp_n, tokens_in, tokens_out = values
        key = (asked.api, profile.name if profile is not None else "-",
               profile.spec.mode if profile is not None else "off", asked.model, asked.stream, trace.status,
               None if rules is None else tuple(rules), model, reasons, names, len(rid), resp_n, len(tokens_in),
               len(tokens_out),
               2 if trace.pid else 0)  # a request's parent is remote (the client's) where there is one
        layout = self.layouts.get(key)
        if layout is None:
            layout = self._layout(trace, key, (len(rid), resp_n, len(tokens_in), len(tokens_out)))
        return layout

    def write_laid_out(self, trace: RequestTrace, layout: otlp.UnperturbedLayout, values: OwnValues) -> None:
        """A plain request's two spans from its `layout`: its ids, times, own `values` and durations packed in."""
        rid, resp, _, tokens_in, tokens_out = values
        start, upstream_s, up_start = trace.start, trace.upstream_s, trace.up_start
        assert upstream_s is not None and up_start is not None  # `plain_span` lays out only what went upstream
        server, client = layout.spans(
            trace.tid, trace.sid, trace.pid, start, trace.end_ns or 0, rid, resp, tokens_in, tokens_out,
            _ms(upstream_s), _ms(over) if (over := trace.total_s - upstream_s) > 0.0 else 0.0, trace.uid,
            start + int((up_start - trace.t0) * 1e9), trace.up_end_ns)
        self.exporter.put_pair(client, server)  # the upstream call's span first, as the general path does

    def write_encoded(self, trace: RequestTrace, asked: Asked) -> None:
        """A plain request's span from the shape it shares with other requests (`shape`) and its own attributes
        (`own_attributes`); with its upstream call's span when it went upstream, else alone (refused before)."""
        shared = self.shape(trace)
        own = own_attributes(trace, asked.request_id)
        exporter = self.exporter
        if trace.up_start is None:  # refused before it went upstream: the request's span alone
            if exporter.room():
                exporter.put_encoded(otlp.framed_parts(
                    otlp.head(trace.trace_id, trace.span_id, trace.parent_id, trace.tracestate, shared[0], SERVER,
                              trace.start, trace.end_ns or 0), shared[1], own,
                    _REMOTE_UNSET if trace.parent_id and trace.remote else _LOCAL_UNSET))
            return
        up = self.up_spanned(asked.api, trace.status)
        server, client = otlp.unperturbed(trace.trace_id, trace.span_id, trace.parent_id, trace.remote,
                                          trace.tracestate, shared[0], trace.start, trace.end_ns or 0, shared[1], own,
                                          trace.up_id, up[0], up[1], trace.at(trace.up_start), trace.up_end_ns)
        exporter.put_pair(client, server)  # the upstream call's span first, as the general path writes it

    def shape(self, trace: RequestTrace) -> tuple[bytes, bytes]:
        """What a plain request's span shares with other requests: its name field, and its attributes but its
        own values (from a cache bounded in entries and each in bytes)."""
        asked, served, summary, rules = trace.asked, trace, trace.summary, trace.rules
        assert asked is not None
        fixed = self.fixed(asked)  # the same bytes object for every request of a route and profile
        key = (fixed, asked.model, asked.stream, served.status,
               None if summary is None else (summary.model, summary.finish_reasons, summary.tool_calls),
               None if rules is None else tuple(rules))
        shared = self.shapes.get(key)
        if shared is None:
            attrs: dict[str, Any] = {}
            request_into(attrs, asked, served)
            del attrs["toolquake.request_id"]
            if summary is not None:
                summary_into(attrs, summary, own=False)
            attrs["http.response.status_code"] = served.status
            if rules is not None:
                attrs["toolquake.conformance.checked"] = True
                attrs["toolquake.conformance.rules"] = rules
            name = otlp.name_field("chat " + asked.model if asked.model else "chat")
            shared = (name, fixed + otlp.attributes(_SPAN_ATTRIBUTES, attrs))
            if len(shared[1]) <= _SHAPE_BYTES:  # bounded in bytes: a hostile model or answer is not kept
                if len(self.shapes) >= _SHAPES:
                    self.shapes.clear()
                self.shapes[key] = shared
        return shared

    def up_spanned(self, api: Any, status: int) -> tuple[bytes, bytes]:
        """The upstream call's span name and all its attributes, by route and status (a bounded cache)."""
        up = self.up_shared.get((api, status))
        if up is None:
            name, fixed = self.upstream_fixed(api)
            up = (name, fixed + otlp.int_attribute("http.response.status_code", status))
            if len(self.up_shared) >= 256:
                self.up_shared.clear()
            self.up_shared[(api, status)] = up
        return up

    def _layout(self, trace: RequestTrace, key: tuple[Any, ...],
                lengths: tuple[int, int, int, int]) -> otlp.UnperturbedLayout | None:
        """The layout of `plain_span`'s `key` (its shape, its values' `lengths`: request id, response id (-1: none)
        and the token counts' varints (0: none); its parent), kept in a cache bounded in entries;
        None where the shape is too large to keep (a hostile model or answer: written by the general encoder)."""
        shared = self.shape(trace)
        if len(shared[1]) > _SHAPE_BYTES or len(shared[0]) > _SHAPE_BYTES:  # the key is no larger than its shape
            return None
        up = self.up_spanned(trace.asked.api if trace.asked is not None else None, trace.status)
        rid_n, resp_n, in_n, out_n = lengths
        parent = key[-1]
        prefixes = (otlp.string_prefix("toolquake.request_id", rid_n),
                    b"" if resp_n < 0 else otlp.string_prefix("gen_ai.response.id", resp_n),
                    b"" if not in_n else otlp.int_prefix("gen_ai.usage.input_tokens", in_n),
                    b"" if not out_n else otlp.int_prefix("gen_ai.usage.output_tokens", out_n), _UPSTREAM_MS,
                    _OVERHEAD_MS)
        layout = otlp.UnperturbedLayout(shared[0], shared[1], prefixes, (rid_n, max(resp_n, 0), in_n, out_n),
                                        parent != 0, parent == 2, up[0], up[1])
        if len(self.layouts) >= _LAYOUTS:
            self.layouts.clear()
        self.layouts[key] = layout
        return layout

    def failed(self, exc: BaseException) -> None:
        self.span_failures.inc()
        log.warning("tracing_failed", error_type=type(exc).__name__, error=str(exc)[:200])


class RequestTrace(TraceHooks):
    """The span of one model request and what it takes to end it (`span` None: the sampler left the request out;
    its calls upstream still carry a context, sampled flag 0). The upstream call's span is written when the
    request finishes, from the times recorded (`up_start`); until then it is only its id, which the backend gets.
    The request span's attributes are worked out when it ends, from the request (`asked`), what was served (the
    few fields of `Served` a span reads, copied as the request finishes: the trace never holds the `Served`, which
    holds the trace, nor its bodies) and its answer:
    an unperturbed request's (nothing but its own values: plain) are written straight to the wire format, the
    part they share with other requests from a cache (`Tracing.plain_span`); any other's are gathered in the span's
    dict (`fill`) and encoded from it. Every method fails open."""

    __slots__ = ("tracing", "sampled", "tid", "sid", "pid", "tracestate", "start", "t0", "end_ns", "holds", "ended",
                 "uid", "up_start", "clean", "asked", "summary", "rules", "up_end_ns", "made", "status",
                 "perturbation", "injected_calls", "repaired", "upstream_s", "total_s")

    def __init__(self, tracing: Tracing, sampled: bool, trace_id: int, parent: Context | None, start: int, t0: float,
                 ids: int, clean: bool) -> None:
        """`ids`: 256 random bits, the trace's id the high 128 (when it has no parent: then `trace_id` is them, or
        1), the span's id the low 64, the upstream call's the 64 before; `start`: epoch ns of `t0` (perf_counter).
        The ids are kept as the bytes the wire carries (`tid`, `sid`, `uid`, and `pid` the parent's, the client's:
        empty where there is none), as ints by the properties of their names. One field a statement (several at
        once would build a tuple)."""
        self.tracing = tracing
        self.sampled = sampled
        self.t0 = t0
        self.start = start
        raw = ids.to_bytes(32, "big")
        sid = raw[24:]
        self.sid = sid if sid != _ZERO8 else _ONE8
        uid = raw[16:24]
        self.uid = uid if uid != _ZERO8 else _ONE8
        if parent is None:
            self.tid = raw[:16] if trace_id != 1 else _ONE16
            self.pid = b""
            self.tracestate = None
        else:
            self.tid = trace_id.to_bytes(16, "big")
            self.pid = parent.span_id.to_bytes(8, "big")
            self.tracestate = parent.tracestate
        self.end_ns: int | None = None
        self.holds = 1  # the request itself, until its last byte
        self.ended = False
        #: when the request went upstream (None: it did not), and the upstream call's end (epoch ns)
        self.up_start: float | None = None
        self.up_end_ns = 0
        self.clean = clean  # the client sent no trace header (its headers go upstream as they are, plus ours)
        #: set when the request finishes (`finish`), after the fields of `Served` the span reads: `status`,
        #: `perturbation` (what the profile did: `perturbation_attributes`), `injected_calls`, `repaired`,
        #: `upstream_s`, `total_s` (unset until then: read only where `asked` is set)
        self.asked: Asked | None = None
        self.summary: AnswerSummary | None = None  # what the span reads of the final answer (`checked`, ...)
        self.rules: list[str] | None = None  # the conformance rules the answer broke, once it was checked
        self.made: Span | None = None  # the request's span as a `Span`, once something was noted on it (`span`)

    @property
    def remote(self) -> bool:
        """The span has a parent of another process's (the client's: the only parent a request's span has)."""
        return bool(self.pid)

    @property
    def span(self) -> Span | None:
        """The request's span (None: not sampled), made from the trace's fields the first time it is asked for
        (an unperturbed request's never is: `Tracing.plain_span` writes it from the fields)."""
        span = self.made
        if span is None and self.sampled:
            with _MAKING:  # once: a verdict's thread and the event loop may both ask first
                span = self.made
                if span is None:
                    span = self.made = Span(self.tracing.exporter, self.trace_id, self.parent_id, self.remote,
                                            "chat", SERVER, self.start, {}, self.tracestate, self.span_id)
        return span

    @property
    def trace_id(self) -> int:
        return int.from_bytes(self.tid, "big")

    @property
    def span_id(self) -> int:
        return int.from_bytes(self.sid, "big")

    @property
    def up_id(self) -> int:
        return int.from_bytes(self.uid, "big")

    @property
    def parent_id(self) -> int:
        """The parent span's id, 0 where there is none."""
        return int.from_bytes(self.pid, "big")

    def at(self, t: float) -> int:
        """A perf_counter() time of this request as the epoch nanoseconds spans take."""
        return self.start + int((t - self.t0) * 1e9)

    def child(self, name: str, kind: int = INTERNAL, start: float | None = None,
              attributes: dict[str, Any] | None = None) -> Span | None:
        span = self.span
        if span is None:
            return None
        return span.child(name, kind, self.at(start) if start is not None else None, attributes)

    def forward(self, span: Span | None, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """`headers` with the client's trace headers replaced by `span`'s context (a fresh span id, sampled flag 0,
        when the request is not sampled), for the backend."""
        if span is None:
            return forward(self.trace_id, new_id(64), False, self.tracestate, headers)
        return forward(span.trace_id, span.span_id, True, span.tracestate, headers)

    def sending(self, asked: Asked, served: Served, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The request goes upstream with the upstream call's context, which the backend gets (its span is written
        at `finish`). Returns the headers to send."""
        try:
            self.up_start = served.t_upstream or _perf_counter()
            out = list(headers) if self.clean else [h for h in headers if h[0].lower() not in TRACE_HEADERS]
            out.append(("traceparent", "00-" + self.tid.hex() + "-" + self.uid.hex() + ("-01" if self.sampled
                                                                                         else "-00")))
            if self.tracestate:
                out.append(("tracestate", self.tracestate))
            return out
        except Exception as exc:
            self.tracing.failed(exc)
            return headers

    def answered(self, asked: Asked, served: Served, answer: dict[str, Any] | None) -> None:
        """The final answer (chat-shaped), as the client got it: what the span reads of it."""
        if not self.sampled or answer is None:
            return
        try:
            self.summary = answer_summary(answer)
        except Exception as exc:
            self.tracing.failed(exc)

    def relayed(self, asked: Asked, data: bytes) -> None:
        """The answer's bytes as relayed to the client (a request passed through): what the span reads of them."""
        if not self.sampled or not data or asked.api is None:
            return
        try:
            self.summary = relayed_summary(asked.api, asked.stream, data)
        except Exception as exc:
            self.tracing.failed(exc)

    def checked(self, asked: Asked, data: bytes) -> Any:
        """A whole answer's bytes (passed through), read in the proxy's check that they are a JSON object: what the
        span reads of them, and the decode the check looks at (None: the check decodes them itself)."""
        if not self.sampled or asked.api is None:
            return None
        try:
            self.summary, decoded = checked_summary(asked.api, data)
            return decoded
        except Exception as exc:
            self.tracing.failed(exc)
            return None

    def conformance(self, rules: list[str]) -> None:
        """The answer was checked (after its last byte): the rules it broke."""
        self.rules = rules

    def client_got(self, wire: dict[str, Any]) -> None:
        """A rewritten answer in the client's wire form: the response id the client sees."""
        if self.sampled and isinstance(wire.get("id"), str):
            self.span.attributes["gen_ai.response.id"] = wire["id"]  # type: ignore[union-attr]

    def finish(self, asked: Asked, served: Served) -> None:
        """The request's last byte was sent (or it was refused): its end time; the upstream call's span, from the
        times recorded."""
        if not self.sampled:
            self.end_ns = 0
            self.release()
            return
        try:
            # what the span reads of `served` (which holds this trace: no cycle, and none of its bodies), then `asked`
            self.status, self.injected_calls, self.repaired = served.status, served.injected_calls, served.repaired
            self.total_s = served.total_s
            self.upstream_s = upstream_s = served.upstream_s
            outcome = served.outcome
            self.perturbation = None if outcome is None else perturbation_attributes(outcome)
            self.asked = asked
            start = self.start
            if self.up_start is not None:  # its span is written when the request's is
                self.up_end_ns = start + int(((served.t_upstream or self.t0) + upstream_s - self.t0) * 1e9) \
                    if upstream_s is not None else start + int(served.total_s * 1e9)
            if self.tracing.config.contents and asked.request is not None:
                self.contents(asked, served)
            self.end_ns = start + int(served.total_s * 1e9)
        except Exception as exc:
            self.tracing.failed(exc)
            self.end_ns = _time_ns()
        self.release()

    def fill(self) -> None:
        """The request span's name, attributes and status, gathered in the span (a request that is not plain:
        `Tracing.plain_span`): those noted on it while it ran win over those worked out here."""
        span, asked, served = self.span, self.asked, self
        if span is None or asked is None:
            return
        attrs: dict[str, Any] = {}
        if asked.model:
            span.name = "chat " + asked.model
        span.fixed = self.tracing.fixed(asked)
        request_into(attrs, asked, served)
        if self.summary is not None:
            summary_into(attrs, self.summary)
        finish_into(attrs, served)
        if self.rules is not None:
            attrs["toolquake.conformance.checked"] = True
            attrs["toolquake.conformance.rules"] = self.rules
        if served.status >= 500 or served.status == 0:
            span.set_status(ERROR)
            attrs["error.type"] = str(served.status)
        attrs.update(span.attributes)
        span.attributes = attrs

    def contents(self, asked: Asked, served: Served) -> None:
        """Prompt and answer, redacted off the event loop (the span waits for them), each attribute cut to
        `TracingConfig.content_chars`; none without a redactor. What waits to be redacted is bounded (characters,
        `[tracing] max_queue_bytes`): past it the span goes without contents (`toolquake.contents.skipped`),
        counted (stage `contents`). The work holds the request and the answer, never this trace or `served`."""
        tracing, span = self.tracing, self.span
        redact = tracing.redact
        if redact is None or span is None:
            return
        loop = asyncio.get_running_loop()
        request, answer = asked.request or {}, served.response
        bound = tracing.config.max_queue_bytes
        size = text_size((request.get("messages"), request.get("tools"), answer), bound)
        if tracing.contents_waiting + size > bound:
            tracing.contents_skipped.inc()
            span.attributes["toolquake.contents.skipped"] = "backlog"
            return
        tracing.contents_waiting += size  # changed on the event loop only (here and in `done`)
        limit = tracing.config.content_chars
        attributes = span.attributes
        self.hold()

        def work() -> None:
            try:
                attributes.update(content_attributes(redact, request, answer, limit))
            except Exception as exc:
                tracing.failed(exc)

        def done(_: Any, release: Callable[[], None] = self.release) -> None:  # on the event loop
            tracing.contents_waiting -= size
            release()

        loop.run_in_executor(None, work).add_done_callback(done)

    def hold(self) -> None:
        """Something will still add to this span (a check after the last byte, a verdict, a twin)."""
        self.holds += 1

    def release(self) -> None:
        """What held the span is done with it; the last one, once the request ended, ends it (exported)."""
        self.holds -= 1
        if self.holds > 0 or self.end_ns is None or self.ended:
            return
        self.ended = True
        if not self.sampled:
            return
        try:
            if not self.tracing.plain_span(self):
                if self.up_start is not None and self.asked is not None:
                    self.tracing.upstream_span(self, self.status, self.at(self.up_start), self.up_end_ns)
                self.fill()
                self.span.finish(self.end_ns)  # type: ignore[union-attr]
        except Exception as exc:
            self.tracing.failed(exc)
        self.asked = None

    def __del__(self) -> None:  # a trace dropped with a hold never released: its span still ends
        if not self.ended and self.end_ns is not None:
            self.holds = 1
            self.release()

    def call(self, name: str, asked: Asked, headers: Iterable[tuple[str, str]], attributes: dict[str, Any],
             outcome: Any = None) -> tuple[Span | None, list[tuple[str, str]]]:
        """A call the proxy makes upstream for this request (a follow-up, a shadow twin carrying the perturbation
        `outcome`: its `perturbation_attributes` after `attributes`): its span, a child of the request's, and the
        headers that carry its context to the backend."""
        try:
            span = None
            if self.span is not None:
                attrs = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", **self.tracing.server,
                         **({"gen_ai.request.model": asked.model} if asked.model else {}), **attributes}
                if outcome is not None:
                    attrs.update(perturbation_attributes(outcome))
                span = self.child(name, CLIENT, attributes=attrs)
            return span, self.forward(span, headers)
        except Exception as exc:
            self.tracing.failed(exc)
            return None, list(headers)

    def called(self, span: Span | None, status: int, answer: dict[str, Any] | None = None,
               attributes: dict[str, Any] | None = None) -> None:
        """The call's answer came back (or failed: status 0)."""
        if span is None:
            return
        try:
            span.attributes["http.response.status_code"] = status
            if answer is not None:
                span.attributes.update(answer_attributes(answer))
            if attributes:
                span.attributes.update({k: v for k, v in attributes.items() if v is not None})
            if status == 0 or status >= 400:
                span.set_status(ERROR)
            span.finish()
        except Exception as exc:
            self.tracing.failed(exc)

    def tools_answered(self, calls: list[dict[str, Any]]) -> None:
        """Calls to tools the proxy added, answered by the proxy itself (an execute_tool span each)."""
        if self.span is None:
            return
        try:
            for call in calls:
                name = str((call.get("function") or {}).get("name"))
                self.span.child(f"execute_tool {name}", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.type": "function",
                    "gen_ai.tool.call.id": str(call.get("id") or ""), "toolquake.tool.injected": True}).finish()
        except Exception as exc:
            self.tracing.failed(exc)

    def scored(self, name: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        """A verdict (from the scoring thread): its own span, and its attributes on the request's."""
        if self.span is None:
            return
        try:
            kept = {k: v for k, v in attributes.items() if v is not None}
            self.span.child(name, INTERNAL, self.at(start), dict(kept)).finish(self.at(end))
            self.note(kept)
        except Exception as exc:
            self.tracing.failed(exc)

    def note(self, attributes: dict[str, Any]) -> None:
        """Attributes judged after the last byte (conformance, verdicts); from any thread."""
        if self.span is None:
            return
        try:
            self.span.attributes.update({k: v for k, v in attributes.items() if v is not None})
        except Exception as exc:
            self.tracing.failed(exc)


def request_into(out: dict[str, Any], asked: Asked, served: RequestTrace) -> None:
    """What the request is and what the profile did to it, added to `out` (the route's and profile's attributes
    are the span's `fixed` ones: `Tracing.fixed`)."""
    out["gen_ai.request.stream"] = asked.stream
    out["toolquake.request_id"] = asked.request_id
    if asked.model:
        out["gen_ai.request.model"] = asked.model
    request = asked.request
    if request is not None:
        for key, attr in _REQUEST_NUMBERS:
            value = request.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[attr] = value
        out["toolquake.tools"] = sum(1 for t in request.get("tools") or () if isinstance(t, dict))
        out["toolquake.seed"] = str(asked.perturbation_seed)
    if asked.case is not None:
        out["toolquake.case_id"] = str(getattr(asked.case, "id", ""))
    if served.perturbation is not None:
        out.update(served.perturbation)


#: a plain request's own values as `otlp.UnperturbedLayout` writes them: its id's bytes, its answer's id's bytes and
#: their length (-1: no id), and the token counts' varints (empty: no count; a varint is never empty)
OwnValues = tuple[bytes, bytes, int, bytes, bytes]


def is_plain(trace: RequestTrace, asked: Asked) -> bool:
    """A request whose span's attributes are its own values only (`Tracing.plain_span`): not decoded, of no case,
    unchanged, answered without an error, a call to an added tool or a repair, and nothing noted on it."""
    made = trace.made
    return asked.request is None and asked.case is None and trace.perturbation is None \
        and not trace.injected_calls and not trace.repaired and 0 < trace.status < 500 \
        and (made is None or not (made.attributes or made.events))


def own_values(request_id: str, summary: AnswerSummary | None) -> OwnValues:
    """A plain request's own values (`OwnValues`) from its id and its answer's summary."""
    rid = request_id.encode("utf-8", "replace")
    if summary is None:
        return rid, b"", -1, b"", b""
    count_in, count_out, answer_id = summary.input_tokens, summary.output_tokens, summary.id
    resp = b"" if answer_id is None else answer_id.encode("utf-8", "replace")
    return (rid, resp, -1 if answer_id is None else len(resp), b"" if count_in is None else _uvarint(count_in),
            b"" if count_out is None else _uvarint(count_out))


def own_attributes(trace: RequestTrace, request_id: str) -> bytes:
    """A plain request's own attributes, encoded in the order the layout writes them: its id, its answer's id and
    token counts, the durations."""
    summary, upstream_s = trace.summary, trace.upstream_s
    own = otlp.str_attribute("toolquake.request_id", request_id)
    if summary is not None:
        if summary.id is not None:
            own += otlp.str_attribute("gen_ai.response.id", summary.id)
        if summary.input_tokens is not None:
            own += otlp.int_attribute("gen_ai.usage.input_tokens", summary.input_tokens)
        if summary.output_tokens is not None:
            own += otlp.int_attribute("gen_ai.usage.output_tokens", summary.output_tokens)
    if upstream_s is not None:
        own += _UPSTREAM_MS + _pack_double(_ms(upstream_s)) + _OVERHEAD_MS + _pack_double(
            _ms(max(trace.total_s - upstream_s, 0.0)))
    return own


_REQUEST_NUMBERS = (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                    ("max_tokens", "gen_ai.request.max_tokens"), ("seed", "gen_ai.request.seed"),
                    ("max_completion_tokens", "gen_ai.request.max_tokens"))


def perturbation_attributes(outcome: Any) -> dict[str, Any]:
    """The steps applied, and their key report fields: numbers and booleans, the few identifier-valued fields,
    the tools each added (never text that came from the request); the remedies apart (`toolquake.remedies`,
    `toolquake.remedy.<name>.*`, the needed tools one left out as a count)."""
    out: dict[str, Any] = {"toolquake.perturbers": [a.name for a in outcome.perturbations],
                           "toolquake.perturbed": bool(outcome.changed)}
    if outcome.failed:
        out["toolquake.perturbers_failed"] = list(outcome.failed)
    if outcome.remedies:
        out["toolquake.remedies"] = [a.name for a in outcome.remedies]
    if outcome.remedies_failed:
        out["toolquake.remedies_failed"] = list(outcome.remedies_failed)
    tokens = 0
    for applied in outcome.applied:
        prefix = f"toolquake.{'remedy' if applied.is_remedy else 'perturber'}.{applied.name}."
        needed = applied.report.get("dropped_needed")
        if isinstance(needed, list):
            out[prefix + "dropped_needed"] = len(needed)
        for key, value in applied.report.items():
            if isinstance(value, bool) or (isinstance(value, (int, float)) and value == value):
                out[prefix + key] = value
            elif key in REPORT_STRINGS and isinstance(value, str) and len(value) <= 128:
                out[prefix + key] = value
        if applied.added_tools:
            out[prefix + "tools_added"] = list(applied.added_tools)
        added = applied.report.get("tokens_added")
        if isinstance(added, int) and not isinstance(added, bool) and not applied.is_remedy:
            tokens += added
    out["toolquake.tokens_added"] = tokens
    return out


def answer_attributes(answer: dict[str, Any]) -> dict[str, Any]:
    """gen_ai.response.* and gen_ai.usage.* of a chat-shaped answer (both APIs' answers take this form)."""
    out: dict[str, Any] = {}
    summary_into(out, answer_summary(answer))
    return out


class AnswerSummary(NamedTuple):
    """What a span reads of an answer (`answer_summary`); `None`: the answer has no such value. Its model, finish
    reasons and calls' names are what requests share (`Tracing.plain_span`'s cache key); its id and token counts
    are each answer's own."""

    model: str | None
    finish_reasons: tuple[str, ...]
    input_tokens: int | None
    output_tokens: int | None
    tool_calls: tuple[str, ...]
    id: str | None


_new_summary = tuple.__new__  # an AnswerSummary from a tuple of its fields, without NamedTuple's Python __new__


def answer_summary(answer: dict[str, Any]) -> AnswerSummary:
    """The response's model and id, the choices' finish reasons, the token usage, the first choice's calls' names
    (one pass over the choices; values not of their type are left out: a token count is an int, not a bool)."""
    model, answer_id = answer.get("model"), answer.get("id")
    reasons: list[str] = []
    first = None
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            if first is None:
                first = choice
            reason = choice.get("finish_reason")
            if reason:
                reasons.append(str(reason))
    usage = answer.get("usage")
    tokens_in = tokens_out = None
    if isinstance(usage, dict):
        tokens_in, tokens_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
    message = first.get("message") if first is not None else None
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    names = tuple(str(fn.get("name") if isinstance(fn := c.get("function"), dict) else None) for c in calls
                  if isinstance(c, dict)) if calls and isinstance(calls, list) else ()
    return AnswerSummary(model if isinstance(model, str) else None, tuple(reasons),
                         tokens_in if type(tokens_in) is int else None,
                         tokens_out if type(tokens_out) is int else None, names,
                         answer_id if isinstance(answer_id, str) else None)


class _Function(msgspec.Struct, gc=False):
    name: Any = None


class _Call(msgspec.Struct, gc=False):
    function: _Function | None = None


class _Message(msgspec.Struct, gc=False):
    tool_calls: list[_Call] | None = None


class _Choice(msgspec.Struct, gc=False):
    finish_reason: str | None = None
    message: _Message | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Answer(msgspec.Struct, gc=False):
    """What `relayed_summary` reads of a chat completion (the rest is skipped, not built); typed as
    `answer_summary` keeps them (a value of another type fails the decode, and the answer is read the slow way,
    to the same summary)."""

    id: str | None = None
    model: str | None = None
    usage: _Usage | None = None
    choices: list[_Choice] | None = None


_read_answer = msgspec.json.Decoder(_Answer).decode
_NOT_READ = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


def relayed_summary(api: Any, stream: bool, data: bytes) -> AnswerSummary | None:
    """`answer_summary` of an answer's bytes as relayed (a stream's whole SSE body, else its JSON): a chat
    completion read into the few fields it gives; what is not of a well-formed answer's shape, decoded whole and
    read as `answer_summary` reads it (the same summary). None: no answer could be read."""
    if stream:
        answer = api.summarize(data)
        if answer is None:
            native = api.assemble(data)
            answer = api.answer_to_internal(native) if native else None
        return answer_summary(answer) if answer is not None else None
    return checked_summary(api, data)[0]


#: what `checked_summary` hands the proxy's check for an answer read typed: a JSON object (the check's own decode
#: would have built a dict of its raw values, which nobody reads)
_AN_OBJECT: dict[str, Any] = {}


def checked_summary(api: Any, data: bytes) -> tuple[AnswerSummary | None, Any]:
    """`relayed_summary` of a whole answer's bytes, and what was decoded for the proxy's check that they are a JSON
    object (answer/plain.py: a dict passes, anything else is refused; None: they did not decode, the check says
    how). A chat completion is read into the few fields the summary takes (the rest is skipped, not built); what
    is not of a well-formed answer's shape is decoded whole and read as `answer_summary` reads it."""
    if api.route == "chat_completions":
        try:
            typed = _read_answer(data)
        except _NOT_READ:
            pass
        else:  # the hot path of a passed-through request's span: no generator, no NamedTuple __new__ frame
            usage, choices = typed.usage, typed.choices
            if usage is None:
                tokens_in = tokens_out = None
            else:
                tokens_in, tokens_out = usage.prompt_tokens, usage.completion_tokens
            reasons: tuple[str, ...] = ()
            names: tuple[str, ...] = ()
            if choices:
                first = choices[0]
                if len(choices) == 1:
                    reason = first.finish_reason
                    if reason:
                        reasons = (reason,)
                else:
                    reasons = tuple([c.finish_reason for c in choices if c.finish_reason])
                message = first.message
                calls = message.tool_calls if message is not None else None
                if calls:
                    if len(calls) == 1:
                        function = calls[0].function
                        names = (str(function.name if function is not None else None),)
                    else:
                        names = tuple([str(c.function.name if c.function is not None else None) for c in calls])
            return _new_summary(AnswerSummary, (typed.model, reasons, tokens_in, tokens_out, names,
                                                typed.id)), _AN_OBJECT
    try:
        decoded = msgspec.json.decode(data)
    except _NOT_READ:
        return None, None
    if not isinstance(decoded, dict):
        return None, decoded
    return answer_summary(api.answer_to_internal(decoded)), decoded


def _ms(seconds: float) -> float:
    """Seconds as milliseconds to the microsecond (`round(seconds * 1e6) / 1000`, written out where it is hot:
    `round(x, 3)` goes through a decimal string)."""
    return round(seconds * 1e6) / 1000


def summary_into(out: dict[str, Any], summary: AnswerSummary, own: bool = True) -> None:
    """The summary's attributes added to `out`; `own` False: but the values of one answer only (its id, its token
    counts), which `Tracing.plain_span` writes per request."""
    if summary.model is not None:
        out["gen_ai.response.model"] = summary.model
    if summary.id is not None and own:
        out["gen_ai.response.id"] = summary.id
    if summary.finish_reasons:
        out["gen_ai.response.finish_reasons"] = list(summary.finish_reasons)
    if summary.input_tokens is not None and own:
        out["gen_ai.usage.input_tokens"] = summary.input_tokens
    if summary.output_tokens is not None and own:
        out["gen_ai.usage.output_tokens"] = summary.output_tokens
    out["toolquake.answer.tool_calls"] = list(summary.tool_calls)


def finish_into(out: dict[str, Any], served: RequestTrace) -> None:
    out["http.response.status_code"] = served.status
    if served.upstream_s is not None:
        out["toolquake.upstream_ms"] = _ms(served.upstream_s)
        out["toolquake.overhead_ms"] = _ms(max(served.total_s - served.upstream_s, 0.0))
    if served.injected_calls:
        out["toolquake.injected_calls"] = list(served.injected_calls)
    if served.repaired:
        out["toolquake.conformance.repaired"] = served.repaired


def content_attributes(redact: Callable[[Any], Any], request: dict[str, Any],
                       answer: dict[str, Any] | None, limit: int = TRACE_CONTENT_CHARS) -> dict[str, str]:
    """gen_ai.input.messages, gen_ai.output.messages and gen_ai.tool.definitions, every string redacted, then each
    attribute cut to `limit` characters (`cut`: redacted first, so a cut never leaves part of a secret)."""
    messages = [genai_message(m) for m in request.get("messages") or [] if isinstance(m, dict)]
    out = {"gen_ai.input.messages": cut(_encode(redact(messages)).decode(), limit)}
    if request.get("tools"):
        out["gen_ai.tool.definitions"] = cut(_encode(redact(request["tools"])).decode(), limit)
    if answer is not None:
        outputs = [{**genai_message(c.get("message") or {}), "finish_reason": str(c.get("finish_reason") or "stop")}
                   for c in answer.get("choices") or [] if isinstance(c, dict)]
        out["gen_ai.output.messages"] = cut(_encode(redact(outputs)).decode(), limit)
    return out


def cut(text: str, limit: int) -> str:
    """`text` cut to its first `limit` characters, marked with how many were cut (`…[N characters cut]`)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text) - limit} characters cut]"


def text_size(value: Any, most: int) -> int:
    """The characters of the strings in `value` (dicts' keys and values, lists, nested: what redacting it reads),
    counted until they pass `most` (the walk stops there)."""
    total, stack = 0, [value]
    while stack and total <= most:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def genai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message in the GenAI conventions' form: a role and its parts (text, tool calls, a tool's result)."""
    role = str(message.get("role") or "assistant")
    content = message.get("content")
    parts: list[dict[str, Any]] = []
    if role == "tool":
        parts.append({"type": "tool_call_response", "id": str(message.get("tool_call_id") or ""),
                      "response": content})
    elif isinstance(content, str):
        parts.append({"type": "text", "content": content})
    elif isinstance(content, list):
        parts.extend({"type": "text", "content": p.get("text")} for p in content
                     if isinstance(p, dict) and isinstance(p.get("text"), str))
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") or {}
            parts.append({"type": "tool_call", "id": str(call.get("id") or ""), "name": str(fn.get("name") or ""),
                          "arguments": fn.get("arguments")})
    return {"role": role, "parts": parts}
