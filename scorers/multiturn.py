"""BFCL's multi-turn checker (state-based + response-based, per turn), on the sandboxed API simulators.

Input: a `MultiTurnResult` — per turn, the model's steps (the calls each step decoded to, or why it
did not decode) — as produced by the agent loop (`proxy.multiturn.run_case`) or built by hand.
`check(case, result)` re-executes the model's calls and the ground truth on fresh simulator worlds
(scorers.backends) and returns a `MultiTurnVerdict` with BFCL's error types:

* `multi_turn:inference_error` — the run has no usable result (the model could not be queried);
* `multi_turn:force_terminated` — fewer turns than the ground truth (a turn went past 20 steps);
* `multi_turn:empty_turn_model_response` — a turn that needs calls has no step that decoded to calls;
* `multi_turn:instance_state_mismatch` — after a turn, a public attribute of an instance differs;
* `multi_turn:execution_response_mismatch` — a ground-truth result of this turn is missing from the
  model's results so far (all turns, as a multiset).

BFCL's order of checks is kept: steps that fail to decode or decode to no call are dropped; a turn with
an empty ground truth is executed but not checked. `strict=True` applies what BFCL leaves unused
(docs/multiturn.md): no calls in turns whose ground truth is empty (its unused irrelevance check,
`multi_turn:irrelevance_error:decoder_success`), a force termination in the last turn fails too,
no held-out function called before the turn that reveals it (`multi_turn:function_not_available`),
and each turn's ground-truth results must appear among that turn's own results, in order
(`multi_turn:strict_response_mismatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from toolquake.bfcl.decode import is_well_formed
from toolquake.bfcl.simulators import BackendError, Backends, Call, parse_call, shared

INFERENCE_ERROR = "multi_turn:inference_error"
FORCE_TERMINATED = "multi_turn:force_terminated"
EMPTY_TURN = "multi_turn:empty_turn_model_response"
STATE_MISMATCH = "multi_turn:instance_state_mismatch"
RESPONSE_MISMATCH = "multi_turn:execution_response_mismatch"
# strict mode only
IRRELEVANT_CALLS = "multi_turn:irrelevance_error:decoder_success"
NOT_AVAILABLE = "multi_turn:function_not_available"
STRICT_RESPONSE = "multi_turn:strict_response_mismatch"
# not a model error: the simulators could not run
BACKEND_ERROR = "toolquake:backend_error"

# the error breakdown reported for multi-turn runs (verdict.taxonomy)
STATE = "state_mismatch"
RESPONSE = "response_mismatch"
TERMINATED = "force_terminated"
DECODE = "decode_failure"
IRRELEVANT = "irrelevance_violation"
INFERENCE = "inference_error"
INPUT = "input_error"
TAXONOMY = {
    STATE_MISMATCH: STATE, RESPONSE_MISMATCH: RESPONSE, STRICT_RESPONSE: RESPONSE, FORCE_TERMINATED: TERMINATED,
    EMPTY_TURN: DECODE, IRRELEVANT_CALLS: IRRELEVANT, NOT_AVAILABLE: IRRELEVANT, INFERENCE_ERROR: INFERENCE,
    BACKEND_ERROR: INPUT,
}
MAXIMUM_STEPS = 20  # BFCL's MAXIMUM_STEP_LIMIT: a turn that needs more steps is force-terminated


class Step(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One model step: the calls it decoded to (None when it did not decode) and what came back."""

    calls: list[dict[str, Any]] | None = None   # [{"name": ..., "arguments": {...}}]
    decode_error: str | None = None             # why the step has no calls (text answer, bad JSON, ...)
    text: str | None = None                     # the assistant's text, when the run keeps contents
    results: list[str] | None = None            # the execution results fed back to the model
    request_id: str | None = None
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class MultiTurnResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model's run of one multi-turn case: `turns[t]` is the list of steps of turn t."""

    case_id: str
    turns: list[list[Step]] = msgspec.field(default_factory=list)
    force_terminated: bool = False
    error: str | None = None            # the run stopped: the model could not be queried
    error_code: str | None = None       # "unreachable", "timeout", the error's code or "http_<status>", "bad_response"
    error_status: int | None = None     # the HTTP status of the failed request (None: no answer, or a 200)
    #: the request was refused for its shape (proxy/replay/failures.py `REFUSALS`): the run's warning for it
    error_shape: str | None = None


class MultiTurnVerdict(msgspec.Struct, frozen=True, kw_only=True):
    valid: bool
    error_type: str | None = None
    errors: list[str] = msgspec.field(default_factory=list)
    taxonomy: str | None = None
    turn: int | None = None             # the turn that failed
    details: dict[str, Any] = msgspec.field(default_factory=dict)


VALID = MultiTurnVerdict(valid=True)


def _fail(error_type: str, message: str, turn: int | None = None, **details: Any) -> MultiTurnVerdict:
    return MultiTurnVerdict(valid=False, error_type=error_type, errors=[message], taxonomy=TAXONOMY.get(error_type),
                            turn=turn, details=details)


def _classes(case: Any) -> list[str]:
    classes = case.extra.get("involved_classes")
    if not classes:
        raise ValueError(f"{case.id} has no involved_classes: not a multi-turn case")
    return list(classes)


def long_context_of(case: Any) -> bool:
    """BFCL's rule: the simulators get long-context data in long_context (and composite) categories."""
    return "long_context" in case.category or "composite" in case.category


def ground_truth_calls(case: Any) -> list[list[Call]]:
    """The ground truth per turn, parsed safely (positional arguments kept, as BFCL executes them)."""
    return [[parse_call(text) for text in turn] for turn in case.ground_truth]


def _as_possible_answer(call: Call, functions: list[dict[str, Any]]) -> dict[str, Any]:
    """A ground-truth call as BFCL's possible answer: each argument its one allowed value (a positional one named by
    the function's parameter order)."""
    doc = next((f for f in functions if f.get("name") == call.name), {})
    names = list(((doc.get("parameters") or {}).get("properties") or {}))
    args = {names[i] if i < len(names) else f"arg{i}": v for i, v in enumerate(call.args)}
    args.update(call.kwargs)
    return {call.name: {k: [_allowed(v)] for k, v in args.items()}}


def _allowed(value: Any) -> Any:
    """A value as BFCL's possible answers write it inside a parameter: a dict's values each a one-item list."""
    if isinstance(value, dict):
        return {k: [_allowed(v)] for k, v in value.items()}
    if isinstance(value, list):
        return [_allowed(v) for v in value]
    return value


def final_call(case: Any, result: MultiTurnResult) -> MultiTurnVerdict:
    """Seed 003 challenge 3's score of a conversation: the calls the model made in its last turn (the paper's llm_n
    on u_n), all steps together, against that turn's ground truth, by BFCL's AST checker (one call: its `multiple`
    dispatch; several: `parallel`, in any order; none: valid iff no call). `turn` is the last turn's index."""
    from toolquake.scorers.ast_checker import check_calls

    last = len(case.ground_truth) - 1
    if result.error is not None:
        return _fail(INFERENCE_ERROR, f"the model could not be queried: {result.error}", turn=last)
    if len(result.turns) <= last:
        return _fail(FORCE_TERMINATED, f"the run stopped before the last turn ({len(result.turns)} of {last + 1})",
                     turn=last)
    functions = _all_functions(case)
    calls = [c for step in result.turns[last] if step.calls and is_well_formed(step.calls) for c in step.calls]
    expected = [_as_possible_answer(parse_call(text), functions) for text in case.ground_truth[last]]
    category = "irrelevance" if not expected else ("parallel" if len(expected) > 1 else "multiple")
    v = check_calls(functions, expected or None, category, calls)
    return MultiTurnVerdict(valid=v.valid, error_type=v.error_type, errors=list(v.errors), taxonomy=v.taxonomy,
                            turn=last)


def _all_functions(case: Any) -> list[dict[str, Any]]:
    """The case's functions with the ones miss_func holds back (every function a turn can name)."""
    functions = [dict(f) for f in case.functions]
    for held in (case.extra.get("missed_function") or {}).values():
        functions += [dict(f) for f in held]
    return functions


def next_call(case: Any, calls: Any, turn: int | None = None) -> MultiTurnVerdict:
    """Seed 003 challenge 3 as the paper measures it (§3.3): the conversation up to user turn u_n is given and the
    model's answer to it is the one call llm_n, graded by BFCL's AST checker (its `multiple` dispatch) against the
    ground truth's first call of turn `turn` (default: the last). `calls` are the answer's decoded calls (or a
    `DecodeFailure`): the first is graded, any after it are not (a turn whose ground truth makes several calls asks
    only for its first here). A turn whose ground truth makes no call is valid iff the answer makes none.
    `details`: `expected_calls` (the turn's ground-truth calls), `calls` (the answer's)."""
    from toolquake.bfcl.decode import DecodeFailure
    from toolquake.scorers.ast_checker import check_calls

    turn = len(case.ground_truth) - 1 if turn is None else turn
    functions = _all_functions(case)
    expected = case.ground_truth[turn]
    made = [] if isinstance(calls, DecodeFailure) else list(calls or [])
    details = {"expected_calls": len(expected), "calls": len(made)}
    if not expected:
        v = check_calls(functions, None, "irrelevance", calls)
    else:
        first = calls if isinstance(calls, DecodeFailure) or not made else made[:1]
        v = check_calls(functions, [_as_possible_answer(parse_call(expected[0]), functions)], "multiple", first)
    return MultiTurnVerdict(valid=v.valid, error_type=v.error_type, errors=list(v.errors), taxonomy=v.taxonomy,
                            turn=turn, details=details)


def held_out_names(case: Any) -> dict[int, set[str]]:
    """miss_func: {reveal turn: names of the functions held out until then}."""
    return {int(t): set(names) for t, names in (case.extra.get("missed_function_names") or {}).items()}


def _kept_steps(turn: Sequence[Step]) -> list[list[Call]]:
    """BFCL drops steps that failed to decode or decoded to no call (malformed calls count as undecoded)."""
    return [[Call.of(c) for c in step.calls] for step in turn if step.calls and is_well_formed(step.calls)]


def _missing(expected: list[str], produced: list[str]) -> list[str]:
    pool = list(produced)
    missing = []
    for item in expected:
        try:
            pool.remove(item)
        except ValueError:
            missing.append(item)
    return missing


def _in_order(expected: list[str], produced: list[str]) -> bool:
    it = iter(produced)
    return all(item in it for item in expected)


def _unavailable(calls: list[list[Call]], turn: int, held: dict[int, set[str]]) -> list[str]:
    hidden = set().union(*(names for t, names in held.items() if t > turn)) if held else set()
    return [c.name for step in calls for c in step if c.name in hidden]


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check(case: Any, result: MultiTurnResult, *, strict: bool = False,
          backends: Backends | None = None) -> MultiTurnVerdict:
    """BFCL's multi-turn verdict for `result` on `case` (strict: also BFCL's unused checks)."""
    gt_turns = case.ground_truth
    if result.error is not None:
        return _fail(INFERENCE_ERROR, f"the model could not be queried: {result.error}")
    if len(result.turns) != len(gt_turns):
        return _fail(FORCE_TERMINATED, f"the run has {len(result.turns)} turn(s), the ground truth "
                     f"{len(gt_turns)}: the model was force-terminated (more than {MAXIMUM_STEPS} steps in a turn) "
                     "or the run stopped", turn=len(result.turns) - 1 if result.turns else None)
    if strict and result.force_terminated:
        return _fail(FORCE_TERMINATED, f"the last turn went past {MAXIMUM_STEPS} steps", turn=len(gt_turns) - 1)
    try:
        gt_calls = ground_truth_calls(case)
    except ValueError as exc:
        return _fail(BACKEND_ERROR, f"unreadable ground truth in {case.id}: {exc}")
    backends = backends or shared()
    classes = _classes(case)
    config = case.extra.get("initial_config") or {}
    long_context = long_context_of(case)
    held = held_out_names(case) if strict else {}
    try:
        with backends.world(classes, config, long_context) as model, \
                backends.world(classes, config, long_context) as truth:
            return _check_turns(result, gt_calls, model, truth, strict, held)
    except BackendError as exc:
        return _fail(BACKEND_ERROR, f"the API simulators failed: {exc}")


def _check_turns(result: MultiTurnResult, gt_calls: list[list[Call]], model: Any, truth: Any, strict: bool,
                 held: dict[int, set[str]]) -> MultiTurnVerdict:
    all_results: list[str] = []
    for t, expected in enumerate(gt_calls):
        kept = _kept_steps(result.turns[t])
        turn_results = [r for step in kept for r in model.execute(step)]
        all_results.extend(turn_results)
        gt_results = truth.execute(expected)
        if expected and not kept:
            return _fail(EMPTY_TURN, f"turn {t}: no step decoded to a call, but the ground truth makes "
                         f"{len(expected)} call(s)", turn=t)
        if strict:
            early = _unavailable(kept, t, held)
            if early:
                return _fail(NOT_AVAILABLE, f"turn {t}: called {', '.join(sorted(set(early)))} before it was "
                             "made available", turn=t, calls=early)
        if not expected:
            if strict and kept:
                return _fail(IRRELEVANT_CALLS, f"turn {t}: {sum(len(s) for s in kept)} call(s) where the "
                             "ground truth expects none (the model should ask or point out a problem)", turn=t)
            continue
        diffs = model.differences(truth)
        if diffs:
            names = ", ".join(f"{d['class']}.{d['attribute']}" for d in diffs)
            return _fail(STATE_MISMATCH, f"turn {t}: state differs from the ground truth's in {names}", turn=t,
                         differences=diffs)
        missing = _missing(gt_results, all_results)
        if missing:
            return _fail(RESPONSE_MISMATCH, f"turn {t}: {len(missing)} ground-truth result(s) missing from the "
                         f"model's results: {_short(repr(missing))}", turn=t, missing=missing)
        if strict and not _in_order(gt_results, turn_results):
            return _fail(STRICT_RESPONSE, f"turn {t}: the ground truth's results are not all among this turn's "
                         "own results in the same order", turn=t)
    return VALID


def ground_truth_result(case: Any, backends: Backends | None = None) -> MultiTurnResult:
    """The ground-truth trajectory as a model run: one step per turn, keyword arguments only.

    Positional arguments of the ground truth are named from the simulators' signatures (a model
    calling tools sends names). A turn with an empty ground truth is a text-only step.
    """
    backends = backends or shared()
    signatures = backends.signatures(_classes(case))
    turns: list[list[Step]] = []
    for turn in ground_truth_calls(case):
        if not turn:
            turns.append([Step(decode_error="text answer", text="I cannot do that with the functions I have.")])
            continue
        calls = []
        for call in turn:
            params = signatures.get(call.name, [])
            if len(call.args) > len(params):
                raise ValueError(f"{case.id}: {call.render()} has more positional arguments than "
                                 f"{call.name} takes")
            calls.append({"name": call.name, "arguments": {**dict(zip(params, call.args)), **call.kwargs}})
        turns.append([Step(calls=calls)])
    return MultiTurnResult(case_id=case.id, turns=turns)


def summarize(items: Sequence[tuple[str, str, MultiTurnVerdict]]) -> dict[str, Any]:
    """Accuracy per (profile, category) and the error breakdown, from (profile, category, verdict) triples.

    Shape: {profile: {"n", "accuracy", "by_category": {category: {"n", "accuracy"}}, "errors": {kind: n}}},
    with "multi_turn_overall" in by_category = the unweighted mean over the categories (BFCL's rule).
    """
    out: dict[str, dict[str, Any]] = {}
    for profile, category, verdict in items:
        arm = out.setdefault(profile, {"n": 0, "correct": 0, "by_category": {}, "errors": {}})
        cat = arm["by_category"].setdefault(category, {"n": 0, "correct": 0})
        arm["n"] += 1
        cat["n"] += 1
        if verdict.valid:
            arm["correct"] += 1
            cat["correct"] += 1
        else:
            kind = verdict.taxonomy or verdict.error_type or "unknown"
            arm["errors"][kind] = arm["errors"].get(kind, 0) + 1
    for arm in out.values():
        arm["accuracy"] = arm.pop("correct") / arm["n"]
        for cat in arm["by_category"].values():
            cat["accuracy"] = cat.pop("correct") / cat["n"]
        accs = [c["accuracy"] for c in arm["by_category"].values()]
        arm["overall"] = sum(accs) / len(accs)
        arm["errors"] = dict(sorted(arm["errors"].items(), key=lambda kv: (-kv[1], kv[0])))
    return dict(sorted(out.items()))
