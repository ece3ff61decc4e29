"""Time to first content byte through `format-python` vs `off`, on a paced stream, side by side in one run.

    python -m tests.bench.stream_ttfb [--rounds 15] [--delay-ms 150]

The fake upstream answers in text, 8 characters a frame, `--delay-ms` between frames (a model writing).
Rounds alternate between the two profiles; each measures, from the request, when the first `content`
delta reaches the client and when the stream ends. `format-python` takes the tools away and parses the
text answer back into calls; plain text must still reach the client as it is written (goal: first
content within 5 ms of `off`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from tests.support import start_fake_upstream, start_proxy

CONFIG = """
[profiles.format-python]
perturbers = [{ name = "format_rewrite", params = { return_format = "python", function_doc_format = "json" } }]
"""
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TEXT = "It is nine in the morning in Tokyo, and the trains are on time today."


def one(url: str, profile: str, delay_ms: int) -> tuple[float, float]:
    body = {"model": "fake-model", "stream": True, "tools": TOOLS, "messages": [{"role": "user", "content": "Tokyo?"}]}
    headers = {"x-fake-answer": json.dumps({"text": TEXT}), "x-fake-fault": f"chunk-delay:{delay_ms}"}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/p/{profile}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", "") \
                    and '"content":""' not in line.replace(" ", ""):
                first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--delay-ms", type=int, default=150)
    args = ap.parse_args()
    fake = start_fake_upstream()
    proxy = start_proxy(fake.url, CONFIG, None, "--no-scoring")
    try:
        one(proxy.url, "off", 1)  # warm up both paths
        one(proxy.url, "format-python", 1)
        results: dict[str, list[tuple[float, float]]] = {"off": [], "format-python": []}
        for _ in range(args.rounds):
            for profile in results:
                results[profile].append(one(proxy.url, profile, args.delay_ms))
    finally:
        proxy.stop()
        fake.stop()
    med = {p: (statistics.median(f for f, _ in rs) * 1000, statistics.median(t for _, t in rs) * 1000)
           for p, rs in results.items()}
    print(f"# Time to first content byte, paced stream ({args.delay_ms} ms between 8-character frames), "
          f"{args.rounds} alternating rounds, medians")
    print("| profile | first content ms | whole stream ms |\n|---|---:|---:|")
    for p, (first, total) in med.items():
        print(f"| {p} | {first:.1f} | {total:.1f} |")
    added = med["format-python"][0] - med["off"][0]
    print(f"\nformat-python adds {added:+.1f} ms to the first content byte (goal: within 5 ms); "
          f"ratio {med['format-python'][0] / med['off'][0]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
