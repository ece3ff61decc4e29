"""format_rewrite cost per request: render (apply: system prompt + history) and parse (restore), in-process.

    python -m tests.bench.format_rewrite [--repeat 200] [--rounds 5]

The budget is 1 ms for render + parse of a typical request. Two workloads:
- `typical`: 4 tools, a system and a user message, and an answer with two calls;
- `corpus`: BFCL's 200 format-sensitivity cases with their ground truth as the answer (when the
  corpus is pulled), reported as p50 / p95 / max over the cases.
Each of the 8 return-format × tag combinations is measured in strict and lenient mode; the table
shows microseconds and the ratio to the budget (below 1.0 = within budget). Medians of the rounds.

A third table parses degenerate answers (repetition loops, cut-off lists, unclosed tags), where
BFCL's own regexes backtrack quadratically or exponentially, at two sizes: the ratio of the times
for 4× the text stays near 4 when parsing is linear.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from toolquake.perturbers import ChatRequest, PerturbContext, Services
from toolquake.perturbers.format_rewrite import FormatRewrite
from toolquake.perturbers.helpers.callformat_parse import parse_both
from toolquake.perturbers.helpers.callformat_render import render_calls
from toolquake.perturbers.helpers.callformats import RETURN_FORMATS

BUDGET_US = 1000.0
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "Looks something up in a catalogue of things.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "What to find."},
        "limit": {"type": "integer", "description": "How many results."},
        "filters": {"type": "object", "description": "Field filters.", "properties": {
            "open_now": {"type": "boolean"}, "min_rating": {"type": "number"}}}},
        "required": ["query"]}}} for i in range(4)]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant that uses tools."},
            {"role": "user", "content": "Find me the three nearest coffee shops open now, and a bakery."}]
CALLS = [{"name": "tool_0", "arguments": {"query": "coffee shop", "limit": 3, "filters": {"open_now": True}}},
         {"name": "tool_1", "arguments": {"query": "bakery", "limit": 1}}]


def one(p: FormatRewrite, body: dict[str, Any], answer: str, case: Any = None) -> float:
    """Seconds for one apply + restore."""
    ctx = PerturbContext(perturbation_seed=1, rng=random.Random(1), services=Services(), case=case)
    response = {"id": "x", "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": answer}}]}
    t0 = time.perf_counter()
    p.apply(ChatRequest(body), ctx)
    p.restore(response, ctx)
    return time.perf_counter() - t0


def typical(repeat: int, rounds: int) -> list[tuple[str, float]]:
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    rows = []
    for fmt in RETURN_FORMATS:
        for tag in (False, True):
            for mode in ("strict", "lenient"):
                p = FormatRewrite(return_format=fmt, tool_call_tag=tag, parse=mode)
                answer = render_calls(CALLS, fmt, tag)
                one(p, body, answer)  # warm-up (imports)
                medians = [statistics.median(one(p, body, answer) for _ in range(repeat)) for _ in range(rounds)]
                rows.append((f"{fmt} tag={tag} {mode}", statistics.median(medians) * 1e6))
    return rows


def corpus_cases() -> list[tuple[Any, dict[str, Any], list[dict[str, Any]]]]:
    from toolquake.bfcl import corpus

    out = []
    for ids in corpus.format_sensitivity_ids().values():
        for case_id in ids:
            case = corpus.load_case(case_id)
            calls = []
            for item in case.ground_truth:
                ((name, params),) = item.items()
                calls.append({"name": name, "arguments": {k: next(a for a in alts if a != "")
                                                          for k, alts in params.items() if any(a != "" for a in alts)}})
            out.append((case, corpus.case_request(case), calls))
    return out


def corpus_rows(rounds: int) -> list[tuple[str, float, float, float]]:
    try:
        cases = corpus_cases()
    except FileNotFoundError:
        return []
    rows = []
    for fmt in RETURN_FORMATS:
        for tag in (False, True):
            p = FormatRewrite(return_format=fmt, tool_call_tag=tag, parse="lenient")
            per_case = [min(one(p, body, render_calls(calls, fmt, tag), case) for _ in range(rounds)) * 1e6
                        for case, body, calls in cases]
            per_case.sort()
            rows.append((f"{fmt} tag={tag} lenient", per_case[len(per_case) // 2],
                         per_case[int(len(per_case) * 0.95)], per_case[-1]))
    return rows


DEGENERATE = {
    "cut-off json list": '[{"function": "f", "parameters": {"a": 1}}, ',
    "json objects, no ]": '{"a": 1}, ',
    "<TOOLCALL> loop": "<TOOLCALL>",
    "<functions> loop": "<functions>",
    "python calls per line": "f(a=1)\n",
    "unclosed python list": "f(a=[1, 2], b='x'), ",
}


def degenerate_rows(rounds: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, unit in DEGENERATE.items():
        times = []
        for n in (500, 2000):
            text = unit * n
            best = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for fmt in RETURN_FORMATS:
                    for tag in (False, True):
                        parse_both(text, fmt, tag)
                best.append(time.perf_counter() - t0)
            times.append(min(best) / 8)
        rows.append((f"{name} ({len(unit) * 500 // 1000}→{len(unit) * 2000 // 1000} KB)", times[0] * 1e3,
                     times[1] * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=200, help="requests per round for the typical workload")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (median reported); per corpus case: best of N")
    args = ap.parse_args()
    print("## format_rewrite: render + parse per request (typical: 4 tools, 2 messages, 2 calls)\n")
    print("| configuration | µs | ratio to 1 ms budget |\n|---|---:|---:|")
    for name, us in typical(args.repeat, args.rounds):
        print(f"| {name} | {us:.0f} | {us / BUDGET_US:.2f} |")
    rows = corpus_rows(args.rounds)
    if rows:
        print("\n## BFCL format-sensitivity cases (200), render + parse per case\n")
        print("| configuration | p50 µs | p95 µs | max µs | p50 ratio to budget |\n|---|---:|---:|---:|---:|")
        for name, p50, p95, worst in rows:
            print(f"| {name} | {p50:.0f} | {p95:.0f} | {worst:.0f} | {p50 / BUDGET_US:.2f} |")
    else:
        print("\n(corpus not pulled: `toolquake corpus pull` adds the per-case table)")
    print("\n## Degenerate answers: strict + lenient parse, mean over the 8 format × tag combinations\n")
    print("| answer | ms at 1× | ms at 4× | ratio (linear ≈ 4) |\n|---|---:|---:|---:|")
    for name, small, large in degenerate_rows(min(args.rounds, 3)):
        print(f"| {name} | {small:.2f} | {large:.2f} | {large / small:.1f} |")


if __name__ == "__main__":
    main()
