"""tool_metadata keeps the ground truth valid on whole BFCL categories (`multiple`, `simple_python`): every kind
applied to every case leaves each offered tool's name and parameters as they were, and the ground-truth answer
graded after the perturbation is still valid; then `toolquake replay --profiles @metadata` against the fake
upstream answering every case with its ground truth scores 100 % in every arm."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from tests.support import start_fake_upstream
from tests.support.perturbers import needs_corpus
from tests.support.replay import oracle_script, replay, rows
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.tool_metadata import KINDS

pytestmark = needs_corpus
CATEGORIES = ("multiple", "simple_python")


def applied_step(kind: str, case: Any, body: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any]:
    """The perturbed body, and the step as the pipeline records it (for the grader)."""
    from toolquake.proxy.server.pipeline import Applied

    perturber = build("tool_metadata", {"kind": kind})
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:tool_metadata"), services=Services(),
                         case=case)
    out = perturber.apply(ChatRequest(body), ctx)
    return out.body, Applied("tool_metadata", perturber.params(), ctx.report, perturber)


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_case_keeps_its_tools_and_its_ground_truth_under_every_kind(category: str) -> None:
    from toolquake.bfcl.convert import openai_name
    from toolquake.bfcl.corpus import case_request, load_category
    from toolquake.proxy.live.grader import Grader
    from toolquake.scorers.mutations import ground_truth_calls

    grader = Grader(semantic=False)
    cases = load_category(category)
    assert len(cases) >= 200
    changed = 0
    for n, case in enumerate(cases):
        body = case_request(case, model="m")
        pristine = copy.deepcopy(body)
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": openai_name(c["name"]),
                                                                 "arguments": json.dumps(c["arguments"])}}
                 for i, c in enumerate(ground_truth_calls(case))]
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": calls}}]}
        for kind in KINDS:
            out, step = applied_step(kind, case, body, seed=n)
            assert body == pristine
            before = [(t["function"]["name"], t["function"].get("parameters")) for t in pristine["tools"]]
            after = {t["function"]["name"]: t["function"].get("parameters") for t in out["tools"]}
            assert all(after.get(name) == params for name, params in before), (case.id, kind)
            assert [n for n in after if n in dict(before)] == [name for name, _ in before], (case.id, kind)
            changed += out != pristine
            grade = grader.grade(case, answer, [step])
            assert grade.valid and grade.expected == "ground_truth", (case.id, kind, grade)
    # the kinds did change something (a single-tool case leaves three of them nothing to rewrite)
    assert changed >= len(cases)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("category", CATEGORIES)
def test_replay_of_the_metadata_preset_against_the_ground_truth_scores_every_arm_100(tmp_path, category: str) -> None:
    """One category per replay: a few user messages of `multiple` recur in `simple_python` with other tools."""
    from toolquake.bfcl.corpus import load_category

    cases = load_category(category)
    fake = start_fake_upstream("--script", str(oracle_script(cases, set())))
    try:
        done = replay("--backend", f"{fake.url}/v1", "--profiles", "@metadata", "--out", str(tmp_path),
                      "--categories", category, "--concurrency", "8", timeout=900)
        assert done.returncode == 0, done.stderr
    finally:
        fake.stop()
    found = rows(tmp_path)
    arms = {r["profile"] for r in found}
    assert arms == {"off", "meta-promote", "meta-mislead", "meta-namespace-twin", "meta-paraphrase-target"}
    assert len(found) == len(cases) * len(arms)
    bad = [(r["case_id"], r["profile"], r["status"], r["error_type"]) for r in found
           if r["status"] != "scored" or not r["valid"]]
    assert not bad, bad[:10]
    # the arms did rewrite the tools: every perturbed arm ran its step, and changed something on multi-tool cases
    for r in found:
        if r["profile"] != "off":
            (step,) = json.loads(r["perturbers"])["applied"]
            assert step["name"] == "tool_metadata", r["case_id"]
            if category == "multiple":
                report = step["report"]
                assert not report.get("skipped") and (report.get("changed") or report.get("added")), r["case_id"]
