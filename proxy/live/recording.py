"""Recording live traffic: each unperturbed exchange (the client's request and the model's final answer,
streams reassembled) appended to a JSON-lines file, for `toolquake cases from-recording`.

`attach` is a server extension (`create_app(config, extensions=[..., recording.attach])`); it does
nothing unless `[record] path` (or `toolquake serve --record PATH`) is set. The observer only takes
references and enqueues (full queue → dropped and counted); one writer thread redacts, encodes and
appends. Each record is one line written with one `O_APPEND` write and fsync'd (so the workers of
`serve --workers N` can share one file): a killed proxy leaves
at most a torn last line, which is cut off when the file is opened again and skipped by the reader.
The file never grows past `max_size`: from then on exchanges are dropped and counted.

The file is the recorder's own: a new recording starts with a header line (`{"toolquake_recording": 1,
...}`); `prepare` (run once, before the workers start) appends only to an empty file, one with that header, or
one written before the header existed (its first line is a record); anything else is refused
(`NotARecording`) and left byte for byte as it was. The torn-tail repair cuts only a trailing fragment that
starts like a record. The file is kept 0600.

What a record holds: the time, request id, API route, profile, model, whether it streamed, the chat-shaped
request (`messages`, `tools`, `tool_choice`, `parallel_tool_calls` only) and the answer's message. Never
headers (so neither `Authorization` nor any `X-Toolquake-*` value), never other body fields; every string of
a record (messages, call arguments, tool definitions, the answer, the model name) goes through the
`Redactor` (proxy/live/redact.py: secret shapes and the `[record] redact` patterns become `[redacted]`).
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import queue
import random
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from toolquake.proxy.live.redact import REDACTED, Redactor
from toolquake.proxy.server.config import RecordConfig, parse_size

if TYPE_CHECKING:
    from litestar import Litestar

    from toolquake.proxy.server.state import Asked, ProxyState, Served

log = structlog.get_logger("toolquake.record")

RECORD_VERSION = 1
#: the first line of a recording: `{"toolquake_recording": 1, "created": ...}`
HEADER_KEY = "toolquake_recording"
FORMAT_VERSION = 1
#: how every record line starts (`build_record` puts these keys first); a torn tail must start so to be cut
RECORD_PREFIX = b'{"v":%d,"ts":' % RECORD_VERSION
_HEADER_PREFIX = b'{"%s":' % HEADER_KEY.encode()
#: the request fields a record keeps (everything else — user ids, metadata, extra body — is left out)
KEPT_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls")
__all__ = ["REDACTED", "Redactor", "NotARecording", "prepare", "read_recording"]


class RecordMetrics:
    """The recorder's metrics (names are a contract)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.recorded = Counter("toolquake_recorded", "Exchanges appended to the recording.", ["route"], registry=r)
        self.dropped = Counter("toolquake_record_dropped", "Exchanges not recorded, by reason (queue_full, size_cap, "
                               "sampled_out, write_error).", ["reason"], registry=r)
        self.size = Gauge("toolquake_record_bytes", "Size of the recording file.", registry=r,
                          multiprocess_mode="max")  # every worker appends to the same file


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
    """The record of one exchange, every string redacted (identifiers such as tool names and roles match no
    secret shape and stay as they are; a secret-shaped one is redacted like any text)."""
    request = {k: job.request[k] for k in KEPT_FIELDS if k in job.request}
    request["messages"] = request.get("messages") or []
    fields = redact({"request_id": job.request_id, "route": job.route, "profile": job.profile, "model": job.model,
                     "stream": job.stream, "request": request, "answer": _answer(job.response)})
    return {"v": RECORD_VERSION, "ts": round(job.ts, 3), **fields}  # "v" and "ts" first: RECORD_PREFIX


class NotARecording(Exception):
    """The file is not a recording this recorder may append to; it was left as it was."""


#: recordings this process (or the parent it was forked from) checked and repaired: the workers of
#: `serve --workers N` inherit it and never repair a tail another worker may be writing
_PREPARED: set[str] = set()


def header_line() -> bytes:
    return json.dumps({HEADER_KEY: FORMAT_VERSION, "created": round(time.time(), 3),
                       "note": "toolquake serve --record; one JSON record per line after this one"},
                      separators=(",", ":")).encode() + b"\n"


def _first_line(fd: int, size: int) -> bytes | None:
    """The file's first line without its newline; None when the file has no newline at all."""
    pos, chunks = 0, []
    while pos < size:
        block = os.pread(fd, min(1 << 20, size - pos), pos)
        if not block:
            break
        nl = block.find(b"\n")
        if nl >= 0:
            chunks.append(block[:nl])
            return b"".join(chunks)
        chunks.append(block)
        pos += len(block)
    return None


def _ours(line: bytes) -> bool:
    """A header of this format, or a record of the format written before headers existed."""
    if not (line.startswith(_HEADER_PREFIX) or line.startswith(RECORD_PREFIX)):
        return False
    try:
        first = json.loads(line)
    except ValueError:
        return False
    if not isinstance(first, dict):
        return False
    if HEADER_KEY in first:
        if first[HEADER_KEY] != FORMAT_VERSION:
            raise NotARecording(f"a recording of format {first[HEADER_KEY]!r}, not {FORMAT_VERSION}; "
                                "record into a new file")
        return True
    return first.get("v") == RECORD_VERSION and "request" in first and "answer" in first


def _tail_start(fd: int, size: int) -> int:
    """The offset just after the last newline (0 if none)."""
    pos = size
    while pos > 0:  # back to the last newline, a block at a time
        step = min(65536, pos)
        pos -= step
        nl = os.pread(fd, step, pos).rfind(b"\n")
        if nl >= 0:
            return pos + nl + 1
    return 0


def prepare(path: str | Path) -> int:
    """Make `path` ready for appending, or refuse it: create it (0600, with a header), or check that it is a
    recording (its first line a header or a record), cut its own torn last record, and keep it 0600. Raises
    `NotARecording` (the file untouched) or OSError. Returns the bytes cut. Files that are not regular files
    (`/dev/null`, a FIFO) are neither checked nor repaired. Done once per file in a process tree."""
    real = os.path.realpath(Path(path).expanduser())
    if real in _PREPARED:
        return 0
    Path(real).parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        created = True
    except FileExistsError:
        fd = os.open(real, os.O_RDWR | os.O_APPEND)
        created = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _PREPARED.add(real)
            return 0
        fcntl.flock(fd, fcntl.LOCK_EX)  # two `serve` processes starting on one file: one at a time here
        size = os.fstat(fd).st_size
        cut = 0
        if size == 0:
            os.write(fd, header_line())
        else:
            first = _first_line(fd, size)
            if first is None:  # no newline at all: a torn first line, if it is one of ours
                if not (os.pread(fd, len(_HEADER_PREFIX), 0) == _HEADER_PREFIX
                        or os.pread(fd, len(RECORD_PREFIX), 0) == RECORD_PREFIX):
                    raise NotARecording("not a toolquake recording (no recording header or record on its first line)")
                cut = size
            elif not _ours(first):
                raise NotARecording("not a toolquake recording (no recording header or record on its first line)")
            else:
                keep = _tail_start(fd, size)
                if keep < size:
                    if os.pread(fd, len(RECORD_PREFIX), keep) != RECORD_PREFIX[:size - keep]:
                        raise NotARecording(f"a recording whose last {size - keep} byte(s) after its last newline "
                                            "are not a record; fix the file by hand")
                    cut = size - keep
            if cut:
                os.ftruncate(fd, size - cut)
                log.warning("recording_torn_tail_removed", path=real, bytes=cut)
                if size - cut == 0:
                    os.write(fd, header_line())
        if created or stat.S_IMODE(st.st_mode) != 0o600:  # only now: a refused file keeps its mode too
            if not created:
                log.warning("recording_mode_tightened", path=real, mode=oct(stat.S_IMODE(st.st_mode)))
            os.fchmod(fd, 0o600)  # whatever the umask made of it, or a copy made 0644 since
        _PREPARED.add(real)
        return cut
    finally:
        os.close(fd)


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
        self.redact = Redactor(self.settings.redact, self.settings.redact_timeout)
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=self.settings.queue_size)
        self.rng = random.Random()
        self.fd: int | None = None
        self.thread: threading.Thread | None = None

    def open(self) -> None:
        prepare(self.path)  # once per process tree: `serve` does it before the workers start
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self.fd).st_size
        self.metrics.size.set(self.size)
        self.thread = threading.Thread(target=self._run, name="toolquake-recorder", daemon=True)
        self.thread.start()
        log.info("recording", path=str(self.path), bytes=self.size, max_bytes=self.max_bytes)

    def wants(self, asked: Asked, served: Served) -> bool:
        """An unperturbed, answered model exchange of a recorded profile."""
        if served.status != 200 or not isinstance(served.response, dict) or asked.request is None:
            return False
        if served.outcome is not None and (served.outcome.applied or served.outcome.changed):
            return False
        names = self.settings.profiles
        return not names or any(fnmatch.fnmatchcase(asked.profile_name, p) for p in names)

    # -- on the event loop: take references, enqueue, go
    def observe(self, asked: Asked, served: Served) -> None:
        if not self.wants(asked, served):
            return
        if self.settings.sample_rate < 1.0 and self.rng.random() >= self.settings.sample_rate:
            self.metrics.dropped.labels("sampled_out").inc()
            return
        if self.full:
            self.metrics.dropped.labels("size_cap").inc()
            return
        job = Job(time.time(), asked.request_id, asked.route, asked.profile_name, asked.model, asked.stream,
                  asked.request, served.response)  # type: ignore[arg-type]
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


def refusal(path: str, exc: Exception) -> str:
    """The message `toolquake serve` exits with when the recording cannot be used."""
    if isinstance(exc, NotARecording):
        return (f"toolquake: [record] path {path}: {exc}; refusing to append to it (the file was not changed; "
                "give a new or empty file, or a recording made by toolquake serve --record)")
    return f"toolquake: [record] path {path}: {getattr(exc, 'strerror', None) or exc}"


def prepare_or_exit(settings: RecordConfig) -> None:
    """`toolquake serve`, before it serves (and before its workers start): the recording is usable, or exit."""
    if settings.path:
        try:
            prepare(settings.path)
        except (OSError, NotARecording) as exc:
            raise SystemExit(refusal(settings.path, exc)) from None


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
    except (OSError, NotARecording) as exc:
        raise SystemExit(refusal(settings.path, exc)) from None
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
    #: header lines seen (0 in a recording written before headers existed)
    headers: int = 0
    #: whether the first line that is not blank is a recording header (what `cases from-recording` asks for)
    header_first: bool = False


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
            if isinstance(rec, dict) and HEADER_KEY in rec:  # the header (or that of a concatenated recording)
                out.header_first |= not (out.headers or out.records or out.problems or out.torn)
                out.headers += 1
                continue
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
