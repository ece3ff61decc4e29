"""OpenAI-shaped errors: the one helper that builds every error a client can see."""

from __future__ import annotations

import msgspec

from toolquake.proxy.server.protocol import ErrorBody, ErrorDetail

_encoder = msgspec.json.Encoder()


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    return _encoder.encode(ErrorBody(ErrorDetail(message=message, type=type, code=code, param=param)))


class ProxyError(Exception):
    """An error the proxy itself answers with (as opposed to one the upstream returned)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)
