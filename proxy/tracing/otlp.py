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


def uvarint(n: int) -> bytes:
    """`_varint`, written out for the counts a span carries per request (a token count: one to three bytes)."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0x80 <= n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if 0x4000 <= n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    return _varint(n)


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
#: whole KeyValue fields of span attributes, by value type: low-cardinality strings, small ints, booleans, lists of
#: a few short strings (finish reasons, tool names); each bounded (cleared together when full: values that turned
#: out not to repeat are forgotten)
_STRS: dict[tuple[str, str], bytes] = {}
_INTS: dict[tuple[str, int], bytes] = {}
_BOOLS: dict[tuple[str, bool], bytes] = {}
_LISTS: dict[tuple[str, ...], bytes] = {}
_STR_PREFIX: dict[tuple[str, int], bytes] = {}  # a string attribute's field but the string, by key and length
_INT_PREFIX: dict[tuple[str, int], bytes] = {}  # an int attribute's field but the varint, by key and its length
_FLOAT_PREFIX: dict[str, bytes] = {}  # a span attribute's field of a double, but the double's 8 bytes
_NAMES: dict[str, bytes] = {}  # a span's name as its Span.name field (a few per route and model)
_SPAN_TAG = b"\x4a"  # Span.attributes


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


def str_attribute(key: str, value: str) -> bytes:
    """A span attribute of a string (unique to one span: an id), encoded: the field's first bytes, which depend on
    the key and the string's length only, from a bounded cache (`string_prefix`)."""
    raw = value.encode("utf-8", "replace")
    return string_prefix(key, len(raw)) + raw


def string_prefix(key: str, n: int) -> bytes:
    """A span attribute of a string of `n` bytes (UTF-8), encoded but the string (a bounded cache)."""
    prefix = _STR_PREFIX.get((key, n))
    if prefix is None:
        prefix = _framed(_SPAN_TAG, key, "x" * n)[:-n or None]
        if n < 0x80:
            _kept(_STR_PREFIX, (key, n), prefix)
    return prefix


def int_prefix(key: str, n: int) -> bytes:
    """A span attribute of an int whose varint is `n` bytes (1 to 10), encoded but the varint (a bounded cache)."""
    prefix = _INT_PREFIX.get((key, n))
    if prefix is None:
        prefix = _kept(_INT_PREFIX, (key, n), _framed(_SPAN_TAG, key, 1 << 63 if n >= 10 else 1 << 7 * (n - 1))[:-n])
    return prefix


def _kept(cache: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = encoded
    return encoded


def attributes(tag: bytes, attrs: dict[str, Any] | None) -> bytes:
    """Repeated KeyValue under the field whose tag byte is `tag`; a span's (tag 0x4a) whole pairs of booleans,
    small ints, low-cardinality strings and short lists of them come from bounded caches."""
    if not attrs:
        return b""
    if tag != _SPAN_TAG:
        return b"".join([_framed(tag, k, v) for k, v in attrs.items()])
    out: list[bytes] = []
    append = out.append
    for k, v in attrs.items():
        kind = type(v)
        if kind is str:
            if len(v) > 64 or k in UNIQUE:
                append(str_attribute(k, v))
                continue
            encoded = _STRS.get((k, v))
            if encoded is None:
                encoded = _kept(_STRS, (k, v), _framed(tag, k, v))
        elif kind is int:
            encoded = int_attribute(k, v)
        elif kind is bool:
            encoded = _BOOLS.get((k, v))
            if encoded is None:
                encoded = _kept(_BOOLS, (k, v), _framed(tag, k, v))
        elif kind is float:  # the whole field but the 8 bytes of the double is the same per key
            encoded = float_attribute(k, v)
        elif (kind is list or kind is tuple) and len(v) <= 4 and k not in UNIQUE:
            for x in v:
                if type(x) is not str or len(x) > 64:
                    encoded = _framed(tag, k, v)
                    break
            else:
                key = (k, *v)
                encoded = _LISTS.get(key)  # type: ignore[assignment]
                if encoded is None:
                    encoded = _kept(_LISTS, key, _framed(tag, k, v))
        else:
            encoded = _framed(tag, k, v)
        append(encoded)
    return b"".join(out)


def resource(attrs: dict[str, Any]) -> bytes:
    """A Resource message (its attributes, field 1), encoded once per exporter."""
    return attributes(b"\x0a", attrs)


def scope(name: str, version: str | None) -> bytes:
    """An InstrumentationScope message (name 1, version 2), encoded once per exporter."""
    return _str(name) + (_ld(b"\x12", version.encode()) if version else b"")


def name_field(name: str) -> bytes:
    """A span's name as its Span.name field (a bounded cache: a few per route and model)."""
    field = _NAMES.get(name)
    if field is None:
        field = _ld(b"\x2a", name.encode("utf-8", "replace"))
        if len(name) <= 128:  # bounded: a model's name comes from the client
            if len(_NAMES) >= _CACHE_MAX:
                _NAMES.clear()
            _NAMES[name] = field
    return field


def head(trace_id: int, span_id: int, parent: int, tracestate: str | None, name: bytes, kind: int, start: int,
         end: int) -> bytes:
    """A Span message's fields before its attributes: ids, trace state, parent, name (`name_field`), kind, times.
    An id out of range (over 128 or 64 bits, negative) raises struct.error."""
    return b"".join((_IDS(0x0A, 0x10, trace_id >> 64, trace_id & _MASK64, 0x12, 0x08, span_id),
                     _ld(b"\x1a", tracestate.encode()) if tracestate else b"",
                     _PARENT(0x22, 0x08, parent) if parent else b"", name, _KINDS[kind],
                     _TIMES(0x39, start & _MASK64, 0x41, end & _MASK64)))


def tail(status: int, description: str, remote_parent: bool) -> bytes:
    """A Span message's fields after its attributes and events: its status (when set) and flags."""
    if status:
        inner = _ld(b"\x12", description.encode("utf-8", "replace")) if description else b""
        return _ld(b"\x7a", inner + b"\x18" + _SMALL[status]) + (_REMOTE if remote_parent else _LOCAL)
    return _UNSET_REMOTE if remote_parent else _UNSET_LOCAL


def span(s: Any) -> bytes:
    """One Span message from a `tracing.Span` record."""
    parent = s.parent_id
    out = [head(s.trace_id, s.span_id, parent, s.tracestate, name_field(s.name), s.kind, s.start, s.end or 0),
           s.fixed, attributes(b"\x4a", s.attributes)]
    for when, event, attrs in s.events or ():
        out.append(_ld(b"\x5a", b"\x09" + _pack_fixed64(when & _MASK64) + _ld(b"\x12", event.encode("utf-8", "replace"))
                       + attributes(b"\x1a", attrs)))
    out.append(tail(s.status, s.description, bool(parent and s.remote)))
    return b"".join(out)


def unperturbed(trace_id: int, span_id: int, parent: int, remote: bool, tracestate: str | None, name: bytes,
                start: int, end: int, shared: bytes, own: bytes, up_id: int, up_name: bytes, up_shared: bytes,
                up_start: int, up_end: int) -> tuple[bytes, bytes]:
    """A passed-through request's two spans (`framed`): the request's (a server span: `shared` its attributes
    that other requests share, `own` its own ones, encoded) and its upstream call's (a client span under it,
    `up_shared` all its attributes), written in one go (the hot path of tracing: `head`, `tail` and `_ld` inline)."""
    hi, lo = trace_id >> 64, trace_id & _MASK64
    state = _ld(b"\x1a", tracestate.encode()) if tracestate else b""
    body = b"".join((_IDS(0x0A, 0x10, hi, lo, 0x12, 0x08, span_id), state,
                     _PARENT(0x22, 0x08, parent) if parent else b"", name, b"\x30\x02",
                     _TIMES(0x39, start & _MASK64, 0x41, end & _MASK64), shared, own,
                     _UNSET_REMOTE if parent and remote else _UNSET_LOCAL))
    n = len(body)  # a span's length: two bytes of varint, as a rule
    server = b"\x12" + (bytes((n & 0x7F | 0x80, n >> 7)) if 0x80 <= n < 0x4000 else _varint(n)) + body
    body = b"".join((_IDS(0x0A, 0x10, hi, lo, 0x12, 0x08, up_id), state, _PARENT(0x22, 0x08, span_id), up_name,
                     b"\x30\x03", _TIMES(0x39, up_start & _MASK64, 0x41, up_end & _MASK64), up_shared,
                     _UNSET_LOCAL))
    n = len(body)
    return server, b"\x12" + (bytes((n & 0x7F | 0x80, n >> 7)) if 0x80 <= n < 0x4000 else _varint(n)) + body


class UnperturbedLayout:
    """`unperturbed` for the spans of requests that share a shape (name and attributes of both spans), the lengths
    of their request and response ids and of their token counts' varints, and whether their parent is remote,
    local or absent (no trace state): both spans' bytes are a fixed layout of constant parts and per-request
    values, written by two `struct` packs (the constant parts passed along, not copied; the span lengths are known
    in advance). `spans` writes what `unperturbed` would with `own` the request's id, the response's id, the token
    counts and the two durations, in that order (tests/server/test_tracing.py compares them)."""

    __slots__ = ("spans", "parts")

    def __init__(self, name: bytes, shared: bytes, prefixes: tuple[bytes, bytes, bytes, bytes, bytes, bytes],
                 lengths: tuple[int, int, int, int], parent: bool, remote: bool, up_name: bytes,
                 up_shared: bytes) -> None:
        """`prefixes`: the request id's, the response id's, the two token counts' (empty: no such value) and the
        two durations' fields but their values; `lengths`: the four values' lengths in bytes (0 where none)."""
        rid_prefix, resp_prefix, in_prefix, out_prefix, upstream_ms_prefix, overhead_ms_prefix = prefixes
        rid_n, resp_n, in_n, out_n = lengths
        par, tail = b"\x22\x08" if parent else b"", _UNSET_REMOTE if remote else _UNSET_LOCAL
        constant = (len(par), len(name), len(shared), len(rid_prefix), len(resp_prefix), len(in_prefix),
                    len(out_prefix), len(upstream_ms_prefix), len(overhead_ms_prefix), len(tail))
        # the server span's body: its ids 28 bytes, parent 8, kind and start tags 3, times 17, durations 8 each
        n = 28 + (8 if parent else 0) + 3 + 17 + rid_n + resp_n + in_n + out_n + 16 + sum(constant)
        head = b"\x12" + _varint(n) + b"\x0a\x10"
        server = struct.Struct(
            f"<{len(head)}s16s2s8s{len(par)}s{8 if parent else 0}s{len(name)}s3sQBQ{len(shared)}s{len(rid_prefix)}s"
            f"{rid_n}s{len(resp_prefix)}s{resp_n}s{len(in_prefix)}s{in_n}s{len(out_prefix)}s{out_n}s"
            f"{len(upstream_ms_prefix)}sd{len(overhead_ms_prefix)}sd{len(tail)}s")
        m = 28 + 10 + len(up_name) + 3 + 17 + len(up_shared) + len(_UNSET_LOCAL)
        up_head = b"\x12" + _varint(m) + b"\x0a\x10"
        client = struct.Struct(f"<{len(up_head)}s16s2s8s2s8s{len(up_name)}s3sQBQ{len(up_shared)}s{len(_UNSET_LOCAL)}s")
        server_pack, client_pack = server.pack, client.pack

        def spans(trace_id: bytes, span_id: bytes, parent: bytes, start: int, end: int, request_id: bytes,
                  response_id: bytes, tokens_in: bytes, tokens_out: bytes, upstream_ms: float, overhead_ms: float,
                  up_id: bytes, up_start: int, up_end: int) -> tuple[bytes, bytes]:
            return (server_pack(head, trace_id, b"\x12\x08", span_id, par, parent, name, b"\x30\x02\x39",
                                start & _MASK64, 0x41, end & _MASK64, shared, rid_prefix, request_id, resp_prefix,
                                response_id, in_prefix, tokens_in, out_prefix, tokens_out, upstream_ms_prefix,
                                upstream_ms, overhead_ms_prefix, overhead_ms, tail),
                    client_pack(up_head, trace_id, b"\x12\x08", up_id, b"\x22\x08", span_id, up_name,
                                b"\x30\x03\x39", up_start & _MASK64, 0x41, up_end & _MASK64, up_shared,
                                _UNSET_LOCAL))

        #: `spans(trace_id, span_id, parent, start, end, request_id, response_id, tokens_in, tokens_out,
        #: upstream_ms, overhead_ms, up_id, up_start, up_end)`: the request's span and its upstream call's
        #: (`framed`), as `unperturbed` writes them; the ids as their bytes (the parent's empty: none), the token
        #: counts as their varints (`uvarint`), each of the length the layout was made for (a `struct` field pads
        #: or cuts what is not)
        self.spans = spans
        self.parts = (head, par, name, shared, rid_prefix, resp_prefix, in_prefix, out_prefix, upstream_ms_prefix,
                      overhead_ms_prefix, tail, up_head, up_name, up_shared)


def framed_parts(*parts: bytes) -> bytes:
    """A Span message written from its parts (`head`, encoded attributes, `tail`) as a ScopeSpans.spans field."""
    message = b"".join(parts)
    return _ld(b"\x12", message)


def int_attribute(key: str, value: int) -> bytes:
    """A span attribute of an int, encoded (a small one from a cache)."""
    encoded = _INTS.get((key, value))
    if encoded is None:
        encoded = _framed(_SPAN_TAG, key, value)
        if -1024 <= value <= 1 << 20:
            _kept(_INTS, (key, value), encoded)
    return encoded


def float_attribute(key: str, value: float) -> bytes:
    """A span attribute of a double, encoded (its field's first bytes from a cache per key)."""
    prefix = _FLOAT_PREFIX.get(key)
    if prefix is None:
        prefix = _framed(_SPAN_TAG, key, 0.0)[:-8]
        if len(_FLOAT_PREFIX) < _CACHE_MAX:
            _FLOAT_PREFIX[key] = prefix
    return prefix + _pack_double(value)


def framed(s: Any) -> bytes:
    """One span as a ScopeSpans.spans field (what `request` joins), encoded when the span ends."""
    return _ld(b"\x12", span(s))


def request_parts(framed_spans: Sequence[bytes], resource_bytes: bytes, scope_bytes: bytes) -> tuple[list[bytes], int]:
    """The ExportTraceServiceRequest of spans already encoded (`framed`) of one resource and scope (both encoded
    once: `resource`, `scope`), as its parts in order (the spans themselves, not copied) and its length."""
    resource_field, scope_field = _ld(b"\x0a", resource_bytes), _ld(b"\x0a", scope_bytes)
    scope_spans = len(scope_field) + sum(map(len, framed_spans))
    scope_head = b"\x12" + _varint(scope_spans)
    resource_spans = len(resource_field) + len(scope_head) + scope_spans
    prefix = b"\x0a" + _varint(resource_spans) + resource_field + scope_head + scope_field
    return [prefix, *framed_spans], len(prefix) + scope_spans - len(scope_field)


def request(framed_spans: Sequence[bytes], resource_bytes: bytes, scope_bytes: bytes) -> bytes:
    """`request_parts` joined."""
    return b"".join(request_parts(framed_spans, resource_bytes, scope_bytes)[0])


def encode(spans: Sequence[Any], resource_bytes: bytes, scope_bytes: bytes) -> bytes:
    """The ExportTraceServiceRequest of finished span records (`request` of each one `framed`)."""
    return request([framed(s) for s in spans], resource_bytes, scope_bytes)
