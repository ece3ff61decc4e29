"""Recording live traffic: each unperturbed exchange (the client's request and the model's final answer,
streams reassembled) appended to a JSON-lines file, for `toolquake cases from-recording`.

`attach` is a server extension (`create_app(config, extensions=[..., recording.attach])`); it does
nothing unless `[record] path` (or `toolquake serve --record PATH`) is set. The observer only takes
references and enqueues (full queue → dropped and counted); one writer thread redacts, encodes and
appends. Each record is one line written with one `O_APPEND` write and fsync'd (so the workers of
`serve --workers N` can share one file): a killed proxy leaves
at most a torn last line, which is cut off when the file is opened again and skipped by the reader.
The file never grows past `max_size`: from then on exchanges are dropped and counted.

What a record holds: the time, request id, API route, profile, model, whether it streamed, the chat-shaped
request (`messages`, `tools`, `tool_choice`, `parallel_tool_calls` only) and the answer's message. Never
headers (so neither `Authorization` nor any `X-Toolquake-*` value), never other body fields; API-key
shaped strings and the `[record] redact` patterns are replaced by `[redacted]` in every text.
"""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from toolquake.proxy.server.config import RecordConfig, parse_size

if TYPE_CHECKING:
    from litestar import Litestar

    from toolquake.proxy.server.state import ProxyState, RequestContext

log = structlog.get_logger("toolquake.record")

RECORD_VERSION = 1
REDACTED = "[redacted]"
#: always redacted, whatever the config says: strings shaped like API keys and bearer tokens
SECRET_PATTERNS = (r"\bsk-[A-Za-z0-9_\-]{16,}", r"\b(?i:bearer)\s+[A-Za-z0-9._~+/\-]{8,}=*", r"\bAKIA[0-9A-Z]{16}\b",
                   r"\bgh[pousr]_[A-Za-z0-9]{20,}")
#: the request fields a record keeps (everything else — user ids, metadata, extra body — is left out)
KEPT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls")
#: message keys whose values are identifiers, never redacted
_PLAIN_KEYS = frozenset({"role", "type", "id", "tool_call_id", "name"})


class RecordMetrics:
    """The recorder's metrics (names are a contract)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.recorded = Counter("toolquake_recorded", "Exchanges appended to the recording.", ["route"], registry=r)
        self.dropped = Counter("toolquake_record_dropped", "Exchanges not recorded, by reason (queue_full, size_cap, "
                               "sampled_out, write_error).", ["reason"], registry=r)
        self.size = Gauge("toolquake_record_bytes", "Size of the recording file.", registry=r,
                          multiprocess_mode="max")  # every worker appends to the same file


class Redactor:
    """Replaces secret-shaped strings and the configured patterns in every text of a message list or answer."""

    def __init__(self, patterns: list[str]) -> None:
        self.pattern = re.compile("|".join(f"(?:{p})" for p in (*SECRET_PATTERNS, *patterns)))

    def text(self, value: str) -> str:
        return self.pattern.sub(REDACTED, value)

    def __call__(self, value: Any, key: str | None = None) -> Any:
        if isinstance(value, str):
            if key in _PLAIN_KEYS:
                return value
            if key == "arguments":  # JSON text: redact its strings, keep it JSON (untouched when nothing matches)
                if not self.pattern.search(value):
                    return value
                try:
                    return json.dumps(self(json.loads(value)), ensure_ascii=False)
                except ValueError:
                    return self.text(value)
            return self.text(value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: self(v, k) for k, v in value.items()}
        return value


@dataclass(frozen=True)
class Job:
    """References to what one record needs (built and encoded in the writer thread)."""

    ts: float
    request_id: str
    route: str
    profile: str
    model: str | None
    stream: bool
    request: dict[str, Any]
    response: dict[str, Any]


def _answer(response: dict[str, Any]) -> dict[str, Any]:
    choices = response.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message") or {}
    out = {k: message[k] for k in ("role", "content", "tool_calls") if k in message}
    return {"message": out, "finish_reason": first.get("finish_reason")}


def build_record(job: Job, redact: Redactor) -> dict[str, Any]:
    request = {k: job.request[k] for k in KEPT_FIELDS if k in job.request}
    request["messages"] = redact(request.get("messages") or [])
    return {"v": RECORD_VERSION, "ts": round(job.ts, 3), "request_id": job.request_id, "route": job.route,
            "profile": job.profile, "model": job.model, "stream": job.stream, "request": request,
            "answer": redact(_answer(job.response))}


def repair_tail(path: Path) -> int:
    """Cut a torn last line (no newline at the end: the writer was killed mid-record). Returns bytes cut."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            pos, keep = size, 0
            while pos > 0:  # back to the last newline, a block at a time
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    keep = pos + nl + 1
                    break
            f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0


@dataclass
class Recorder:
    settings: RecordConfig
    metrics: RecordMetrics
    path: Path = field(init=False)
    max_bytes: int = field(init=False)
    size: int = 0
    full: bool = False

    def __post_init__(self) -> None:
        self.path = Path(self.settings.path).expanduser()
        self.max_bytes = parse_size(self.settings.max_size)
        self.redact = Redactor(self.settings.redact)
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=self.settings.queue_size)
        self.rng = random.Random()
        self.fd: int | None = None
        self.thread: threading.Thread | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = repair_tail(self.path)
        if cut:
            log.warning("recording_torn_tail_removed", path=str(self.path), bytes=cut)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self.fd).st_size
        self.metrics.size.set(self.size)
        self.thread = threading.Thread(target=self._run, name="toolquake-recorder", daemon=True)
        self.thread.start()
        log.info("recording", path=str(self.path), bytes=self.size, max_bytes=self.max_bytes)

    def wants(self, ctx: RequestContext) -> bool:
        """An unperturbed, answered model exchange of a recorded profile."""
        if ctx.status != 200 or not isinstance(ctx.response, dict) or ctx.request is None:
            return False
        if ctx.outcome is not None and (ctx.outcome.applied or ctx.outcome.changed):
            return False
        names = self.settings.profiles
        return not names or any(fnmatch.fnmatchcase(ctx.profile_name, p) for p in names)

    # -- on the event loop: take references, enqueue, go
    def observe(self, ctx: RequestContext) -> None:
        if not self.wants(ctx):
            return
        if self.settings.sample_rate < 1.0 and self.rng.random() >= self.settings.sample_rate:
            self.metrics.dropped.labels("sampled_out").inc()
            return
        if self.full:
            self.metrics.dropped.labels("size_cap").inc()
            return
        job = Job(time.time(), ctx.request_id, ctx.route, ctx.profile_name, ctx.model, ctx.stream, ctx.request,
                  ctx.response)  # type: ignore[arg-type]
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.metrics.dropped.labels("queue_full").inc()

    # -- in the writer thread
    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                self._write(job)
            except Exception as exc:  # a full disk or a bad body loses this record, never the proxy
                self.metrics.dropped.labels("write_error").inc()
                log.warning("record_failed", error_type=type(exc).__name__, error=str(exc)[:200])

    def _write(self, job: Job) -> None:
        line = (json.dumps(build_record(job, self.redact), ensure_ascii=False, separators=(",", ":"), default=str)
                + "\n").encode()
        assert self.fd is not None
        self.size = os.fstat(self.fd).st_size  # other workers (`serve --workers N`) append to the same file
        if self.size + len(line) > self.max_bytes:
            if not self.full:
                log.warning("recording_full", path=str(self.path), bytes=self.size, max_bytes=self.max_bytes)
            self.full = True
            self.metrics.dropped.labels("size_cap").inc()
            return
        view = memoryview(line)
        while view:  # one write in practice; a short write is finished, never interleaved (one writer)
            n = os.write(self.fd, view)
            view = view[n:]
        if self.settings.fsync:
            os.fsync(self.fd)
        self.size += len(line)
        self.metrics.size.set(self.size)
        self.metrics.recorded.labels(job.route).inc()

    def close(self, timeout: float = 5.0) -> None:
        if self.thread is not None:
            try:
                self.queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self.thread.join(timeout)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def attach(app: Litestar, st: ProxyState) -> Recorder | None:
    """Record the server's unperturbed exchanges when `[record] path` is set. The metrics are exported either
    way (at zero without a recording), so dashboards and alerts find them."""
    settings = st.config.record
    metrics = RecordMetrics(st.metrics.registry)
    if not settings.path:
        return None
    recorder = Recorder(settings, metrics)
    try:
        recorder.open()
    except OSError as exc:
        raise SystemExit(f"toolquake: [record] path {settings.path}: {exc.strerror or exc}") from None
    st.observers.append(recorder.observe)

    async def shutdown() -> None:
        import asyncio

        await asyncio.to_thread(recorder.close)

    app.on_shutdown.append(shutdown)
    return recorder


# -- reading a recording -------------------------------------------------------------------------------


@dataclass
class Recording:
    records: list[dict[str, Any]] = field(default_factory=list)
    #: (line number, reason) of lines that are not records; a torn last line is counted in `torn`
    problems: list[tuple[int, str]] = field(default_factory=list)
    torn: int = 0


def read_recording(path: str | Path) -> Recording:
    """Every complete record of a recording; a torn last line (the writer was killed) is skipped."""
    out = Recording()
    raw = Path(path).read_bytes()
    lines = raw.split(b"\n")
    ends_clean = raw.endswith(b"\n") or not raw
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        last = i == len(lines) - 1
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "request" not in rec or "answer" not in rec:
                raise ValueError("not a record")
        except ValueError as exc:
            if last and not ends_clean:
                out.torn += 1
            else:
                out.problems.append((i + 1, str(exc)[:200]))
            continue
        out.records.append(rec)
    return out
