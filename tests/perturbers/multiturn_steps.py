"""Real BFCL multi-turn step requests: each case's ground-truth trajectory played by the fake upstream
(`--trajectories`), the agent loop (`proxy.replay.multiturn.run_case`) running the calls on the API
simulators, and every request the loop sent read back from the fake. Used by the conversation-fact tests
and `python -m tests.perturbers.multiturn_steps` (how many steps of a category's ground-truth runs have the fact
each setting needs, and how far the filler puts it from the final query)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support import recorded, start_fake_upstream
from tests.support.multiturn import first_user, scripted_turns


def step_requests(cases: list[Any], backends: Any) -> dict[str, list[dict[str, Any]]]:
    """{case id: the chat requests of its ground-truth run, in order}."""
    from toolquake.proxy.replay.multiturn import run_case
    from toolquake.scorers import multiturn as mt

    script = {first_user(c): scripted_turns(mt.ground_truth_result(c, backends)) for c in cases}
    path = Path(tempfile.mkdtemp(prefix="toolquake-steps-")) / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": k, "turns": v}) + "\n" for k, v in script.items()))
    fake = start_fake_upstream("--trajectories", str(path))
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for case in cases:
            asyncio.run(run_case(case, f"{fake.url}/v1", model="fake-model", headers={"X-Test-Tag": case.id},
                                 backends=backends))
            out[case.id] = [json.loads(r["body"]) for r in recorded(fake, case.id)]
    finally:
        fake.stop()
    return out


def perturb(params: dict[str, Any], body: dict[str, Any], case: Any, seed: int = 7) -> tuple[dict[str, Any], dict]:
    from toolquake.perturbers import build
    from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=SERVICES.setdefault(
        "s", Services(token_counter=EstimateCounter())), case=case)
    out = build("conversation_lengthening", params).apply(ChatRequest(body), ctx)
    return out.body, ctx.report


SERVICES: dict[str, Any] = {}


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
