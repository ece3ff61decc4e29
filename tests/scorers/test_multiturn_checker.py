"""The multi-turn checker: BFCL's worked examples, ground-truth trajectories, strict mode, and parity
with BFCL's own `multi_turn_checker` on ground-truth and mutated trajectories."""

from __future__ import annotations

import copy
import itertools
import random
import sys
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from toolquake.bfcl.simulators import Backends
from toolquake.scorers import multiturn as mt
from toolquake.scorers.multiturn import MultiTurnResult, Step, check, ground_truth_result

pytestmark = pytest.mark.needs_corpus


def case(case_id: str) -> Any:
    from toolquake.bfcl.corpus import load_case

    return load_case(case_id)


def run(*turns: list[Any]) -> MultiTurnResult:
    """A result from per-turn lists of steps; a step is a list of (name, arguments) or a text string."""
    out = []
    for turn in turns:
        steps = []
        for step in turn:
            if isinstance(step, str):
                steps.append(Step(decode_error="text answer", text=step))
            else:
                steps.append(Step(calls=[{"name": n, "arguments": a} for n, a in step]))
        out.append(steps)
    return MultiTurnResult(case_id="test", turns=out)


# multi_turn_base_0, keyword form of the ground truth (spec §9 E11)
T0 = [("cd", {"folder": "document"}), ("mkdir", {"dir_name": "temp"}),
      ("mv", {"source": "final_report.pdf", "destination": "temp"})]
T1 = [("cd", {"folder": "temp"}), ("grep", {"file_name": "final_report.pdf", "pattern": "budget analysis"})]
T2 = [("sort", {"file_name": "final_report.pdf"})]
T3 = [("cd", {"folder": ".."}), ("mv", {"source": "previous_report.pdf", "destination": "temp"}),
      ("cd", {"folder": "temp"}), ("diff", {"file_name1": "final_report.pdf", "file_name2": "previous_report.pdf"})]


def test_base_0_ground_truth_with_trailing_text_is_valid(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0, "done"], [T1, "ok"], [T2, "sorted"], [T3, "here"]),
                    backends=backends)
    assert verdict.valid, verdict


def test_base_0_extra_reads_and_split_steps_are_valid(backends: Backends) -> None:
    extra = [("ls", {}), ("pwd", {})]
    verdict = check(case("multi_turn_base_0"), run([extra, *[[c] for c in T0]], [T1], [extra, T2], [T3]),
                    backends=backends)
    assert verdict.valid, verdict


def test_base_0_sort_without_argument_is_a_response_mismatch(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0], [T1], [[("sort", {})]], [T3]), backends=backends)
    assert (verdict.valid, verdict.error_type, verdict.turn) == (False, mt.RESPONSE_MISMATCH, 2)
    assert verdict.taxonomy == mt.RESPONSE


def test_base_0_skipping_grep_is_a_response_mismatch(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0], [T1[:1]], [T2], [T3]), backends=backends)
    assert (verdict.error_type, verdict.turn) == (mt.RESPONSE_MISMATCH, 1)
    assert verdict.details["missing"]


def test_base_0_doing_the_grep_a_turn_early_is_valid(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0 + T1], [T1[:1]], [T2], [T3]), backends=backends)
    assert verdict.valid, verdict


def test_base_0_text_only_turn_is_an_empty_turn(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0], [T1], ["I sorted it"], [T3]), backends=backends)
    assert (verdict.error_type, verdict.turn, verdict.taxonomy) == (mt.EMPTY_TURN, 2, mt.DECODE)


def test_base_0_three_turns_is_force_terminated(backends: Backends) -> None:
    verdict = check(case("multi_turn_base_0"), run([T0], [T1], [T2]), backends=backends)
    assert (verdict.error_type, verdict.taxonomy) == (mt.FORCE_TERMINATED, mt.TERMINATED)


def test_base_0_wrong_directory_is_a_state_mismatch(backends: Backends) -> None:
    wrong = [("cd", {"folder": "document"}), ("mkdir", {"dir_name": "tmp"}),
             ("mv", {"source": "final_report.pdf", "destination": "tmp"})]
    verdict = check(case("multi_turn_base_0"), run([wrong], [T1], [T2], [T3]), backends=backends)
    assert (verdict.error_type, verdict.turn) == (mt.STATE_MISMATCH, 0)
    assert {d["attribute"] for d in verdict.details["differences"]} == {"root"}


def test_malformed_calls_count_as_undecoded_steps(backends: Backends) -> None:
    malformed = MultiTurnResult(case_id="test", turns=[
        [Step(calls=[{"name": "cd", "arguments": ["document"]}]), Step(calls=[{"arguments": {}}])],
        *run([T1], [T2], [T3]).turns])
    verdict = check(case("multi_turn_base_0"), malformed, backends=backends)
    assert (verdict.error_type, verdict.turn) == (mt.EMPTY_TURN, 0)


def test_inference_error_is_reported_as_such(backends: Backends) -> None:
    result = MultiTurnResult(case_id="multi_turn_base_0", error="HTTP 500 from the proxy")
    assert check(case("multi_turn_base_0"), result, backends=backends).error_type == mt.INFERENCE_ERROR


def test_miss_param_acting_in_the_clarification_turn_is_lenient_but_not_strict(backends: Backends) -> None:
    c = case("multi_turn_miss_param_0")
    gt = ground_truth_result(c, backends)
    clarify = next(t for t, calls in enumerate(c.ground_truth) if not calls)
    early = [list(t) for t in gt.turns]
    early[clarify] = gt.turns[clarify + 1]  # do the next turn's work while the user has not said enough yet
    result = MultiTurnResult(case_id=c.id, turns=early)
    assert check(c, result, backends=backends).valid
    strict = check(c, result, strict=True, backends=backends)
    assert (strict.error_type, strict.turn, strict.taxonomy) == (mt.IRRELEVANT_CALLS, clarify, mt.IRRELEVANT)
    assert check(c, gt, strict=True, backends=backends).valid


def test_miss_func_calling_the_held_out_function_early_is_lenient_but_not_strict(backends: Backends) -> None:
    c = case("multi_turn_miss_func_0")
    gt = ground_truth_result(c, backends)
    reveal = int(next(iter(c.extra["missed_function_names"])))
    turns = [list(t) for t in gt.turns]
    turns[reveal - 1] = gt.turns[reveal]     # the turn where `sort` is still missing
    result = MultiTurnResult(case_id=c.id, turns=turns)
    assert check(c, result, backends=backends).valid
    strict = check(c, result, strict=True, backends=backends)
    assert (strict.error_type, strict.turn) == (mt.NOT_AVAILABLE, reveal - 1)
    assert strict.details["calls"] == ["sort"]


def test_force_termination_in_the_last_turn_fails_only_in_strict_mode(backends: Backends) -> None:
    c = case("multi_turn_base_0")
    result = run([T0], [T1], [T2], [T3])
    result.force_terminated = True
    assert check(c, result, backends=backends).valid
    assert check(c, result, strict=True, backends=backends).error_type == mt.FORCE_TERMINATED


def test_strict_mode_wants_each_turns_results_in_that_turn_and_in_order(backends: Backends) -> None:
    # doing turn 1's grep in turn 0 is fine for BFCL (responses are cumulative), not in strict mode
    early = run([T0 + T1], [T1[:1]], [T2], [T3])
    verdict = check(case("multi_turn_base_0"), early, strict=True, backends=backends)
    assert (verdict.error_type, verdict.turn, verdict.taxonomy) == (mt.STRICT_RESPONSE, 1, mt.RESPONSE)
    # base_5, turn 1 is cat then sort of the same file: sort first reaches the same state
    c = case("multi_turn_base_5")
    gt = ground_truth_result(c, backends)
    assert [x["name"] for x in gt.turns[1][0].calls] == ["cat", "sort"]
    turns = [list(t) for t in gt.turns]
    turns[1] = [Step(calls=gt.turns[1][0].calls[::-1])]
    reordered = MultiTurnResult(case_id=c.id, turns=turns)
    assert check(c, reordered, backends=backends).valid
    assert check(c, reordered, strict=True, backends=backends).error_type == mt.STRICT_RESPONSE


def test_every_ground_truth_trajectory_passes(backends: Backends) -> None:
    from toolquake.bfcl.corpus import MULTI_TURN_CATEGORIES, load_cases

    verdicts: Counter = Counter()
    refused = []
    for c in load_cases(MULTI_TURN_CATEGORIES):
        v = check(c, ground_truth_result(c, backends), backends=backends)
        verdicts[(c.category, v.error_type)] += 1
        # nothing the simulators need at run time may be refused by the sandbox (lazy imports, ...)
        with backends.world(c.extra["involved_classes"], c.extra["initial_config"], mt.long_context_of(c)) as w:
            refused += [(c.id, r) for turn in mt.ground_truth_calls(c) for r in w.execute(turn) if "sandbox:" in r]
    assert verdicts == Counter({(cat, None): 200 for cat in MULTI_TURN_CATEGORIES})
    assert refused == []


def test_summary_reports_accuracy_per_category_and_error_breakdown() -> None:
    bad = mt.MultiTurnVerdict(valid=False, error_type=mt.STATE_MISMATCH, taxonomy=mt.STATE)
    items = [("off", "multi_turn_base", mt.VALID), ("off", "multi_turn_base", bad),
             ("off", "multi_turn_miss_func", mt.VALID), ("shuffled", "multi_turn_base", bad)]
    s = mt.summarize(items)
    assert s["off"]["by_category"]["multi_turn_base"] == {"n": 2, "accuracy": 0.5}
    assert s["off"]["overall"] == 0.75 and s["off"]["accuracy"] == 2 / 3
    assert s["shuffled"]["errors"] == {mt.STATE: 1}


# --- parity with BFCL's own checker ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bfcl_checker(backends: Backends) -> Iterator[types.ModuleType]:
    """BFCL's `multi_turn_checker` module, imported from the --no-deps install (it `eval`s: trusted input only)."""
    from toolquake.bfcl.simulators import backends_root

    root = str(backends_root())
    saved = set(sys.modules)
    sys.path.insert(0, root)
    try:
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker

        yield multi_turn_checker
    finally:
        sys.path.remove(root)
        for name in set(sys.modules) - saved:
            if name.startswith("bfcl_eval"):
                del sys.modules[name]


def _bfcl_step(calls: list[dict[str, Any]]) -> list[str]:
    # BFCL's FC decoding of one step (spec §3.3): name(k=repr(v),...) with commas and no spaces
    return [f"{c['name']}({','.join(f'{k}={v!r}' for k, v in c['arguments'].items())})" for c in calls]


_names = itertools.count()


def bfcl_verdict(module: types.ModuleType, c: Any, result: MultiTurnResult) -> tuple[bool, str | None]:
    """What BFCL's evaluation of an FC model's result gives (eval_runner's multi-turn path)."""
    if len(result.turns) != len(c.ground_truth):
        return False, mt.FORCE_TERMINATED
    decoded = [[_bfcl_step(s.calls) for s in turn if s.calls] for turn in result.turns]
    entry = {"id": c.id, "initial_config": c.extra["initial_config"], "involved_classes": c.extra["involved_classes"]}
    model = f"parity_{next(_names)}"
    utils = sys.modules["bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"]
    try:
        out = module.multi_turn_checker(decoded, c.ground_truth, copy.deepcopy(entry), c.category, model)
    finally:
        for key in [k for k in vars(utils) if k.startswith(model)]:
            del vars(utils)[key]
    return bool(out["valid"]), out.get("error_type")


def mutations(c: Any, gt: MultiTurnResult, rng: random.Random) -> Iterator[tuple[str, MultiTurnResult]]:
    """Ground truth and mutated trajectories of one case."""
    turns = gt.turns
    acting = [t for t, turn in enumerate(turns) if turn[0].calls]

    def with_turns(new: list[list[Step]]) -> MultiTurnResult:
        return MultiTurnResult(case_id=c.id, turns=new)

    def edit_call(fn: Any) -> list[list[Step]]:
        t = rng.choice(acting)
        calls = [dict(x, arguments=dict(x["arguments"])) for x in turns[t][0].calls]
        i = rng.randrange(len(calls))
        calls[i] = fn(calls[i])
        return [*turns[:t], [Step(calls=calls)], *turns[t + 1:]]

    yield "ground_truth", gt
    yield "truncated", with_turns(turns[:-1])
    t = rng.choice(acting)
    yield "text_turn", with_turns([*turns[:t], [Step(decode_error="text")], *turns[t + 1:]])
    t = rng.choice(acting)
    yield "drop_last_call", with_turns([*turns[:t], [Step(calls=turns[t][0].calls[:-1])], *turns[t + 1:]])
    t = rng.choice(acting)
    yield "split_steps", with_turns([*turns[:t], [Step(calls=[x]) for x in turns[t][0].calls], *turns[t + 1:]])
    t = rng.choice(acting)
    yield "reversed", with_turns([*turns[:t], [Step(calls=turns[t][0].calls[::-1])], *turns[t + 1:]])
    yield "no_arguments", with_turns(edit_call(lambda x: dict(x, arguments={})))
    yield "unknown_function", with_turns(edit_call(lambda x: dict(x, name=x["name"] + "_v2")))

    def change_value(x: dict[str, Any]) -> dict[str, Any]:
        args = x["arguments"]
        for k, v in args.items():
            if isinstance(v, str):
                args[k] = v + "x"
                break
            if isinstance(v, bool):
                args[k] = not v
                break
            if isinstance(v, (int, float)):
                args[k] = v + 1
                break
        return x

    yield "changed_value", with_turns(edit_call(change_value))
    t = rng.choice(acting)
    yield "duplicated_calls", with_turns([*turns[:t], [Step(calls=turns[t][0].calls * 2)], *turns[t + 1:]])
    if len(acting) > 1:
        a, b = acting[0], acting[1]
        early = [list(x) for x in turns]
        early[a] = [*turns[a], *turns[b]]
        yield "next_turn_early", with_turns(early)
        skipped = [list(x) for x in turns]
        skipped[a] = [Step(calls=turns[a][0].calls + turns[b][0].calls)]
        skipped[b] = [Step(calls=[{"name": "ls" if "ls" in str(c.functions) else turns[b][0].calls[0]["name"],
                                   "arguments": {}}])]
        yield "work_moved_earlier", with_turns(skipped)


def test_parity_with_bfcl_multi_turn_checker(backends: Backends, bfcl_checker: types.ModuleType) -> None:
    from toolquake.bfcl.corpus import MULTI_TURN_CATEGORIES, load_cases

    rng = random.Random(11)
    cases = load_cases(MULTI_TURN_CATEGORIES)
    sample = rng.sample(cases, 160)
    seen: Counter = Counter()
    mismatches = []
    for c in sample:
        gt = ground_truth_result(c, backends)
        for label, result in mutations(c, gt, rng):
            ours = check(c, result, backends=backends)
            theirs = bfcl_verdict(bfcl_checker, c, result)
            seen[(label, ours.error_type)] += 1
            if (ours.valid, ours.error_type) != theirs:
                mismatches.append((c.id, label, (ours.valid, ours.error_type), theirs, ours.errors))
    assert not mismatches, mismatches[:5]
    kinds = {e for (_, e) in seen}
    # the sample exercises every verdict BFCL's evaluation can give an FC model's run
    assert {None, mt.FORCE_TERMINATED, mt.EMPTY_TURN, mt.STATE_MISMATCH, mt.RESPONSE_MISMATCH} <= kinds, seen
    assert sum(seen.values()) > 1500
