"""OTLP/protobuf encoding of finished spans (an `ExportTraceServiceRequest`), written straight to the wire format.

The SDK's encoder builds a protobuf message object per attribute and costs several times what the span itself
costs; this one writes the bytes directly (varints, length-delimited fields; field numbers from
opentelemetry/proto/trace/v1/trace.proto and common/v1/common.proto) and is what keeps exporting a span cheap
(docs/tracing.md, tests/bench/tracing_overhead.py). tests/server/test_tracing.py decodes its output with the
official protobuf classes and compares it with the SDK's own encoding.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Sequence

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_MASK64 = (1 << 64) - 1
_LOCAL, _REMOTE = b"\x85\x01" + struct.pack("<I", 0x100), b"\x85\x01" + struct.pack("<I", 0x300)


def _varint(n: int) -> bytes:
    n &= _MASK64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any(value: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, str):
        return _field(1, value.encode("utf-8", "replace"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    if isinstance(value, (list, tuple)):
        return _field(5, b"".join(_field(1, _any(v)) for v in value))
    return _field(1, str(value).encode("utf-8", "replace"))


#: attribute keys as encoded fields (toolquake's names and the perturbers' report keys: a small set; bounded)
_KEYS: dict[str, bytes] = {}
_KEYS_MAX = 4096


def _key(key: str) -> bytes:
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _field(1, key.encode("utf-8", "replace"))
        if len(_KEYS) < _KEYS_MAX:
            _KEYS[key] = encoded
    return encoded


def _attributes(number: int, attributes: Any) -> bytes:
    """Repeated KeyValue (key 1, value 2) under field `number`."""
    if not attributes:
        return b""
    return b"".join(_field(number, _key(k) + _field(2, _any(v))) for k, v in attributes.items())


def _span(span: Any) -> bytes:
    ctx = span.context
    out = [_field(1, ctx.trace_id.to_bytes(16, "big")), _field(2, ctx.span_id.to_bytes(8, "big"))]
    if ctx.trace_state:
        out.append(_field(3, ctx.trace_state.to_header().encode()))
    if span.parent is not None:
        out.append(_field(4, span.parent.span_id.to_bytes(8, "big")))
    out.append(_field(5, span.name.encode("utf-8", "replace")))
    out.append(b"\x30" + _varint(span.kind.value + 1))  # the SDK's INTERNAL is 0, OTLP's is 1
    out.append(b"\x39" + _pack_fixed64(span.start_time or 0))
    out.append(b"\x41" + _pack_fixed64(span.end_time or 0))
    out.append(_attributes(9, span.attributes))
    if span.dropped_attributes:
        out.append(b"\x50" + _varint(span.dropped_attributes))
    status = span.status
    if status.status_code.value:
        inner = (_field(2, status.description.encode("utf-8", "replace")) if status.description else b"")
        out.append(_field(15, inner + b"\x18" + _varint(status.status_code.value)))
    else:
        out.append(b"\x7a\x00")  # an empty Status: unset
    # flags (fixed32): whether the parent is known to be remote (bit 8), and is (bit 9)
    out.append(_REMOTE if span.parent is not None and span.parent.is_remote else _LOCAL)
    return b"".join(out)


def encode(spans: Sequence[Any], pause: Callable[[], None] | None = None, every: int = 8) -> bytes:
    """The ExportTraceServiceRequest of finished SDK spans (events and links are not used by toolquake and
    are left out), grouped by resource and instrumentation scope. `pause` is called after every `every` spans:
    the exporter's thread lets the event loop's thread have the GIL (a batch encoded in one go would hold it
    for milliseconds, and every request waiting on it would wait that long)."""
    groups: dict[tuple[int, int], tuple[Any, Any, list[bytes]]] = {}
    for i, span in enumerate(spans, 1):
        if pause is not None and i % every == 0:
            pause()
        key = (id(span.resource), id(span.instrumentation_scope))
        if key not in groups:
            groups[key] = (span.resource, span.instrumentation_scope, [])
        groups[key][2].append(_field(2, _span(span)))
    out = []
    for resource, scope, encoded in groups.values():
        scope_bytes = b""
        if scope is not None:
            scope_bytes = _field(1, scope.name.encode()) + (_field(2, scope.version.encode()) if scope.version else b"")
        scope_spans = _field(1, scope_bytes) + b"".join(encoded)
        resource_bytes = _attributes(1, resource.attributes if resource is not None else None)
        out.append(_field(1, _field(1, resource_bytes) + _field(2, scope_spans)))
    return b"".join(out)
