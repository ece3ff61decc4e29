"""Tracing's cost, A/B in one run: the proxy with tracing off, with tracing on (every request sampled,
`OTEL_TRACES_SAMPLER=always_on`, exported over OTLP/HTTP in batches to a sink that accepts and drops,
tests/bench/otlp_sink.py), and with `--ref NAME=GITREF` the code of another commit (the code before tracing),
in alternating rounds, passthrough and streaming, on the lean path (profile `off`, scoring off).

    python -m tests.bench.tracing_overhead [--ref before=GITREF] [--ref-on NAME=GITREF] [--seconds 3] [--rounds 5]
        [--concurrency 1,64] [--unsampled] [--no-stream] [--floor-only] [--fixed-usage]

The backend's answers carry token counts that differ from answer to answer, as a real backend's do
(tests/fake_upstream.py `--usage-varies`); `--fixed-usage`: all the same, as the passes before the sixth measured.

Prints, per workload and concurrency, the medians of req/s, p50 and the proxy's CPU per request (its own
/proc counters, the exporter's thread included), each arm's ratio to the first, and the CPU that tracing on
adds per request over tracing off (issue #33's goal: at most 0.05 ms on passthrough), for each other arm with
tracing on too (`--unsampled`, `--ref-on`), how many exports the sink took (spans did leave the proxy), the
spans each arm did not export, and the in-process floor (tracing's calls for one passthrough request).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import httpx

from tests.bench.ab import alternating_rounds, install_ref, start_ref_proxy
from tests.bench.proxy_overhead import BODY, run_asyncio, run_wrk
from tests.support import start_fake_upstream, start_process, start_proxy
from tests.support.ports import held_port

OFF = "[server]\n[scoring]\nenabled = false\n"


def on(sink: str, sampler: str = "always_on") -> str:
    return (f'{OFF}[tracing]\nenabled = true\nOTEL_EXPORTER_OTLP_ENDPOINT = "{sink}"\n'
            f'OTEL_TRACES_SAMPLER = "{sampler}"\n')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", action="append", default=[], help="NAME=GITREF: an arm serving that commit's code "
                    "with tracing off")
    ap.add_argument("--ref-on", action="append", default=[], metavar="NAME=GITREF",
                    help="an arm serving that commit's code with tracing on (always_on, to the same sink)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--unsampled", action="store_true",
                    help="also an arm with tracing on and every request left out by the sampler (always_off)")
    ap.add_argument("--no-stream", action="store_true", help="passthrough only")
    ap.add_argument("--floor-only", action="store_true", help="only the in-process floor (no proxies)")
    ap.add_argument("--fixed-usage", action="store_true",
                    help="the backend's answers all with the same token counts (the passes before the sixth "
                         "measured so); by default they differ from answer to answer, as a real backend's do")
    args = ap.parse_args()
    if args.floor_only:
        print_floor()
        return
    load = run_wrk if shutil.which("wrk") else run_asyncio
    fake = start_fake_upstream(*(() if args.fixed_usage else ("--usage-varies",)))
    with held_port("127.0.0.1") as port:  # the sink cannot say which port it got: held until it binds it
        sink = start_process(["-m", "tests.bench.otlp_sink", "--port", str(port)], port, "/_sink")
    tmp = tempfile.TemporaryDirectory(prefix="toolquake-trace-ab-")
    procs = {}
    try:
        procs["off"] = start_proxy(fake.url, OFF)
        procs["on"] = start_proxy(fake.url, on(sink.url))
        if args.unsampled:
            procs["unsampled"] = start_proxy(fake.url, on(sink.url, "always_off"))
        for spec, config in [(r, OFF) for r in args.ref] + [(r, on(sink.url)) for r in args.ref_on]:
            name, _, ref = spec.partition("=")
            procs[name] = start_ref_proxy(install_ref(ref, Path(tmp.name) / name), fake.url, config)
        for proc in procs.values():
            run_asyncio(proc.url, 4, 1.0)
        workloads = {"passthrough": json.dumps(BODY).encode()}
        if not args.no_stream:
            workloads["streaming"] = json.dumps({**BODY, "stream": True}).encode()
        for work, payload in workloads.items():
            for conns in [int(c) for c in args.concurrency.split(",")]:
                compare(procs, work, payload, conns, args.rounds, args.seconds, load,
                        traced={"on", *(r.partition("=")[0] for r in args.ref_on)})
        print(f"\nsink: {httpx.get(sink.url + '/_sink').json()}")
        for name, proc in procs.items():
            failed = [line for line in httpx.get(proc.url + "/metrics").text.splitlines()
                      if line.startswith("toolquake_tracing_failures_total")]
            if failed:
                print(f"{name}: {'; '.join(failed)} (spans not exported: queue full or export failed)")
        print_floor()
    finally:
        for proc in procs.values():
            proc.stop()
        sink.stop()
        fake.stop()
        tmp.cleanup()


#: a passthrough request span's attributes as the proxy sets them (request id and response id differ per request):
#: what the OpenTelemetry SDK reference builds
FLOOR_ATTRIBUTES = {
    "server.address": "127.0.0.1", "server.port": 8000, "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "openai", "gen_ai.request.stream": False, "toolquake.request_id": "",
    "toolquake.route": "chat_completions", "toolquake.profile": "off", "toolquake.mode": "off",
    "gen_ai.request.model": "fake-model", "gen_ai.response.model": "fake-model", "gen_ai.response.id": "",
    "gen_ai.response.finish_reasons": ["tool_calls"], "gen_ai.usage.input_tokens": 57,
    "gen_ai.usage.output_tokens": 12, "toolquake.answer.tool_calls": ["get_weather"],
    "http.response.status_code": 200, "toolquake.upstream_ms": 0.412, "toolquake.overhead_ms": 0.153,
    "toolquake.conformance.checked": True, "toolquake.conformance.rules": [],
}
FLOOR_ANSWER = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake-model",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
    "usage": {"prompt_tokens": 57, "completion_tokens": 12, "total_tokens": 69}}).encode()


def floor_answers(n: int, fixed: bool = False) -> list[bytes]:
    """`n` answers as the benchmark's backend gives them: FLOOR_ANSWER, its token counts differing from answer to
    answer as tests/fake_upstream.py's `--usage-varies` makes them (as a real backend's do), or not (`fixed`)."""
    if fixed:
        return [FLOOR_ANSWER] * n
    answer = json.loads(FLOOR_ANSWER)
    out = []
    for i in range(n):
        prompt, completion = 50 + i * 7919 % 8000, 1 + i * 104729 % 300
        answer["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
        out.append(json.dumps(answer).encode())
    return out


def floor_request() -> tuple[Callable[[str, bytes], None], Any]:
    """What tracing does for one passthrough request, as the proxy calls it (begin, sending, the answer's bytes
    read in the proxy's check that they are a JSON object, finish, the conformance check, release: both spans
    encoded into the exporter's queue, which nobody sends), as a function of the request id and its answer
    (`floor_answers`); and that queue (clear it now and then). The check is the proxy's own with tracing off too
    (`floor_base`: subtract it). Run on code from before the check read the answer (`--ref-on`): the check, then
    the answer read after the client had it."""
    import time

    from toolquake.proxy.server.apis import CHAT
    from toolquake.proxy.server.config import ProfileSpec, TracingConfig
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.profiles import build_profile
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.tracing.tracer import RequestTrace, Tracing

    tracing = Tracing(TracingConfig(enabled=True, otel={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                                        "OTEL_TRACES_SAMPLER": "always_on",
                                                        "OTEL_BSP_MAX_QUEUE_SIZE": "100000"}),
                      Metrics(), "http://127.0.0.1:8000/v1")
    tracing.started = True
    profile = build_profile("off", ProfileSpec(mode="off"))
    headers = [("host", "127.0.0.1:8000"), ("content-type", "application/json"), ("authorization", "Bearer k"),
               ("content-length", "512"), ("user-agent", "wrk")]

    check_object = floor_base()
    reads_in_check = hasattr(RequestTrace, "checked")

    def one(request_id: str, answer: bytes) -> None:
        t0 = time.perf_counter()
        asked = Asked(request_id, t0, CHAT, profile, False, "fake-model")
        served = Served(t_upstream=t0)
        served.trace = trace = tracing.begin(headers, t0)
        trace.hold()
        trace.sending(asked, served, headers)
        served.status, served.upstream_s, served.total_s = 200, 0.000412, 0.000565
        if not reads_in_check or trace.checked(asked, answer) is None:
            check_object(answer)
        trace.finish(asked, served)
        if not reads_in_check:
            trace.relayed(asked, answer)
        trace.conformance([])
        trace.release()

    return one, tracing.exporter.queue


def floor_base() -> Callable[[bytes], Any]:
    """The proxy's check that a whole answer is a JSON object, as it makes it with tracing off (what
    `floor_request` makes too, and a count of tracing's cost leaves out)."""
    from toolquake.proxy.server.answer import plain

    return plain._check_object


def floor(n: int = 3000) -> dict[str, float]:
    """In this process, µs of CPU per request for what tracing does for a passthrough request (`floor_request`);
    with the OpenTelemetry SDK installed, the SDK's two spans of the same request and its encoding of them (the
    reference)."""
    import random
    import time

    one, queue = floor_request()
    check_object = floor_base()
    ids = [f"{random.getrandbits(64):016x}" for _ in range(n)]
    answers = floor_answers(n)

    for rid, answer in zip(ids[:500], answers):  # the caches warm, as in a running proxy
        one(rid, answer)
    queue.clear()
    best = base = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for rid, answer in zip(ids, answers):
            one(rid, answer)
        best = min(best, (time.process_time() - t0) / n * 1e6)
        queue.clear()
        t0 = time.process_time()
        for answer in answers:
            check_object(answer)
        base = min(base, (time.process_time() - t0) / n * 1e6)
    out = {"path_us": best - base}
    try:
        out.update(_sdk_floor(ids))
    except ImportError:
        pass
    return out


def _sdk_floor(ids: list[str]) -> dict[str, float]:
    """The OpenTelemetry SDK's two spans of a request and its own OTLP encoding of them (the reference)."""
    import time

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, set_span_in_context

    kept: list = []

    class Keep(SpanExporter):
        def export(self, spans):
            if len(kept) < 1024:
                kept.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("toolquake")
    t0 = time.process_time()
    for rid in ids:
        span = tracer.start_span("chat fake", kind=SpanKind.SERVER, attributes={
            **FLOOR_ATTRIBUTES, "toolquake.request_id": rid, "gen_ai.response.id": "chatcmpl-" + rid,
            "toolquake.seed": rid})
        tracer.start_span("POST /v1/chat/completions", context=set_span_in_context(span), kind=SpanKind.CLIENT,
                          attributes={"http.request.method": "POST", "url.path": "/v1/chat/completions",
                                      "server.port": 1, "http.response.status_code": 200}).end()
        span.end()
    spans_us = (time.process_time() - t0) / len(ids) * 1e6
    t0 = time.process_time()
    encode_spans(kept).SerializeToString()
    return {"sdk_spans_us": spans_us, "encode_sdk_us": (time.process_time() - t0) / len(kept) * 2e6}


def print_floor() -> None:
    f = floor()
    print(f"floor, per request, in this process (best of 3 × 3000): toolquake's tracing of a passthrough request, "
          f"both spans encoded, {f['path_us']:.1f} µs", end="")
    if "sdk_spans_us" in f:
        print(f"; the OpenTelemetry SDK's two spans {f['sdk_spans_us']:.1f} µs, its encoding "
              f"{f['encode_sdk_us']:.1f} µs", end="")
    print()


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values` (order statistics: the k-th smallest
    and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2, so it covers the median with
    probability >= `level`), or None when there are too few values for that level (fewer than 6 for 95 %)."""
    n = len(values)
    tail, k = 0.0, 0
    while True:  # P(X <= k) for X ~ Binomial(n, 1/2), while it stays within the tail
        tail += math.comb(n, k) / 2 ** n
        if tail > (1 - level) / 2:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def compare(procs: dict, work: str, payload: bytes, conns: int, rounds_n: int, seconds: float, load,
            traced: set[str]) -> None:
    """The arms' rounds side by side, and what each adds over `off`, against the goal of its kind: ≤ 50 µs for
    an arm with every request traced (`traced`), nothing measurable for one with tracing off or nothing sampled."""
    rounds, med = alternating_rounds(procs, payload, conns, rounds_n, seconds, load)
    # the added CPU, round by round (each traced round against the `off` round next to it), then its median and
    # the median's 95 % interval
    paired = {n: [a["cpu_ms_per_request"] - b["cpu_ms_per_request"] for a, b in zip(rounds[n], rounds["off"])]
              for n in rounds if n != "off"}
    added = {n: statistics.median(d) for n, d in paired.items()}
    print(f"\n{work}, {conns} connections, medians of {rounds_n} alternating rounds of {seconds:g} s")
    print("| arm | req/s | p50 | CPU per request | vs off (req/s, CPU) | non-2xx |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, m in med.items():
        bad = sum(r["non2xx"] for r in rounds[n])
        rps, cpu = m["rps"] / med["off"]["rps"], m["cpu_ms_per_request"] / med["off"]["cpu_ms_per_request"]
        print(f"| {n} | {m['rps']:.0f} | {m['p50_ms']:.3f} ms | {m['cpu_ms_per_request']:.3f} ms | "
              f"{rps:.2f}×, {cpu:.2f}× | {bad} |")
    for n, a in added.items():
        interval = median_interval(paired[n])
        said = (f", 95 % interval [{interval[0] * 1000:+.1f}, {interval[1] * 1000:+.1f}]" if interval is not None
                else f" (no 95 % interval from {len(paired[n])} rounds: 6 or more give one)")
        goal = ("goal for tracing on, passthrough: ≤ 50 µs" if n in traced else
                "goal with tracing off or nothing sampled: nothing measurable")
        print(f"{n} − off: {a * 1000:+.1f} µs of proxy CPU per request (median of the paired rounds{said}; {goal})")


if __name__ == "__main__":
    main()
