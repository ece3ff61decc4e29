"""The per-case diffs: for each case whose verdict flipped, the perturbation applied, the arm's and the baseline's
calls, and the expected calls."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from toolquake.proxy.replay.report.rows import Results, stored_answers
from toolquake.proxy.replay.report.stats import BASELINE
from toolquake.proxy.replay.report.text import compact, short


def calls_text(answer: Any) -> str | None:
    """The model's calls in a stored answer, one `name(arguments)` per call (its text when it made none)."""
    if answer is None:
        return None
    if isinstance(answer, dict) and isinstance(answer.get("choices"), list) and answer["choices"]:
        message = (answer["choices"][0] or {}).get("message") or {}
        calls = message.get("tool_calls") or []
        if calls:
            return short("; ".join(f"{(c.get('function') or {}).get('name')}"
                                   f"({(c.get('function') or {}).get('arguments', '')})" for c in calls))
        return short(f"no call; text: {message.get('content') or ''!s}")
    return short(compact(answer))  # a multi-turn summary: {"turns": [[{"calls": [...]}, ...]], ...}


def perturbation_steps(perturbers: Any, spec: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The steps applied to this request, each {"name", "params", "report"} (what it added or changed, as the
    perturber reported it); the arm's defined steps (report None) when none were recorded as applied."""
    applied = perturbers.get("applied") if isinstance(perturbers, dict) else None
    if isinstance(applied, list) and applied:
        return [{"name": a.get("name"), "params": a.get("params") or {}, "report": a.get("report") or {}}
                for a in applied if isinstance(a, dict)]
    if isinstance(applied, dict) and applied:  # multi-turn: {name: steps applied}
        return [{"name": k, "params": {}, "report": {"steps_applied": v}} for k, v in applied.items()]
    return [{"name": a.get("name"), "params": a.get("params") or {}, "report": None}
            for a in (spec or {}).get("perturbers") or []]


def perturbation_text(perturbers: Any, spec: dict[str, Any] | None = None) -> str:
    """What was applied to this request (the stored `perturbers`: each step's parameters, then what it
    reported doing after `→`), else the arm's definition."""
    applied = perturbers.get("applied") if isinstance(perturbers, dict) else None
    if isinstance(applied, dict) and applied:  # multi-turn: {name: steps applied}
        return short("; ".join(f"{k} on {v} step(s)" for k, v in applied.items()))
    steps = perturbation_steps(perturbers, spec)
    if not steps:
        return "none"
    # parameters left empty (no generator URL, no cache dir, ...) say nothing about what was applied
    text = "; ".join(f"{a['name']}({compact({k: v for k, v in a['params'].items() if v not in ('', None)})})"
                     + (f" → {compact(a['report'])}" if a["report"] else "") for a in steps)
    recorded = isinstance(applied, list) and bool(applied)
    return short(text + ("" if recorded or perturbers is None else " (defined; none recorded as applied)"))


def _expected_calls(case_id: str) -> str | None:
    try:
        from toolquake.bfcl.corpus import is_present, load_case

        if not is_present():
            return None
        return short(compact(load_case(case_id).ground_truth))
    except Exception:  # no corpus, an unknown id, a corpus that cannot be read: the column is omitted
        return None


def case_details(res: Results, found: list[dict[str, Any]], baseline: str = BASELINE,
                 expected: bool = True) -> list[dict[str, Any]]:
    """The flips with what happened: the perturbation applied, the arm's and the baseline's calls, and the
    expected calls (from the BFCL corpus when it is on this machine and `expected`; else None)."""
    wanted: dict[int, set[tuple[str, str]]] = defaultdict(set)
    for f in found:
        arm_src, base_src = f["_sources"]
        wanted[arm_src].add((f["profile"], f["case_id"]))
        wanted[base_src].add((baseline, f["case_id"]))
    stored = stored_answers(res, wanted)
    out = []
    for f in found:
        arm_src, base_src = f["_sources"]
        answer, perturbers = stored.get((arm_src, f["profile"], f["case_id"]), (None, None))
        base_answer, _ = stored.get((base_src, baseline, f["case_id"]), (None, None))
        entry = {k: v for k, v in f.items() if not k.startswith("_")}
        spec = res.arms.get((f["model"], f["profile"]))
        entry["perturbation"] = perturbation_text(perturbers, spec)
        entry["perturbation_steps"] = perturbation_steps(perturbers, spec)
        entry["calls"] = calls_text(answer)
        entry["baseline_calls"] = calls_text(base_answer)
        entry["expected"] = _expected_calls(f["case_id"]) if expected else None
        out.append(entry)
    return out
