"""An OTLP/HTTP collector that accepts and drops: `python -m tests.bench.otlp_sink --port N`. The tracing
benchmark exports to it so that exporting succeeds at any rate without a collector's own CPU on the cores;
`GET /_sink` says how many exports and bytes it took. With `--decode` (the tests) it also decodes each export
with the official protobuf classes and keeps its spans (trace id, span id, parent id, name, kind, sampled
flags), listed under `spans` (the last 10,000)."""

from __future__ import annotations

import argparse
import json

import uvicorn

TAKEN: dict = {"exports": 0, "bytes": 0}
DECODE = False


def _value(value):
    """An AnyValue as Python (an array as a list)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _decode(body: bytes) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = TAKEN.setdefault("spans", [])
    for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
        for ss in rs.scope_spans:
            spans.extend({"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                          "parent_id": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                          "attributes": {a.key: a.value.WhichOneof("value") for a in s.attributes},
                          "values": {a.key: _value(a.value) for a in s.attributes}}
                         for s in ss.spans)
    del spans[:-10000]


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more, chunks = True, []
    while more:
        message = await receive()
        TAKEN["bytes"] += len(message.get("body", b""))
        if DECODE:
            chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["method"] == "POST" and scope["path"] == "/v1/traces":
        TAKEN["exports"] += 1
        if DECODE:
            _decode(b"".join(chunks))
        body, ctype = b"", b"application/x-protobuf"  # an empty ExportTraceServiceResponse
    else:
        body, ctype = json.dumps(TAKEN).encode(), b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--decode", action="store_true", help="decode the exports and keep their spans")
    args = ap.parse_args()
    DECODE = args.decode
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
