"""Proxy overhead, side by side in one run: direct to the fake upstream vs through toolquake.

    python -m tests.bench.proxy_overhead [--seconds 5] [--rounds 3] [--out bench-results]

Non-stream ~1 KB chat-completions requests at concurrency 1 and 64, measured with `wrk --latency`
(C, HDR histogram: real percentiles) when it is installed (Debian package `wrk`), else with the
asyncio client below (same percentiles, more CPU). Rounds alternate direct / proxy and the medians
are reported, because the load tool, the proxy and the upstream share two cores. Streams: time to
first byte and inter-chunk gaps, sequential, with httpx. Prints a Markdown table and writes JSON +
Markdown to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import start_fake_upstream, start_proxy

TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "Looks something up in a catalogue of things." * 2,
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to find"},
                                                    "limit": {"type": "integer"}}, "required": ["query"]}}}
    for i in range(3)]
BODY = {"model": "fake-model", "messages": [
    {"role": "system", "content": "You are a helpful assistant that uses tools."},
    {"role": "user", "content": "Find me the three nearest coffee shops open now, please."}], "tools": TOOLS}
PAYLOAD = json.dumps(BODY).encode()


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(url: str, conns: int, seconds: float) -> dict:
    script = Path(tempfile.mkstemp(suffix=".lua")[1])
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = [[{PAYLOAD.decode()}]]\n")
    out = subprocess.run(["wrk", "-t", "1", "-c", str(conns), "-d", f"{max(1, round(seconds))}s", "--latency", "-s", str(script),
                          f"{url}/v1/chat/completions"], capture_output=True, text=True, check=True).stdout
    pct = {p: _ms(v) for p, v in re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M)}
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p50_ms": pct["50"], "p99_ms": pct["99"], "non2xx": int(errors.group(1)) if errors else 0,
            "socket_errors": socket_errors.group(1) if socket_errors else ""}


def run_asyncio(url: str, conns: int, seconds: float) -> dict:
    async def main() -> dict:
        lat: list[float] = []
        bad = 0
        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            end = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal bad
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    r = await client.post(f"{url}/v1/chat/completions", content=PAYLOAD,
                                          headers={"content-type": "application/json"})
                    lat.append((time.perf_counter() - t) * 1000)
                    bad += r.status_code != 200

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conns)))
            elapsed = time.perf_counter() - t0
        q = statistics.quantiles(lat, n=100)
        return {"rps": len(lat) / elapsed, "p50_ms": q[49], "p99_ms": q[98], "non2xx": bad, "socket_errors": ""}

    return asyncio.run(main())


def stream_timings(url: str, n: int, chunk_delay_ms: int) -> dict:
    ttfb, gaps = [], []
    headers = {"content-type": "application/json", "x-fake-fault": f"chunk-delay:{chunk_delay_ms}"}
    payload = json.dumps({**BODY, "stream": True}).encode()
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            last = None
            with client.stream("POST", f"{url}/v1/chat/completions", content=payload, headers=headers) as r:
                for _chunk in r.iter_raw():
                    now = time.perf_counter()
                    if last is None:
                        ttfb.append((now - t0) * 1000)
                    else:
                        gaps.append((now - last) * 1000)
                    last = now
    q = statistics.quantiles(ttfb, n=100)
    return {"ttfb_p50_ms": q[49], "ttfb_p99_ms": q[98], "gap_median_ms": statistics.median(gaps) if gaps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each load round (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating direct/proxy rounds (default 3)")
    ap.add_argument("--concurrency", default="1,64", help="comma-separated connection counts (default 1,64)")
    ap.add_argument("--streams", type=int, default=100, help="sequential streams per side (default 100)")
    ap.add_argument("--tool", choices=["auto", "wrk", "asyncio"], default="auto")
    ap.add_argument("--out", default="bench-results", help="directory for JSON + Markdown results")
    args = ap.parse_args()
    tool = args.tool if args.tool != "auto" else ("wrk" if shutil.which("wrk") else "asyncio")
    load = run_wrk if tool == "wrk" else run_asyncio

    fake = start_fake_upstream()
    proxy = start_proxy(fake.url, "[scoring]\nenabled = false\n")
    results: dict = {"tool": tool, "machine": f"{platform.machine()} {os.cpu_count()} cores", "load": {}, "streams": {}}
    try:
        for url in (fake.url, proxy.url):  # warm both
            run_asyncio(url, 4, 1.0)
        for conns in [int(c) for c in args.concurrency.split(",")]:
            rounds: dict[str, list[dict]] = {"direct": [], "proxy": []}
            for _ in range(args.rounds):
                rounds["direct"].append(load(fake.url, conns, args.seconds))
                rounds["proxy"].append(load(proxy.url, conns, args.seconds))
            med = {side: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "p99_ms")}
                   for side, rs in rounds.items()}
            results["load"][conns] = {
                "rounds": rounds, "median": med,
                "throughput_ratio": med["proxy"]["rps"] / med["direct"]["rps"],
                "added_p50_ms": med["proxy"]["p50_ms"] - med["direct"]["p50_ms"],
                "added_p99_ms": med["proxy"]["p99_ms"] - med["direct"]["p99_ms"],
                "errors": sum(r["non2xx"] for rs in rounds.values() for r in rs),
            }
        direct_s = stream_timings(fake.url, args.streams, 5)
        proxy_s = stream_timings(proxy.url, args.streams, 5)
        results["streams"] = {"direct": direct_s, "proxy": proxy_s,
                              "added_ttfb_p50_ms": proxy_s["ttfb_p50_ms"] - direct_s["ttfb_p50_ms"],
                              "added_ttfb_p99_ms": proxy_s["ttfb_p99_ms"] - direct_s["ttfb_p99_ms"],
                              "gap_median_ms": {"direct": direct_s["gap_median_ms"], "proxy": proxy_s["gap_median_ms"]}}
    finally:
        proxy.stop()
        fake.stop()

    lines = [f"# Proxy overhead (load tool: {tool}; {results['machine']}; medians of {args.rounds} alternating "
             f"rounds of {args.seconds:g} s)", "",
             "| concurrency | direct req/s | proxy req/s | proxy/direct | added p50 | added p99 | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for conns, r in results["load"].items():
        d, p = r["median"]["direct"], r["median"]["proxy"]
        lines.append(f"| {conns} | {d['rps']:.0f} | {p['rps']:.0f} | {r['throughput_ratio']:.2f} | "
                     f"{r['added_p50_ms']:+.3f} ms | {r['added_p99_ms']:+.3f} ms | {r['errors']} |")
    s = results["streams"]
    lines += ["", f"Streams ({args.streams} sequential, 5 ms between upstream chunks): added TTFB p50 "
              f"{s['added_ttfb_p50_ms']:+.3f} ms, p99 {s['added_ttfb_p99_ms']:+.3f} ms; median inter-chunk gap "
              f"direct {s['gap_median_ms']['direct']:.2f} ms vs proxy {s['gap_median_ms']['proxy']:.2f} ms."]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "proxy_overhead.json").write_text(json.dumps(results, indent=2))
    (out / "proxy_overhead.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
