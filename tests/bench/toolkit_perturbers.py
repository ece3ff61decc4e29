"""Toolkit perturbers: speed and fidelity, in one command.

    python -m tests.bench.toolkit_perturbers [--counter SPEC] [--upstream URL] [--cases N] [--out bench-results]

Needs the corpus and the embeddings extra; the pool is built (once, cached on disk) if missing.

1. Start-up, in a fresh process each time: seconds and resident memory to load the embedding model,
   then the tool pool from its disk cache.
2. catalog_padding on the seed 003 datasets (BFCL simple_python, live_simple, multiple; `--cases` per
   dataset, evenly spread) at 8K/16K/32K/64K/120K tokens and α ∈ {0.1, 0.3, 0.5, 0.7, 0.9}: mean tools
   per context length beside seed 003 Table 3, the largest |position − α|, the distance to the budget,
   and milliseconds per request (target: ≤ 20 ms at 120K with the pool precomputed).
3. toolkit_expansion (retrieval, k=3) on all 200 BFCL `multiple` cases: tools per case before and
   after (seed 001: 2.7 → 5.6), the largest cosine of an added tool to an original (embedded afresh),
   and milliseconds per request with the model and pool warm (target: ≤ 15 ms p50).

"Warm" means the model and the pool are loaded and each toolkit's signatures were seen once (a live
agent sends the same toolkit again and again); what remains per request is the user message's
embedding (expansion) or nothing but arithmetic and list building (padding with the estimate).
Times are wall-clock and CPU (`process_time`, all threads) per request: on a shared machine the CPU
figure is the one to compare; the load average is printed beside them.
Prints Markdown tables (ratios to the targets included) and writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support import ROOT

BUDGETS = (8192, 16384, 32768, 65536, 120000)
ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)
SEED_003_TOOLS = {8192: 49, 16384: 102, 32768: 207, 65536: 417, 120000: 741}
DATASETS = ("simple_python", "live_simple", "multiple")
PAD_TARGET_MS = 20.0
EXPAND_TARGET_MS = 15.0

STARTUP = """
import json, resource, time
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
t0 = time.perf_counter(); base = rss()
from toolquake.bfcl.embeddings import get_embedder
emb = get_embedder(); emb.embed(['warm up'])
t1 = time.perf_counter(); after_model = rss()
from toolquake.perturbers.helpers.toolkit.tool_pool import load_pool
pool = load_pool(emb)
t2 = time.perf_counter(); after_pool = rss()
print(json.dumps({'model_s': t1 - t0, 'pool_s': t2 - t1, 'rss_start_mb': base, 'rss_model_mb': after_model,
                  'rss_pool_mb': after_pool, 'pool_tools': len(pool), 'model_id': emb.model_id}))
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def startup() -> dict[str, Any]:
    from toolquake.perturbers.helpers.toolkit.tool_pool import load_pool

    load_pool()  # make sure the disk cache exists, so the fresh process measures a cold read of it
    out = subprocess.run([sys.executable, "-c", STARTUP], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def apply(perturber: Any, body: dict[str, Any], services: Any, seed: int
          ) -> tuple[dict[str, Any], dict[str, Any], float, float]:
    """(perturbed body, report, wall ms, CPU ms)."""
    from toolquake.perturbers.base import ChatRequest, PerturbContext

    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=services)
    t, c = time.perf_counter(), time.process_time()
    out = perturber.apply(ChatRequest(body), ctx)
    return out.body, ctx.report, (time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000


def warm_toolkits(services: Any, bodies: list[dict[str, Any]]) -> None:
    """Load model and pool and embed each toolkit's signatures once (they are then cached)."""
    from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool, get_shared_embedder

    pool, embedder = get_pool(services), get_shared_embedder(services)
    for body in bodies:
        pool.embed_tools(body["tools"], embedder)


def padding(counter_spec: str, upstream: str, per_dataset: int) -> dict[str, Any]:
    from toolquake.bfcl.corpus import case_request, load_category
    from toolquake.perturbers import build
    from toolquake.perturbers.base import Services
    from toolquake.perturbers.helpers.tokens import make_counter

    counter = make_counter(counter_spec, upstream)
    services = Services(token_counter=counter)
    bodies = []
    for name in DATASETS:
        cases = load_category(name)
        step = max(1, len(cases) // per_dataset)
        bodies += [case_request(c, model="default") for c in cases[::step][:per_dataset]]
    warm_toolkits(services, bodies)
    t = time.perf_counter()
    services.get("tool_pool").costs(counter)  # the pool's token costs for this counter (cached on disk)
    costs_s = time.perf_counter() - t
    rows = []
    for budget in BUDGETS:
        tools, pos_err, off, ms, cpu = [], 0.0, [], [], []
        for alpha in ALPHAS:
            perturber = build("catalog_padding", {"budget_tokens": budget, "position": alpha})
            for i, body in enumerate(bodies):
                out, report, wall_ms, cpu_ms = apply(perturber, body, services, i)
                ms.append(wall_ms)
                cpu.append(cpu_ms)
                tools.append(len(out["tools"]))
                n = report["tools_added"]
                if n:
                    pos_err = max(pos_err, abs(report["insert_index"] / n - alpha))
                off.append(report["tokens_after"] - budget)
        rows.append({"budget": budget, "mean_tools": statistics.mean(tools), "seed_003_tools": SEED_003_TOOLS[budget],
                     "max_position_error": pos_err, "max_abs_tokens_off_budget": max(abs(o) for o in off),
                     "p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95), "cpu_p50_ms": pct(cpu, 0.5),
                     "cpu_p95_ms": pct(cpu, 0.95), "requests": len(ms)})
    return {"token_counter": counter.source, "counter_key": counter.key, "pool_costs_s": costs_s,
            "cases": len(bodies), "rows": rows}


def expansion() -> dict[str, Any]:
    import numpy as np

    from toolquake.bfcl.corpus import case_request, load_category
    from toolquake.bfcl.embeddings import get_embedder, signature
    from toolquake.perturbers import build
    from toolquake.perturbers.base import Services
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    services = Services(token_counter=EstimateCounter())
    perturber = build("toolkit_expansion", {"k": 3})
    bodies = [case_request(c, model="default") for c in load_category("multiple")]
    warm_toolkits(services, bodies)
    apply(perturber, {"messages": [{"role": "user", "content": "warm up"}], "tools": bodies[0]["tools"]}, services, 0)
    before, after, ms, cpu, worst = [], [], [], [], 0.0
    emb = get_embedder()
    for i, body in enumerate(bodies):
        out, report, wall_ms, cpu_ms = apply(perturber, body, services, i)
        ms.append(wall_ms)
        cpu.append(cpu_ms)
        before.append(len(body["tools"]))
        after.append(len(out["tools"]))
        added = [t for t in out["tools"] if t["function"]["name"] in set(report["added"])]
        if added:
            a = emb.embed([signature(t) for t in added])
            o = emb.embed([signature(t) for t in body["tools"]])
            worst = max(worst, float((a @ o.T).max()))
    return {
        "cases": len(bodies),
        "mean_tools_before": float(np.mean(before)),
        "mean_tools_after": float(np.mean(after)),
        "max_cosine_added_to_original": worst,
        "p50_ms": pct(ms, 0.5),
        "p95_ms": pct(ms, 0.95),
        "cpu_p50_ms": pct(cpu, 0.5),
        "cpu_p95_ms": pct(cpu, 0.95),
    }


def markdown(result: dict[str, Any]) -> str:
    s, p, e = result["startup"], result["padding"], result["expansion"]
    lines = [
        "## Start-up (fresh process, pool read from the disk cache)",
        "",
        "| step | seconds | RSS after (MB) |",
        "|---|---:|---:|",
        f"| python start | – | {s['rss_start_mb']:.0f} |",
        f"| load embedding model ({s['model_id']}) | {s['model_s']:.2f} | {s['rss_model_mb']:.0f} |",
        f"| load tool pool ({s['pool_tools']} tools) | {s['pool_s']:.2f} | {s['rss_pool_mb']:.0f} |",
        "",
        f"## catalog_padding ({p['cases']} cases of {', '.join(DATASETS)}, 5 positions, counter `{p['counter_key']}`)",
        "",
        f"Pool token costs for this counter: {p['pool_costs_s']:.2f} s (first use; then read from disk).",
        "",
        "| budget | mean tools | seed 003 Table 3 | max \\|position − α\\| | max tokens off budget "
        "| wall p50 / p95 ms | CPU p50 / p95 ms | CPU p95 / 20 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        lines.append(
            f"| {r['budget']:,} | {r['mean_tools']:.0f} | {r['seed_003_tools']} | {r['max_position_error']:.3f} "
            f"| {r['max_abs_tokens_off_budget']} | {r['p50_ms']:.2f} / {r['p95_ms']:.2f} "
            f"| {r['cpu_p50_ms']:.2f} / {r['cpu_p95_ms']:.2f} | {r['cpu_p95_ms'] / PAD_TARGET_MS:.2f} |"
        )
    if e is not None:
        lines += [
            "",
            f"## toolkit_expansion (retrieval, k=3, {e['cases']} BFCL multiple cases)",
            "",
            "| tools before | tools after | seed 001 | max cosine added↔original | wall p50 / p95 ms "
            "| CPU p50 / p95 ms | CPU p50 / 15 ms |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {e['mean_tools_before']:.2f} | {e['mean_tools_after']:.2f} | 2.7 → 5.6 "
            f"| {e['max_cosine_added_to_original']:.4f} | {e['p50_ms']:.2f} / {e['p95_ms']:.2f} "
            f"| {e['cpu_p50_ms']:.2f} / {e['cpu_p95_ms']:.2f} | {e['cpu_p50_ms'] / EXPAND_TARGET_MS:.2f} |",
        ]
    lines += [
        "",
        f"Machine: {result['cpus']} CPUs, load average {result['load_before']} before and "
        f"{result['load_after']} after.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Speed and fidelity of toolkit_expansion and catalog_padding "
        "on the BFCL corpus (needs the corpus and the embeddings extra)."
    )
    parser.add_argument(
        "--counter",
        default="estimate",
        help="token counter for padding: 'estimate', 'tokenizer:/path/tokenizer.json', or 'upstream' "
        "(the backend at --upstream) (default: estimate)",
    )
    parser.add_argument(
        "--upstream",
        default="http://127.0.0.1:8000/v1",
        help="the backend's API base URL for --counter upstream (vLLM /tokenize or llama.cpp "
        "/extras/tokenize/count at its root) (default: http://127.0.0.1:8000/v1)",
    )
    parser.add_argument("--skip-expansion", action="store_true", help="only start-up and padding")
    parser.add_argument(
        "--cases",
        type=int,
        default=40,
        help="padding cases per dataset (simple_python, live_simple, multiple), evenly spread (default 40)",
    )
    parser.add_argument("--out", default="bench-results", help="directory for toolkit_perturbers.{json,md}")
    args = parser.parse_args(argv)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    result = {
        "startup": startup(),
        "padding": padding(args.counter, args.upstream, args.cases),
        "expansion": None if args.skip_expansion else expansion(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    text = markdown(result)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "toolkit_perturbers.json").write_text(json.dumps(result, indent=2))
    (out / "toolkit_perturbers.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
