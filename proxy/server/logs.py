"""Structured JSON logs (structlog): one line per request, never a secret.

`info(logger, event, fields)` writes the per-request line: once `configure` ran, it renders the line
itself (the same keys, order and redaction as the structlog chain, at a fraction of the cost); before,
it goes through structlog.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import msgspec
import structlog

# keys whose values are replaced wherever they appear in a log event
SECRET_KEYS = frozenset({"authorization", "api_key", "api-key", "x-api-key", "token", "admin_token",
                         "password", "cookie", "set-cookie"})


def _redact(_logger, _name, event: dict) -> dict:
    for key in list(event):
        if key.lower() in SECRET_KEYS:
            event[key] = "[redacted]"
    return event


def _dumps(event: dict, **_: object) -> str:
    return msgspec.json.encode(event, enc_hook=str).decode()


#: keys the request line has that are not secrets (the check for secret keys is skipped when all are these)
_PLAIN_KEYS = frozenset({"request_id", "route", "profile", "stream", "status", "perturbers", "total_ms", "upstream_ms",
                         "event", "worker", "level", "timestamp", "perturbers_failed", "injected_calls"})
_direct: dict[str, Any] = {}  # set by configure(): the stream, whether info is on, whether to name the worker
_encoder = msgspec.json.Encoder(enc_hook=str)


_second: list[Any] = [None, ""]  # the last whole second formatted, and its text


def _timestamp() -> str:
    """Now, UTC, as ISO 8601 with microseconds and "Z" (structlog's TimeStamper's form); the date and time of
    day are formatted once a second."""
    now = time.time()
    whole = int(now)
    if whole != _second[0]:
        _second[0], _second[1] = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second[1]}.{int((now - whole) * 1_000_000):06d}Z"


def info(logger: Any, event: str, fields: dict[str, Any]) -> None:
    """One info line; `fields` is consumed."""
    if not _direct:
        logger.info(event, **fields)
        return
    if not _direct["info"]:
        return
    fields["event"] = event
    if _direct["worker"]:
        fields["worker"] = os.getpid()
    fields["level"] = "info"
    fields["timestamp"] = _timestamp()
    if not _PLAIN_KEYS.issuperset(fields) and not SECRET_KEYS.isdisjoint(k.lower() for k in fields):
        _redact(None, None, fields)
    fd = _direct["fd"]
    if fd is not None:  # the line's bytes straight to the file: the text stream holds nothing (it is flushed
        line = _encoder.encode(fields) + b"\n"  # after every line), so nothing can come out of order
        while line:
            line = line[os.write(fd, line):]
        return
    stream = _direct["stream"]
    stream.write(_encoder.encode(fields).decode() + "\n")
    stream.flush()


def _fd_of(stream: Any) -> int | None:
    """The file descriptor under a text stream whose writes go out whole (line-buffered or unbuffered, so it
    never holds a line back); None for anything else (a StringIO, a block-buffered file)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return fd if getattr(stream, "line_buffering", False) or getattr(stream, "write_through", False) else None


def _worker(_logger, _name, event: dict) -> dict:
    event["worker"] = os.getpid()
    return event


def configure(level: str = "info", stream=None, *, worker_pid: bool = False) -> None:
    """`worker_pid`: every line names the process that wrote it (`"worker": pid`; several workers)."""
    _direct.update(stream=stream or sys.stderr, info=logging.INFO >= getattr(logging, level.upper()),
                   worker=worker_pid, fd=_fd_of(stream or sys.stderr))
    structlog.configure(
        processors=[
            *([_worker] if worker_pid else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
