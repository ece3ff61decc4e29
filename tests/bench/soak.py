"""Soak: sustained mixed traffic through the proxy with faults injected at random.

    python -m tests.bench.soak [--minutes 10] [--concurrency 200] [--fault-rate 0.1] [--out bench-results]

Each of `concurrency` asyncio workers loops until time is up: stream or not (50/50), through the
`off` or `shuffled` profile, with one fault injected in `fault-rate` of requests (upstream 5xx,
invalid JSON, a cut stream, a slow trickle, a delay four times the proxy's read timeout). Every answer is
checked against the documented outcome for its fault; anything else is an unexpected error. Every
10 s the proxy's RSS and open file descriptors are sampled (from /proc). Writes the series and the
totals as JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx

from tests.support import start_fake_upstream, start_proxy

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}} for i in range(4)]
# fault -> predicate on (status, body) for the documented outcome
FAULTS = {
    "": lambda stream, s, b: s == 200 and (b.endswith(b"data: [DONE]\n\n") if stream else b'"choices"' in b),
    "status:503": lambda stream, s, b: s == 503 and b'"injected"' in b,
    "invalid-json": lambda stream, s, b: s == 502,
    "cut-stream": lambda stream, s, b: (s == 200 and b"[DONE]" not in b) if stream else s == 502,
    "slow-bytes:1": lambda stream, s, b: s == 200,
    "delay:8000": lambda stream, s, b: s == 504 and b"upstream_timeout" in b,
}


def proc_sample(pid: int) -> dict:
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return {"rss_mb": round(rss, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def soak(url: str, pid: int, seconds: float, concurrency: int, fault_rate: float) -> dict:
    counts = {"requests": 0, "unexpected": 0, "by_fault": {}}
    unexpected: list[dict] = []
    series: list[dict] = []
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                stream = rng.random() < 0.5
                fault = rng.choice(list(FAULTS)[1:]) if rng.random() < fault_rate else ""
                profile = rng.choice(["off", "shuffled"])
                body = {"model": "fake", "stream": stream, "tools": TOOLS,
                        "messages": [{"role": "user", "content": f"request {rng.random()}"}]}
                headers = {"x-fake-fault": fault} if fault else {}
                try:
                    async with client.stream("POST", f"{url}/p/{profile}/v1/chat/completions", json=body,
                                             headers=headers) as r:
                        data = b"".join([c async for c in r.aiter_raw()])
                    ok = FAULTS[fault](stream, r.status_code, data)
                    status = r.status_code
                except httpx.HTTPError as exc:
                    ok, status, data = False, type(exc).__name__, b""
                counts["requests"] += 1
                counts["by_fault"][fault or "none"] = counts["by_fault"].get(fault or "none", 0) + 1
                if not ok:
                    counts["unexpected"] += 1
                    if len(unexpected) < 20:
                        unexpected.append(
                            {
                                "fault": fault,
                                "stream": stream,
                                "status": status,
                                "body": data[:200].decode(errors="replace"),
                            }
                        )

        async def sampler() -> None:
            t0 = time.monotonic()
            while time.monotonic() < end:
                series.append({"t": round(time.monotonic() - t0), **proc_sample(pid), "requests": counts["requests"]})
                await asyncio.sleep(10)

        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    series.append({"t": round(seconds), **proc_sample(pid), "requests": counts["requests"]})
    return {**counts, "unexpected_examples": unexpected, "series": series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    fake = start_fake_upstream()
    proxy = start_proxy(
        fake.url,
        "[server]\nread_timeout = 2.0\n[scoring]\nenabled = false\n"
        '[profiles.shuffled]\nperturbers = [{ name = "tool_order" }]\n',
    )
    try:
        result = asyncio.run(soak(proxy.url, proxy.popen.pid, args.minutes * 60, args.concurrency, args.fault_rate))
        alive = proxy.popen.poll() is None
    finally:
        proxy.stop()
        fake.stop()
    s = result["series"]
    first, last = s[1] if len(s) > 2 else s[0], s[-1]
    lines = [
        f"# Soak: {args.minutes:g} min, concurrency {args.concurrency}, fault rate {args.fault_rate:g}",
        "",
        f"requests {result['requests']}, unexpected {result['unexpected']}, proxy alive at the end: {alive}",
        f"RSS {first['rss_mb']} MB → {last['rss_mb']} MB; open fds {first['fds']} → {last['fds']} "
        "(first sample after warm-up vs last)",
        "",
        "| t (s) | RSS MB | fds | requests |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {x['t']} | {x['rss_mb']} | {x['fds']} | {x['requests']} |" for x in s]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({**result, "alive": alive}, indent=2))
    (out / "soak.md").write_text(text + "\n")
    raise SystemExit(0 if result["unexpected"] == 0 and alive else 1)


if __name__ == "__main__":
    main()
