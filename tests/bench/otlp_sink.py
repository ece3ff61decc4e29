"""An OTLP/HTTP collector that accepts and drops: `python -m tests.bench.otlp_sink --port N`. The tracing
benchmark exports to it so that exporting succeeds at any rate without a collector's own CPU on the cores;
`GET /_sink` says how many exports and bytes it took."""

from __future__ import annotations

import argparse
import json

import uvicorn

TAKEN = {"exports": 0, "bytes": 0}


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        TAKEN["bytes"] += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["method"] == "POST" and scope["path"] == "/v1/traces":
        TAKEN["exports"] += 1
        body, ctype = b"", b"application/x-protobuf"  # an empty ExportTraceServiceResponse
    else:
        body, ctype = json.dumps(TAKEN).encode(), b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
