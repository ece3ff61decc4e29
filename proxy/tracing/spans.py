"""Spans of toolquake's own (docs/tracing.md): a slotted record per span, the W3C trace context read and written,
the sampler the OpenTelemetry SDK defines (`OTEL_TRACES_SAMPLER` / `_ARG`), and one exporter thread that sends
finished spans in batches over OTLP/HTTP (protobuf, `otlp.py`), with the SDK's `OTEL_EXPORTER_OTLP_*` and
`OTEL_BSP_*` settings.

On the request path a span costs a record and a dict; a request the sampler leaves out costs no record at all
(its context still goes upstream, sampled flag 0). A span is encoded as it ends (by the thread that ends it,
after the request's last byte) into a queue of encoded spans bounded in spans (`OTEL_BSP_MAX_QUEUE_SIZE`) and in
bytes (`[tracing] max_queue_bytes`, the batch being sent included): past either they are dropped and counted.
The exporter sends them in batches and counts what it could not send: in the server, as a task of its event loop,
over a non-blocking connection (a sending thread cost the event loop more than the sending itself: each time it took
the interpreter's lock back, the loop had to hand it over); elsewhere (replay, sweep), from a thread of its own.
Nothing here raises into a request, and nothing on the request path waits on the collector.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import random
import ssl
import threading
import time
import zlib
from collections import deque
from operator import itemgetter
from typing import Any, Sequence
from urllib.parse import unquote, urlsplit

import structlog

from toolquake.proxy.server.config import TRACE_QUEUE_BYTES, ConfigError
from toolquake.proxy.tracing import otlp

log = structlog.get_logger("toolquake.tracing")

#: OTLP's span kinds and status codes
INTERNAL, SERVER, CLIENT = 1, 2, 3
UNSET, OK, ERROR = 0, 1, 2
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")
_HEX = "0123456789abcdef"
_TRACEPARENT_MAX = 512  # longer (a future version's extra fields): not read
_TRACESTATE_MAX = 4096  # the headers joined; longer: dropped
_TRACESTATE_MEMBERS = 32
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-*/")
_VALUE_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) - {",", "="}
_getrandbits = random.getrandbits  # reseeded in a forked worker by the random module itself
_time_ns = time.time_ns
_NOT_IN_NAMES = frozenset(' \t\r\n\0:()<>@,;\\"/[]?={}')
_ANSWER_MAX = 1 << 20  # a collector's answer read (an OTLP answer is a few bytes)
_framed = otlp.framed


def new_id(bits: int) -> int:
    return _getrandbits(bits) or 1


class Context:
    """A span context read from a client's headers (W3C trace context)."""

    __slots__ = ("trace_id", "span_id", "sampled", "tracestate")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, tracestate: str | None) -> None:
        self.trace_id, self.span_id, self.sampled, self.tracestate = trace_id, span_id, sampled, tracestate


class Span:
    """One span: ids, name, kind, times (epoch ns), attributes, status; ended into its exporter's queue."""

    __slots__ = ("trace_id", "span_id", "parent_id", "remote", "name", "kind", "start", "end", "attributes",
                 "status", "description", "tracestate", "events", "exporter", "fixed")

    def __init__(self, exporter: Exporter | None, trace_id: int, parent_id: int, remote: bool, name: str, kind: int,
                 start: int, attributes: dict[str, Any] | None, tracestate: str | None, span_id: int = 0,
                 fixed: bytes = b"") -> None:
        self.exporter = exporter
        self.trace_id, self.span_id, self.parent_id, self.remote = trace_id, span_id or new_id(64), parent_id, remote
        self.name, self.kind, self.start, self.end = name, kind, start, 0
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}
        #: attributes that are the same for many spans (a route's, a profile's), already encoded as the OTLP
        #: Span.attributes fields (otlp.attributes); exported before `attributes`, never with the same keys
        self.fixed = fixed
        self.status, self.description, self.tracestate = UNSET, "", tracestate
        self.events: list[tuple[int, str, dict[str, Any]]] | None = None

    def set_status(self, code: int, description: str = "") -> None:
        self.status, self.description = code, description if code == ERROR else ""

    def child(self, name: str, kind: int = INTERNAL, start: int | None = None,
              attributes: dict[str, Any] | None = None) -> Span:
        """A span under this one (sampled as this one was)."""
        return Span(self.exporter, self.trace_id, self.span_id, False, name, kind,
                    _time_ns() if start is None else start, attributes, self.tracestate)

    def finish(self, end: int | None = None) -> None:
        """Ends the span (once) and hands it to the exporter."""
        if self.end:
            return
        self.end = end or _time_ns()
        if self.exporter is not None:
            self.exporter.put(self)


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, or None when it is not one: checked by
    position and character set (linear, bounded), a version of `ff`, all-zero ids and version 00 with extra
    fields refused; a later version's extra fields are skipped as the spec says."""
    value = value.strip(" \t")
    n = len(value)
    if n < 55 or n > _TRACEPARENT_MAX or value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    version, trace, parent, flags = value[0:2], value[3:35], value[36:52], value[53:55]
    if version.strip(_HEX) or trace.strip(_HEX) or parent.strip(_HEX) or flags.strip(_HEX) or version == "ff":
        return None
    if n > 55 and (version == "00" or value[55] != "-"):
        return None
    trace_id, span_id = int(trace, 16), int(parent, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _tracestate_key(key: str) -> bool:
    tenant, at, system = key.partition("@")
    if not tenant or tenant[0] not in _HEX + "ghijklmnopqrstuvwxyz" or not _KEY_CHARS.issuperset(tenant):
        return False
    if not at:
        return len(key) <= 256 and tenant[0].isalpha()
    return (len(tenant) <= 241 and 0 < len(system) <= 14 and system[0].isalpha() and system[0].islower()
            and _KEY_CHARS.issuperset(system))


def parse_tracestate(values: list[str]) -> str | None:
    """A W3C tracestate (several headers joined), checked member by member; None when it is invalid or too
    long (the SDK drops an invalid tracestate as a whole too)."""
    joined = ",".join(values)
    if len(joined) > _TRACESTATE_MAX:
        return None
    members, keys = [], set()
    for raw in joined.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        key, eq, val = member.partition("=")
        if not eq or not val or len(val) > 256 or val[-1] == " " or key in keys or not _tracestate_key(key) \
                or not _VALUE_CHARS.issuperset(val):
            return None
        keys.add(key)
        members.append(member)
    if len(members) > _TRACESTATE_MEMBERS:
        return None
    return ",".join(members) or None


def extract(headers: Sequence[tuple[str, str]]) -> Context | None:
    """The client's span context, or None (none sent, malformed, or sent twice: a fresh trace then)."""
    return scan(headers)[0]


_TRACE_NAMES, _name = frozenset({"traceparent", "tracestate"}), itemgetter(0)


def scan(headers: Sequence[tuple[str, str]]) -> tuple[Context | None, bool]:
    """The client's span context (as `extract`), and whether any trace header was sent at all. The names are
    lower-case, as the server gives them (ASGI's rule; uvicorn lowers them)."""
    if _TRACE_NAMES.isdisjoint(map(_name, headers)):  # most requests carry none: one pass in C says so
        return None, False
    parents: list[str] | None = None
    states: list[str] | None = None
    for k, v in headers:
        n = len(k)
        if n == 11 and k.lower() == "traceparent":
            if parents is None:
                parents = []
            parents.append(v)
        elif n == 10 and k.lower() == "tracestate":
            if states is None:
                states = []
            states.append(v)
    if parents is None:
        return None, states is not None
    if len(parents) != 1:
        return None, bool(parents or states)
    parsed = parse_traceparent(parents[0])
    if parsed is None:
        return None, True
    return Context(parsed[0], parsed[1], parsed[2], parse_tracestate(states) if states else None), True


class Sampler:
    """OTEL_TRACES_SAMPLER / _ARG as the OpenTelemetry SDK defines them (parent-based always-on by default): a
    root decides by its own rule (all, none, or a trace id ratio: the id's low 64 bits under ratio × 2⁶⁴); a
    parent-based sampler follows the parent's sampled flag when there is a parent."""

    def __init__(self, name: str, arg: str) -> None:
        name = (name or "parentbased_always_on").strip().lower()
        if name not in SAMPLERS:
            raise ConfigError(f"OTEL_TRACES_SAMPLER={name!r}: use one of {', '.join(SAMPLERS)}")
        ratio = 1.0
        if name.endswith("traceidratio"):
            try:
                ratio = float(arg) if arg else 1.0
            except ValueError:
                raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number between 0 and 1") from None
            if not 0.0 <= ratio <= 1.0:
                raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a number between 0 and 1")
        elif name.endswith("always_off"):
            ratio = 0.0
        self.name, self.parent_based = name, name.startswith("parentbased_")
        self.bound = round(ratio * (1 << 64))

    def __call__(self, trace_id: int, parent: Context | None) -> bool:
        if parent is not None and self.parent_based:
            return parent.sampled
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound


def parse_pairs(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES), percent-decoded, keys lower-cased;
    a pair without `=` or a key is skipped, as the SDK's liberal reading does."""
    out: dict[str, str] = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        name = unquote(name).strip().lower()
        if eq and name:
            out[name] = unquote(value).strip()
    return out


def number(otel: dict[str, str], *keys: str) -> float | None:
    for key in keys:
        if otel.get(key):
            try:
                return float(otel[key])
            except ValueError:
                raise ConfigError(f"{key}={otel[key]!r} is not a number") from None
    return None


class Exporter:
    """The bounded queue of finished spans, encoded, and what sends them (a task of the server's event loop, or a
    thread of its own): every `OTEL_BSP_SCHEDULE_DELAY` ms, or as soon as a batch is full, in batches of
    `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`; each batch one POST, retried on a connection error or 429/502/503/504 with
    backoff within `OTEL_EXPORTER_OTLP_TIMEOUT`. The queue holds at most `OTEL_BSP_MAX_QUEUE_SIZE` spans and
    `max_bytes` bytes of them, the batch being sent included (`held`: a collector that hangs holds at most that).

    What is left of `max_bytes` (`left`) is only changed by augmented assignments (`self.left -= n`, `self.left +=
    n`: one statement each, no call between its read and its write, so no other thread runs in between under the
    interpreter's lock), from whichever thread puts or sends: a put takes its bytes first and gives them back where
    they do not fit, so no change is ever lost (two puts at once near the bound may both find no room). A lock there
    cost a passed-through request more than the rest of its queueing."""

    RETRYABLE = frozenset({429, 502, 503, 504})

    def __init__(self, url: str, otel: dict[str, str], resource: dict[str, Any], version: str, failures: Any,
                 max_bytes: int = TRACE_QUEUE_BYTES) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"OTLP endpoint {url!r}: an http:// or https:// URL is needed")
        self.url, self.parts = url, parts
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        compression = (otel.get("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION") or otel.get("OTEL_EXPORTER_OTLP_COMPRESSION")
                       or "none").strip().lower()
        if compression not in ("gzip", "deflate", "none"):
            raise ConfigError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r}: use gzip, deflate or none")
        self.compression = None if compression == "none" else compression
        headers = otel.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or otel.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
        self.headers = {**parse_pairs(headers), "content-type": "application/x-protobuf",
                        "user-agent": f"toolquake/{version}"}
        for name, value in self.headers.items():  # written on the wire as they are (`_post_async`)
            if not name.isascii() or any(c in name for c in _NOT_IN_NAMES) or any(c in value for c in "\r\n\0"):
                raise ConfigError(f"OTEL_EXPORTER_OTLP_HEADERS: header {name!r} cannot be sent (a name is a token; "
                                  "no line break or NUL in a value)")
        if self.compression:
            self.headers["content-encoding"] = self.compression
        self.timeout = number(otel, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT") or 10.0
        delay = number(otel, "OTEL_BSP_SCHEDULE_DELAY")
        self.delay = (delay if delay is not None else 5000.0) / 1000
        export_timeout = number(otel, "OTEL_BSP_EXPORT_TIMEOUT")
        self.export_timeout = (export_timeout if export_timeout is not None else 30000.0) / 1000
        self.max_queue = int(number(otel, "OTEL_BSP_MAX_QUEUE_SIZE") or 2048)
        self.max_batch = min(int(number(otel, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE") or 512), self.max_queue)
        if self.max_queue < 1 or self.max_batch < 1 or self.delay < 0:
            raise ConfigError("OTEL_BSP_*: the queue and batch sizes must be positive, the delay not negative")
        self.failures = failures
        self.resource = otlp.resource(resource)
        self.scope = otlp.scope("toolquake", version)
        self.queue: deque[bytes] = deque()  # spans encoded (otlp.framed)
        self.max_bytes = max_bytes
        self.left = max_bytes  # `max_bytes` less the bytes of the spans queued and of the batch being sent
        self.dropped, self.drop_logged = 0, 0.0  # spans dropped on a full queue, when that was last logged
        self.wake = threading.Event()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.conn: http.client.HTTPConnection | None = None
        #: the event loop whose task sends (`start(loop)`), its thread, the task, its wake-up, its connection
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = 0
        self.task: asyncio.Task[None] | None = None
        self.async_wake: asyncio.Event | None = None
        self.woken = False  # a wake-up was asked since the sender last woke
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def put(self, span: Span) -> None:
        """A finished span (from any thread): encoded and queued, or dropped and counted when the queue is full
        or it cannot be encoded."""
        if not self.room():
            return
        try:
            encoded = _framed(span)
        except Exception as exc:  # e.g. an id out of range: this span is left out, counted
            self.failures.inc()
            log.warning("trace_export_failed", error_type=type(exc).__name__, stage="encode")
            return
        self.put_encoded(encoded)

    @property
    def held(self) -> int:
        """Bytes of the spans queued and of the batch being sent."""
        return self.max_bytes - self.left

    def room(self) -> bool:
        """Whether the queue takes one more span; False: it is full, and the span about to be put is counted
        dropped."""
        if len(self.queue) < self.max_queue:
            return True
        self._dropped("spans")
        return False

    def _dropped(self, full: str) -> None:
        """A span dropped on a full queue (`full`: of spans, or of bytes), counted; logged at most every 10 s."""
        self.failures.inc()
        self.dropped += 1
        if self.dropped == 1 or time.monotonic() >= self.drop_logged + 10:
            self.drop_logged = time.monotonic()
            log.warning("trace_queue_full", dropped=self.dropped, full=full, max_queue=self.max_queue,
                        max_bytes=self.max_bytes)

    def put_encoded(self, encoded: bytes) -> None:
        """A span encoded (`otlp.framed`), queued (after `room` said yes), or dropped and counted where its bytes
        do not fit."""
        size = len(encoded)
        self.left -= size  # taken, then given back where it does not fit (`Exporter`: no change is lost)
        if self.left < 0:
            self.left += size
            self._dropped("bytes")
            return
        queue = self.queue
        queue.append(encoded)
        if len(queue) >= self.max_batch and not self.woken:
            self.woken = True
            self._wake()

    def put_pair(self, first: bytes, second: bytes) -> None:
        """Two spans encoded, queued in this order as the queue has room (`room`, `put_encoded`; one call where
        both fit, the unperturbed request's hot path)."""
        queue = self.queue
        size = len(first) + len(second)
        self.left -= size  # taken, then given back where they do not fit (`Exporter`: no change is lost)
        if self.left >= 0 and len(queue) + 2 <= self.max_queue:
            queue.append(first)
            queue.append(second)
            if len(queue) >= self.max_batch and not self.woken:
                self.woken = True
                self._wake()
            return
        self.left += size
        if self.room():
            self.put_encoded(first)
        if self.room():
            self.put_encoded(second)

    def _wake(self) -> None:
        loop, wake = self.loop, self.async_wake
        if loop is None or wake is None:
            self.wake.set()
        elif threading.get_ident() == self.loop_thread:
            wake.set()
        else:  # a span ended on another thread (a verdict's)
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: what is left is lost, as at any stop
                pass

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """The sender: a task of `loop` (the server's event loop, running: no thread), else a thread of its own."""
        if loop is not None:
            self.loop, self.loop_thread, self.async_wake = loop, threading.get_ident(), asyncio.Event()
            self.task = loop.create_task(self._run_async())
            return
        self.thread = threading.Thread(target=self._run, name="toolquake-trace-export", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        """Sends what is queued (bounded by the export timeout), then stops the thread."""
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join(self.export_timeout + self.timeout)
        self._close()

    async def ashutdown(self) -> None:
        """The event loop's sender (`start(loop)`): sends what is queued (bounded by the export timeout), then
        stops."""
        self.stopping = True
        if self.async_wake is not None:
            self.async_wake.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), self.export_timeout + self.timeout)
            except (TimeoutError, asyncio.CancelledError):
                self.task.cancel()
        self._close_stream()

    async def _run_async(self) -> None:
        wake = self.async_wake
        assert wake is not None
        while not self.stopping:
            timed_out = False
            try:
                async with asyncio.timeout(self.delay):
                    await wake.wait()
            except TimeoutError:
                timed_out = True
            wake.clear()
            self.woken = False
            await self._drain_async(whole=timed_out)
        await self._drain_async(whole=True)

    async def _drain_async(self, whole: bool) -> None:
        """Full batches (`whole`: every span queued, the last batch what is left), one POST each."""
        queue, popleft = self.queue, self.queue.popleft
        while len(queue) >= (1 if whole else self.max_batch):
            batch = [popleft() for _ in range(min(len(queue), self.max_batch))]
            try:
                sent = await self.send_async(*otlp.request_parts(batch, self.resource, self.scope))
            except Exception as exc:  # fail-open: the batch is lost, counted
                log.warning("trace_export_failed", error_type=type(exc).__name__)
                sent = False
            finally:
                done = sum(map(len, batch))
                self.left += done  # sent or lost: no longer held
            if not sent:
                self.failures.inc(len(batch))

    async def send_async(self, parts: list[bytes], length: int) -> bool:
        """One batch's POST from the event loop (`send`'s retries and backoff, awaited)."""
        if self.compression:  # off the loop: compressing a batch takes milliseconds
            parts = [await asyncio.to_thread(self._compress, b"".join(parts))]
            length = len(parts[0])
        deadline = time.monotonic() + min(self.timeout, self.export_timeout)
        backoff, error = 1.0, ""
        while True:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.05)):
                    status = await self._post_async(parts, length)
                if 200 <= status < 300:
                    return True
                error = f"HTTP {status}"
                if status not in self.RETRYABLE:
                    break
            except (OSError, TimeoutError, ValueError, EOFError, asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError) as exc:
                self._close_stream()
                error = type(exc).__name__
            if self.stopping or time.monotonic() + backoff > deadline:
                break
            await asyncio.sleep(backoff)
            backoff *= 2
        log.warning("trace_export_failed", error_type=error, endpoint=self.url)
        return False

    async def _post_async(self, parts: list[bytes], length: int) -> int:
        """POST the parts over the kept-alive connection (HTTP/1.1); the status. The answer's head is read up to
        64 KiB, its body up to 1 MiB (an OTLP answer is a few bytes): more closes the connection."""
        if self.stream is None or self.stream[1].is_closing():
            p = self.parts
            https = p.scheme == "https"
            self.stream = await asyncio.open_connection(p.hostname, p.port or (443 if https else 80),
                                                        ssl=ssl.create_default_context() if https else None)
        reader, writer = self.stream
        host = self.parts.netloc.rpartition("@")[2]
        head = [f"POST {self.path} HTTP/1.1", f"host: {host}", f"content-length: {length}"]
        head += [f"{k}: {v}" for k, v in self.headers.items() if k not in ("host", "content-length")]
        writer.writelines([("\r\n".join(head) + "\r\n\r\n").encode("latin-1", "replace"), *parts])
        await writer.drain()
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError("not an HTTP/1.x answer")
        status = int(rest[:3])
        fields: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        close = fields.get("connection", "").lower() == "close" or version == "HTTP/1.0"
        if "chunked" in fields.get("transfer-encoding", "").lower():
            total = 0
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                total += size
                if total > _ANSWER_MAX:
                    raise ValueError("answer too long")
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        elif "content-length" in fields:
            size = int(fields["content-length"])
            if not 0 <= size <= _ANSWER_MAX:
                raise ValueError("answer too long")
            await reader.readexactly(size)
        elif status not in (204, 304):  # a body up to the connection's end
            data = await reader.read(_ANSWER_MAX + 1)
            if len(data) > _ANSWER_MAX:
                raise ValueError("answer too long")
            close = True
        if close:
            self._close_stream()
        return status

    def _close_stream(self) -> None:
        if self.stream is not None:
            self.stream[1].close()
            self.stream = None

    def _compress(self, body: bytes) -> bytes:
        return gzip.compress(body, compresslevel=6) if self.compression == "gzip" else zlib.compress(body)

    def _run(self) -> None:
        while not self.stopping:
            self.wake.wait(self.delay)
            self.wake.clear()
            self.woken = False
            self._drain()
        self._drain()

    def _drain(self) -> None:
        queue, popleft = self.queue, self.queue.popleft
        while queue:
            batch = [popleft() for _ in range(min(len(queue), self.max_batch))]
            try:
                sent = self.send(otlp.request(batch, self.resource, self.scope))
            except Exception as exc:  # fail-open: the batch is lost, counted
                log.warning("trace_export_failed", error_type=type(exc).__name__)
                sent = False
            finally:
                done = sum(map(len, batch))
                self.left += done  # sent or lost: no longer held
            if not sent:
                self.failures.inc(len(batch))

    def send(self, body: bytes) -> bool:
        """One batch's POST, retried with backoff (1, 2, 4 s...) while the timeout allows."""
        if self.compression:
            body = self._compress(body)
        deadline = time.monotonic() + min(self.timeout, self.export_timeout)
        backoff, error = 1.0, ""
        while True:
            try:
                status = self._post(body, max(deadline - time.monotonic(), 0.05))
                if 200 <= status < 300:
                    return True
                error = f"HTTP {status}"
                if status not in self.RETRYABLE:
                    break
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                error = type(exc).__name__
            if self.stopping or time.monotonic() + backoff > deadline:
                break
            time.sleep(backoff)
            backoff *= 2
        log.warning("trace_export_failed", error_type=error, endpoint=self.url)
        return False

    def _post(self, body: bytes, timeout: float) -> int:
        if self.conn is None:
            parts = self.parts
            if parts.scheme == "https":
                self.conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                                        context=ssl.create_default_context())
            else:
                self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        conn = self.conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        conn.request("POST", self.path, body=body, headers=self.headers)
        response = conn.getresponse()
        response.read()
        if response.will_close:
            self._close()
        return response.status

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # closing: nothing to do about it
                pass
            self.conn = None
