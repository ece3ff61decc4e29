"""Real BFCL multi-turn step requests: each case's ground-truth trajectory played by the fake upstream
(`--trajectories`), the agent loop (`proxy.replay.multiturn.run_case`) running the calls on the API
simulators, and every request the loop sent read back from the fake. Used by the conversation-fact tests
and `python -m tests.perturbers.multiturn_steps`."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from tests.support import recorded, start_fake_upstream
from tests.support.multiturn import first_user, scripted_turns
from tests.support.scratch import scratch_dir


def step_requests(cases: list[Any], backends: Any) -> dict[str, list[dict[str, Any]]]:
    """{case id: the chat requests of its ground-truth run, in order}."""
    from toolquake.proxy.replay.multiturn import run_case
    from toolquake.scorers import multiturn as mt

    script = {first_user(c): scripted_turns(mt.ground_truth_result(c, backends)) for c in cases}
    path = scratch_dir("steps-") / "trajectories.jsonl"
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
