"""OTLP/protobuf encoding of finished spans (an `ExportTraceServiceRequest`), written straight to the wire format.

The spans are toolquake's own records (`tracing.Span`); this writes their bytes directly (varints,
length-delimited fields; field numbers from opentelemetry/proto/trace/v1/trace.proto and common/v1/common.proto).
What repeats is encoded once: the resource and the instrumentation scope per exporter, each attribute key once
per process (the keys are a small fixed set: toolquake's names and the perturbers' report keys), and a whole
key-value pair once when its value is a boolean or a low-cardinality string (`chat`, `openai`, a route, a profile,
a model). Values are written by small functions, one per type. tests/server/test_tracing.py decodes the output
with the official protobuf classes and compares it with the OpenTelemetry SDK's own encoding of the same spans.
"""

from __future__ import annotations

import struct
import time
from typing import Any, Callable, Sequence

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_MASK64 = (1 << 64) - 1
_SMALL = [bytes((i,)) for i in range(128)]
# Span.flags (fixed32, field 16): whether the parent is known to be remote (bit 8), and is (bit 9)
_LOCAL, _REMOTE = b"\x85\x01" + struct.pack("<I", 0x100), b"\x85\x01" + struct.pack("<I", 0x300)
_UNSET_STATUS = b"\x7a\x00"
_KINDS = [b"\x30" + bytes((k,)) for k in range(6)]  # Span.kind (varint, field 6)
_TIMES = struct.Struct("<BQBQ").pack  # start (fixed64, field 7: tag 0x39) and end (field 8: tag 0x41)
_IDS = struct.Struct(">BBQQBBQ").pack  # trace_id (bytes, field 1) and span_id (field 2), big-endian as the spec has
_PARENT = struct.Struct(">BBQ").pack  # parent_span_id (bytes, field 4)
_UNSET_LOCAL, _UNSET_REMOTE = _UNSET_STATUS + _LOCAL, _UNSET_STATUS + _REMOTE
#: attributes whose string values are unique per request (never cached as whole pairs)
UNIQUE = frozenset({"toolquake.request_id", "gen_ai.response.id", "toolquake.seed", "toolquake.case_id",
                    "toolquake.verdict.case_id", "gen_ai.tool.call.id", "gen_ai.input.messages",
                    "gen_ai.output.messages", "gen_ai.tool.definitions", "toolquake.shadow.error"})
_CACHE_MAX = 8192


def _varint(n: int) -> bytes:
    n &= _MASK64
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field whose tag byte(s) are `tag`."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _ld(_varint(number << 3 | 2), payload)


def _str(value: str) -> bytes:
    return _ld(b"\x0a", value.encode("utf-8", "replace"))


def _bool(value: bool) -> bytes:
    return b"\x10\x01" if value else b"\x10\x00"


def _int(value: int) -> bytes:
    return b"\x18" + _varint(value)


def _float(value: float) -> bytes:
    return b"\x21" + _pack_double(value)


def _array(value: Any) -> bytes:
    return _ld(b"\x2a", b"".join(_ld(b"\x0a", _any(v)) for v in value))


def _other(value: Any) -> bytes:
    if isinstance(value, bool):
        return _bool(value)
    if isinstance(value, str):
        return _str(value)
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, (list, tuple)):
        return _array(value)
    return _str(str(value))


#: an AnyValue by the value's exact type: string 1, bool 2, int 3, double 4, array 5
_BY_TYPE: dict[type, Callable[[Any], bytes]] = {str: _str, bool: _bool, int: _int, float: _float, list: _array,
                                                tuple: _array}


def _any(value: Any) -> bytes:
    return _BY_TYPE.get(type(value), _other)(value)


_KEYS: dict[str, bytes] = {}  # a key as its KeyValue.key field
_PAIRS: dict[tuple[str, Any, type], bytes] = {}  # a whole KeyValue field (booleans, small ints, repeated strings)


_FLOAT_PREFIX: dict[str, bytes] = {}  # a span attribute's field of a double, but the double's 8 bytes
_NAMES: dict[str, bytes] = {}  # a span's name as its Span.name field (a few per route and model)


def _key(key: str) -> bytes:
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _ld(b"\x0a", key.encode("utf-8", "replace"))
        if len(_KEYS) < _CACHE_MAX:
            _KEYS[key] = encoded
    return encoded


def _framed(tag: bytes, key: str, value: Any) -> bytes:
    """A KeyValue (key 1, value 2) as the field whose tag byte is `tag`."""
    kv = _key(key) + _ld(b"\x12", _any(value))
    n = len(kv)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + kv


def _cacheable(key: str, value: Any, kind: type) -> bool:
    if kind is str:
        return len(value) <= 64 and key not in UNIQUE
    return kind is bool or (kind is int and -1024 <= value <= 1 << 20)


def attributes(tag: bytes, attrs: dict[str, Any] | None) -> bytes:
    """Repeated KeyValue under the field whose tag byte is `tag`; whole pairs of booleans, small ints and
    low-cardinality strings come from a bounded cache."""
    if not attrs:
        return b""
    if tag != b"\x4a":
        return b"".join([_framed(tag, k, v) for k, v in attrs.items()])
    out = []
    get = _PAIRS.get
    for k, v in attrs.items():
        kind = type(v)
        if kind is str or kind is bool or kind is int:
            cached = get((k, v, kind))
            if cached is None:
                cached = _framed(tag, k, v)
                if _cacheable(k, v, kind):
                    if len(_PAIRS) >= _CACHE_MAX:
                        _PAIRS.clear()  # bounded: values that turned out not to repeat are forgotten together
                    _PAIRS[(k, v, kind)] = cached
            out.append(cached)
        elif kind is list and len(v) <= 4 and k not in UNIQUE and all(type(x) is str and len(x) <= 64 for x in v):
            key = (k, tuple(v), kind)  # finish reasons, tool names: a few short strings that repeat
            cached = get(key)
            if cached is None:
                if len(_PAIRS) >= _CACHE_MAX:
                    _PAIRS.clear()
                cached = _PAIRS[key] = _framed(tag, k, v)
            out.append(cached)
        elif kind is float:  # a span attribute's whole field but the 8 bytes of the double is the same per key
            prefix = _FLOAT_PREFIX.get(k)
            if prefix is None:
                prefix = _framed(tag, k, 0.0)[:-8]
                if len(_FLOAT_PREFIX) < _CACHE_MAX:
                    _FLOAT_PREFIX[k] = prefix
            out.append(prefix + _pack_double(v))
        else:
            out.append(_framed(tag, k, v))
    return b"".join(out)


def resource(attrs: dict[str, Any]) -> bytes:
    """A Resource message (its attributes, field 1), encoded once per exporter."""
    return attributes(b"\x0a", attrs)


def scope(name: str, version: str | None) -> bytes:
    """An InstrumentationScope message (name 1, version 2), encoded once per exporter."""
    return _str(name) + (_ld(b"\x12", version.encode()) if version else b"")


def span(s: Any) -> bytes:
    """One Span message from a `tracing.Span` record."""
    parent, trace_id = s.parent_id, s.trace_id
    name = _NAMES.get(s.name)
    if name is None:
        name = _ld(b"\x2a", s.name.encode("utf-8", "replace"))
        if len(s.name) <= 128:  # bounded: a model's name comes from the client
            if len(_NAMES) >= _CACHE_MAX:
                _NAMES.clear()
            _NAMES[s.name] = name
    # an id out of range (over 128 or 64 bits, negative) raises (struct.error): that span is left out, counted
    out = [_IDS(0x0A, 0x10, trace_id >> 64, trace_id & _MASK64, 0x12, 0x08, s.span_id),
           _ld(b"\x1a", s.tracestate.encode()) if s.tracestate else b"",
           _PARENT(0x22, 0x08, parent) if parent else b"", name, _KINDS[s.kind],
           _TIMES(0x39, s.start & _MASK64, 0x41, (s.end or 0) & _MASK64), s.fixed, attributes(b"\x4a", s.attributes)]
    for when, event, attrs in s.events or ():
        out.append(_ld(b"\x5a", b"\x09" + _pack_fixed64(when & _MASK64) + _ld(b"\x12", event.encode("utf-8", "replace"))
                       + attributes(b"\x1a", attrs)))
    if s.status:
        inner = _ld(b"\x12", s.description.encode("utf-8", "replace")) if s.description else b""
        out.append(_ld(b"\x7a", inner + b"\x18" + _SMALL[s.status]))
        out.append(_REMOTE if parent and s.remote else _LOCAL)
    else:
        out.append(_UNSET_REMOTE if parent and s.remote else _UNSET_LOCAL)
    return b"".join(out)


def encode(spans: Sequence[Any], resource_bytes: bytes, scope_bytes: bytes,
           pause: Callable[[], None] | None = None, slice_s: float = 0.001,
           failed: Callable[[BaseException], None] | None = None) -> bytes:
    """The ExportTraceServiceRequest of finished spans of one resource and scope (both encoded once: `resource`,
    `scope`). `pause` is called whenever encoding has run for `slice_s` since the last one: the exporter's thread
    lets the event loop's thread have the GIL (a batch encoded in one go would hold it for up to the interpreter's
    switch interval, 5 ms, and every request waiting on it would wait that long); a slice, not a span count, so
    that a busy event loop still leaves the exporter a share that keeps up. A span that cannot be encoded is
    left out and handed to `failed` (the others are sent); without `failed` it raises."""
    encoded = []
    clock = time.perf_counter
    last = clock()
    for i, s in enumerate(spans, 1):
        if pause is not None and not i & 7 and clock() - last >= slice_s:
            pause()
            last = clock()
        try:
            encoded.append(_ld(b"\x12", span(s)))
        except Exception as exc:
            if failed is None:
                raise
            failed(exc)
    scope_spans = _ld(b"\x0a", scope_bytes) + b"".join(encoded)
    return _ld(b"\x0a", _ld(b"\x0a", resource_bytes) + _ld(b"\x12", scope_spans))
