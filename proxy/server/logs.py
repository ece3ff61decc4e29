"""Structured JSON logs (structlog): one line per request, never a secret."""

from __future__ import annotations

import logging
import sys

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


def configure(level: str = "info", stream=None) -> None:
    structlog.configure(
        processors=[
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
