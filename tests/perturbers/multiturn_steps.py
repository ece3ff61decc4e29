"""`python -m tests.perturbers.multiturn_steps`: how many steps of a category's ground-truth runs (real BFCL
multi-turn step requests, tests/support/multiturn_steps.py) have the fact each setting of conversation_lengthening
needs, and how far the filler puts it from the final query."""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

from tests.support.multiturn_steps import perturb, step_requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--category", default="multi_turn_base")
    ap.add_argument("--budgets", type=int, nargs="+", default=[10_000, 20_000, 40_000, 80_000])
    args = ap.parse_args()
    from toolquake.bfcl.corpus import load_category
    from toolquake.bfcl.simulators import Backends, ensure_installed

    ensure_installed()
    cases = list(load_category(args.category))
    with Backends() as backends:
        steps = step_requests(cases, backends)
    by_id = {c.id: c for c in cases}
    n_steps = sum(len(b) for b in steps.values())
    for fact in ("user_turn", "tool_response"):
        kept, cases_hit, reasons, qualifying = 0, set(), Counter(), []
        for cid, bodies in steps.items():
            for body in bodies:
                _, report = perturb({"budget_tokens": 10_000, "fact": fact}, body, by_id[cid])
                if "not_perturbed" in report:
                    reasons[report["not_perturbed"]] += 1
                else:
                    kept += 1
                    cases_hit.add(cid)
                    qualifying.append((by_id[cid], body))
        print(f"{args.category} fact={fact}: {len(steps)} cases, {n_steps} steps; steps with the fact {kept} "
              f"({kept / n_steps:.1%}); cases with at least one {len(cases_hit)} ({len(cases_hit) / len(steps):.1%}); "
              f"not perturbed: {dict(reasons)}")
        for budget in args.budgets:
            lengthened, between = 0, []
            for case, body in qualifying:
                _, report = perturb({"budget_tokens": budget, "fact": fact}, body, case)
                lengthened += report["turns_added"] > 0
                between.append(report["tokens_between"])
            print(f"  {budget}: {lengthened} of {kept} lengthened (the others already that long); tokens between the "
                  f"fact and the final query, median {statistics.median(between):.0f} (estimate counter)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
