"""Report sections for the perturbation families of issue #19: accuracy per kind against the baseline
(`@faults`, `@metadata`), and the recovery after failed tool results that multi-turn replays score.

`summarize` adds `recovery` and `families` to the JSON report; `tables` adds their tables (Markdown and HTML);
the CSV appends `csv_columns` / `csv_cells`.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

from toolquake.proxy.replay.report.arms import axes_of, experiment_of, remedied
from toolquake.proxy.replay.report.rows import Results, scored_steps
from toolquake.proxy.replay.report.text import drop_ci, p_text, pct_ci
from toolquake.scorers.aggregate import ratio, wilson_ci
from toolquake.scorers.recovery import VERDICTS

#: the experiments reported as families (`Perturber.experiment`): an arm of one step of such an experiment is
#: reported per the value of its perturber's first axis (its `kind`)
FAMILIES = ("faults", "metadata")


def _family(perturbers: list[dict[str, Any]]) -> tuple[str, str] | None:
    if len(perturbers) != 1 or experiment_of(perturbers[0]) not in FAMILIES:
        return None
    step = perturbers[0]
    axes = axes_of(step)
    return experiment_of(step), (str((step.get("params") or {}).get(axes[0], "")) if axes else "")


def _recovery_entries(res: Results) -> tuple[dict[tuple[str, str], list[dict[str, Any]]],
                                             dict[tuple[str, str], set[str]]]:
    """The `recovery` entries stored with scored rows, per (model, profile), each (model, profile, case) once."""
    seen: set[tuple[str, str, str]] = set()
    entries: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    cases: dict[tuple[str, str], set[str]] = defaultdict(set)
    for model, profile, case_id, perturbers in scored_steps(res):
        if (model, profile, case_id) in seen:
            continue
        seen.add((model, profile, case_id))
        try:
            found = (json.loads(perturbers) or {}).get("recovery") if perturbers else None
        except ValueError:
            found = None
        if isinstance(found, list) and found:
            entries[(model, profile)] += [e for e in found if isinstance(e, dict)]
            cases[(model, profile)].add(case_id)
    return entries, cases


def recovery_numbers(res: Results) -> dict[str, Any]:
    """{"models": {model: {profile: {kind, cases, failures, recovered, recovered_share, recovered_ci, verdicts,
    errors}}}} from the `recovery` verdicts of scored multi-turn rows (each (model, profile, case) once)."""
    entries, cases = _recovery_entries(res)
    models: dict[str, dict[str, Any]] = {}
    for (model, profile), found in entries.items():
        judged = [e for e in found if "verdict" in e]
        recovered = sum(1 for e in judged if e.get("recovered"))
        verdicts = Counter(str(e["verdict"]) for e in judged)
        models.setdefault(model, {})[profile] = {
            "kind": ", ".join(sorted({str(e.get("kind")) for e in judged})),
            "cases": len(cases[(model, profile)]),
            "failures": len(judged),
            "recovered": recovered,
            "recovered_share": ratio(recovered, len(judged)),
            "recovered_ci": wilson_ci(recovered, len(judged)),
            "verdicts": {v: verdicts[v] for v in (*VERDICTS, *sorted(set(verdicts) - set(VERDICTS))) if verdicts[v]},
            "errors": len(found) - len(judged),
        }
    return {"models": models}


def family_numbers(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per arm of a family (model, family, kind, profile) with its accuracy and drop against the
    baseline, family by family in the arms' order."""
    out = []
    for model, data in summary["models"].items():
        for p, arm in data["arms"].items():
            fam = None if remedied(arm) else _family(arm.get("perturbers") or [])
            if fam is None:
                continue
            cmp = arm.get("paired") or {}
            out.append({"model": model, "family": fam[0], "kind": fam[1], "profile": p, "n": arm["n"],
                        "not_comparable": dict(arm.get("not_comparable") or {}),
                        "accuracy": arm["accuracy"], "accuracy_ci": arm.get("accuracy_ci"),
                        "drop_vs_off": arm.get("drop_vs_off"), "drop_vs_off_ci": arm.get("drop_vs_off_ci"),
                        "valid_to_invalid": cmp.get("valid_to_invalid"),
                        "invalid_to_valid": cmp.get("invalid_to_valid"), "p_value": cmp.get("p_value")})
    out.sort(key=lambda e: (e["model"], e["family"]))
    return out


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The family and recovery tables (title, header, rows); none when the report has no such arm."""
    return [*_family_table(summary), *_recovery_table(summary)]


def _family_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    baseline = summary["baseline"]
    rows = []
    for e in summary.get("families") or []:
        rows.append([e["model"], e["family"], e["kind"], e["profile"], str(e["n"]), pct_ci(e["accuracy"],
                     e["accuracy_ci"]), drop_ci(e["drop_vs_off"], e["drop_vs_off_ci"]),
                     "" if e["valid_to_invalid"] is None else str(e["valid_to_invalid"]),
                     "" if e["invalid_to_valid"] is None else str(e["invalid_to_valid"]),
                     "" if e["p_value"] is None else p_text(e["p_value"]),
                     str(sum((e.get("not_comparable") or {}).values()))])
    if not rows:
        return []
    return [(f"Perturbation families: accuracy per kind against `{baseline}` (failed tool results, "
             "misleading tool metadata; 95 % intervals; pairs the backend refused for the request's shape are "
             "not comparable, in no number)",
             ["model", "family", "kind", "profile", "n", "accuracy [95 % CI]", f"drop vs {baseline} [95 % CI]",
              "valid→invalid", "invalid→valid", "McNemar p", "not comparable"], rows)]


def _recovery_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    recovery = (summary.get("recovery") or {}).get("models") or {}
    seen = [v for arms in recovery.values() for arm in arms.values() for v in arm["verdicts"]]
    cols = [v for v in VERDICTS if v in seen] + sorted(set(seen) - set(VERDICTS))
    rows = []
    for model, arms in recovery.items():
        for p, arm in arms.items():
            rows.append([model, p, arm["kind"], str(arm["cases"]), str(arm["failures"]),
                         pct_ci(arm["recovered_share"], arm["recovered_ci"]),
                         *(str(arm["verdicts"].get(c, 0)) for c in cols)])
    if not rows:
        return []
    return [("Recovery after failed tool results (multi-turn replay: answers after an injected failure that "
             "did what its kind calls for; 95 % Wilson intervals; docs/perturbers-faults.md)",
             ["model", "profile", "kind", "cases", "failures", "recovered [95 % CI]", *cols], rows)]


#: the columns the CSV appends when the results hold recovery verdicts
CSV_COLUMNS = ["Tool Failure Recovered", "Recovered CI Low", "Recovered CI High", "Tool Failures"]


def csv_columns(summary: dict[str, Any]) -> list[str]:
    return CSV_COLUMNS if (summary.get("recovery") or {}).get("models") else []


def csv_cells(summary: dict[str, Any], model: str, profile: str) -> list[Any]:
    if not csv_columns(summary):
        return []
    arm = summary["recovery"]["models"].get(model, {}).get(profile)
    if arm is None:
        return ["N/A"] * len(CSV_COLUMNS)
    lo, hi = arm["recovered_ci"] or (None, None)
    return [*("N/A" if x is None else f"{x * 100:.2f}%" for x in (arm["recovered_share"], lo, hi)), arm["failures"]]
