"""Cost of the lengthening perturbers per request, by budget and token counter.

    python -m tests.bench.lengthening [--runs 20] [--out bench-results]

response_lengthening on a booking-style JSON tool response and conversation_lengthening (needs the
corpus; skipped without it) at 10K-80K tokens: median and p90 wall time of `apply` over `--runs`
seeds, in process. With the `estimate` counter the target is 30 ms per request at 80K tokens; the
`upstream` counter (the fake upstream's /tokenize over loopback, a separate process) shows what a
backend's tokenizer costs on top: its requests counted and the time. Prints a Markdown table with
the ratio to the 30 ms target, the CPU time of the calling thread beside the wall time (on a
shared machine the wall time includes waiting for a core), and writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tests.support import start_fake_upstream
from toolquake.perturbers import build
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.tokens import EstimateCounter, make_counter

TARGET_MS = 30.0
BUDGETS = (10_000, 20_000, 40_000, 80_000)


def booking_request() -> dict[str, Any]:
    results = [{"hotel_id": 100200 + i, "hotel_name": name, "url": f"https://www.booking.com/hotel/fr/{slug}.html",
                "address": {"street": f"{10 + i} Rue de Rivoli", "city": "Paris", "zip": "75001"},
                "price_breakdown": {"gross_price": 212.5 + 13 * i, "currency": "EUR", "taxes": 9.9},
                "review_score": 8.1 + i / 10, "review_count": 1200 + 17 * i, "is_free_cancellable": i % 2 == 0,
                "checkin": "2024-10-01", "checkout": "2024-10-04", "facilities": ["wifi", "bar", "lift"]}
               for i, (name, slug) in enumerate([("Hotel du Louvre", "du-louvre"), ("Le Meurice", "le-meurice"),
                                                 ("Hotel Regina", "regina-paris")])]
    return {"model": "m", "messages": [
        {"role": "user", "content": "Find hotels near the Louvre from October 1 to 4."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search_hotels", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"status": True, "data": {"result": results}})},
        {"role": "user", "content": "What is the review score of Le Meurice?"}]}


def time_apply(name: str, params: dict[str, Any], body: dict[str, Any], counter: Any, runs: int) -> dict[str, Any]:
    perturber = build(name, params)
    services = Services(token_counter=counter)
    times, cpu, reports = [], [], []
    warm = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=services)
    perturber.apply(ChatRequest(body), warm)  # first use builds shared services (the corpus filler pool)
    for seed in range(1, runs + 1):
        ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=services)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = perturber.apply(ChatRequest(body), ctx)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.thread_time() - c0) * 1000)
        reports.append(ctx.report)
    total = counter.count_request(out.body)
    times.sort()
    label = f"{name} ({params['setting']})" if "setting" in params else name
    return {"perturber": label, "counter": counter.source, "budget": params["budget_tokens"],
            "median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))],
            "cpu_median_ms": statistics.median(cpu),
            "counted_tokens": total, "error_pct": 100 * (total - params["budget_tokens"]) / params["budget_tokens"],
            "counts_per_request": statistics.mean(r.get("counts", 0) for r in reports)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the lengthening perturbers by budget and token counter.")
    parser.add_argument("--runs", type=int, default=20, help="requests (seeds) per row (default 20)")
    parser.add_argument("--out", default="bench-results", help="directory for lengthening.json/.md")
    args = parser.parse_args(argv)
    rows = []
    estimate = EstimateCounter()
    for budget in BUDGETS:
        rows.append(time_apply("response_lengthening", {"budget_tokens": budget, "position": 2}, booking_request(),
                               estimate, args.runs))
    try:
        from toolquake.bfcl.corpus import load_case

        case_body = {"model": "m", "messages": load_case("simple_python_0").turns[0]}
        for setting in ("unstructured", "structured"):
            rows.append(time_apply("conversation_lengthening", {"budget_tokens": 80_000, "setting": setting},
                                   case_body, estimate, args.runs))
    except (FileNotFoundError, LookupError, RuntimeError) as exc:
        print(f"conversation_lengthening skipped: {exc}")
    fake = start_fake_upstream()
    try:
        upstream = make_counter("upstream", f"{fake.url}/v1")
        for budget in (10_000, 80_000):
            rows.append(time_apply("response_lengthening", {"budget_tokens": budget, "position": 2},
                                   booking_request(), upstream, max(5, args.runs // 4)))
    finally:
        fake.stop()
    lines = ["| perturber | counter | budget | median ms | p90 ms | CPU ms (this thread) | median / 30 ms target | "
             "counted | error | counts/request |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['perturber']} | {r['counter']} | {r['budget']:,} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | "
            f"{r['cpu_median_ms']:.1f} | {r['median_ms'] / TARGET_MS:.2f} | {r['counted_tokens']:,} | "
            f"{r['error_pct']:+.1f} % | {r['counts_per_request']:.1f} |"
        )
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall times include waiting for a core)")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lengthening.json").write_text(json.dumps({"machine": platform.platform(), "rows": rows}, indent=2))
    (out / "lengthening.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
