"""Multi-turn BFCL cases played by a scripted model: a case by id, its first user message (what the fake upstream's
`--trajectories` tells conversations apart by), a model run as the fake's scripted answers, and a ground-truth call
string as BFCL's possible answer."""

from __future__ import annotations

import ast
from typing import Any

from toolquake.scorers import multiturn as mt


def load(case_id: str) -> Any:
    from toolquake.bfcl.corpus import load_case

    return load_case(case_id)


def first_user(case: Any) -> str:
    return case.turns[0][0]["content"]


def scripted_turns(result: mt.MultiTurnResult) -> list[list[dict[str, Any]]]:
    """A model run as the fake's answers: each step's calls, then a text answer that ends the turn."""
    turns = []
    for steps in result.turns:
        answers = [{"calls": s.calls} for s in steps if s.calls]
        turns.append([*answers, {"text": "Done."}])
    return turns


def possible_answer(text: str, functions: list[dict[str, Any]]) -> dict[str, Any]:
    """A ground-truth call string as BFCL's possible answer (each argument its one value; dict values wrapped)."""
    node = ast.parse(text, mode="eval").body
    assert isinstance(node, ast.Call)
    doc = next(f for f in functions if f["name"] == node.func.id)
    order = list(doc["parameters"]["properties"])
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})

    def wrap(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: [wrap(x)] for k, x in v.items()}
        return [wrap(x) for x in v] if isinstance(v, list) else v

    return {node.func.id: {k: [wrap(v)] for k, v in args.items()}}
