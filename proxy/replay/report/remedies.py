"""The report's `remedies` section: what a remedy (remedies/: tool search, response trimming, a call format) wins
back, measured on the same cases as the perturbation it answers.

A remedied arm (a profile with `remedies`) is paired with its twin, the arm with the same perturbation steps and no
remedies (`off` itself for a profile that holds only remedies), and with the baseline. On the cases all three
scored (trial 0): the accuracy of each with its Wilson interval; the share of the loss won back,
(acc_remedied − acc_perturbed) / (acc_off − acc_perturbed), with Fieller's interval (`loss_won_back`,
scorers/aggregate.py), undefined (null, with why) when the perturbation lost nothing; McNemar's exact test of the
remedied arm against its twin, with the cases it won (wrong perturbed, right remedied) and lost; the tokens it saved
per request (what its steps report they cut, `tokens_before` − `tokens_after`, by the proxy's counter; for a remedy
that reports no tokens, the twin's prompt tokens minus the remedied arm's, as the backend counted them); and the
cases where it dropped a tool the case's ground truth needs (`dropped_needed` in the remedy step's report, recorded
by the proxy when it knew the case).

`summarize` adds it under "remedies"; `tables` gives its table (Markdown and HTML); the CSV appends `csv_columns`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from toolquake.proxy.replay.report.rows import Results, Row, pair_usage
from toolquake.proxy.replay.report.text import p_text, pct_ci
from toolquake.scorers.aggregate import ALPHA, loss_won_back, mcnemar, ratio, wilson_ci

#: why a remedy's share of the loss won back is null
NO_LOSS = "no loss to win back: the perturbed arm scored at least as well as the baseline on these cases"
UNBOUNDED = "the loss is not distinguishable from 0 on these cases: the interval is unbounded"
NO_TWIN = "no arm with the same perturbation and no remedy in these results"


def _steps_key(steps: list[dict[str, Any]]) -> str:
    """An arm's perturbation steps by name and parameters (their probability aside), comparable between arms."""
    return json.dumps([[s.get("name"), s.get("params") or {}] for s in steps], sort_keys=True, default=str)


def twin_of(arms: dict[str, dict[str, Any]], profile: str, baseline: str) -> str | None:
    """The unremedied twin of a remedied arm: the first arm with the same perturbation steps and no remedies; the
    baseline for an arm of remedies only; None when these results hold no such arm."""
    steps = arms[profile].get("perturbers") or []
    if not steps:
        return baseline if baseline in arms else None
    key = _steps_key(steps)
    return next((p for p, a in arms.items() if p != profile and not a.get("remedies")
                 and _steps_key(a.get("perturbers") or []) == key), None)


def _verdicts(rows: list[Row]) -> dict[str, bool]:
    """{case id: valid} of an arm's scored rows of trial 0 (the latest of a case answered twice)."""
    return {r.case_id: bool(r.valid) for r in rows if r.trial == 0 and r.status == "scored" and r.case_id}


def _rate(k: int, n: int) -> tuple[float | None, list[float] | None]:
    return ratio(k, n), wilson_ci(k, n)


def remedy_numbers(res: Results, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per remedied arm of each model (see the module docstring), in the arms' order."""
    baseline = summary["baseline"]
    by_arm: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in res.rows:
        by_arm[(r.model, r.profile)].append(r)
    plans = []
    for model, data in summary["models"].items():
        arms = data["arms"]
        for p, arm in arms.items():
            if arm.get("remedies"):
                plans.append((model, p, twin_of(arms, p, baseline)))
    if not plans:
        return []
    usage = pair_usage(res, {(m, p) for m, p, _ in plans} | {(m, t) for m, _, t in plans if t})
    return [_entry(model, p, twin, baseline, summary["models"][model]["arms"][p], by_arm, usage)
            for model, p, twin in plans]


def _entry(model: str, profile: str, twin: str | None, baseline: str, arm: dict[str, Any],
           by_arm: dict[tuple[str, str], list[Row]], usage: dict[tuple[str, str, str], tuple[int | None, Any]]
           ) -> dict[str, Any]:
    remedied = _verdicts(by_arm.get((model, profile), []))
    off = _verdicts(by_arm.get((model, baseline), []))
    perturbed = _verdicts(by_arm.get((model, twin), [])) if twin else {}
    cases = sorted(c for c in remedied if c in off and c in perturbed)
    triples = [(off[c], perturbed[c], remedied[c]) for c in cases]
    n = len(cases)
    won = sum(1 for _, p, r in triples if r and not p)
    lost = sum(1 for _, p, r in triples if p and not r)
    share, interval = loss_won_back(triples)
    note = (NO_TWIN if twin is None else None if n == 0 else NO_LOSS if share is None
            else UNBOUNDED if interval is None else None)
    acc_off, off_ci = _rate(sum(1 for o, _, _ in triples if o), n)
    acc_pert, pert_ci = _rate(sum(1 for _, p, _ in triples if p), n)
    acc_rem, rem_ci = _rate(sum(1 for _, _, r in triples if r), n)
    p_value = mcnemar(lost, won) if n else None
    saved = [x for x in (_saved(usage, model, twin, profile, c) for c in cases) if x is not None]
    dropped = _dropped_needed([usage[(model, profile, c)][1] for c in remedied if (model, profile, c) in usage])
    return {
        "model": model, "profile": profile, "remedies": [r.get("name") for r in arm.get("remedies") or []],
        "remedy_params": [r.get("params") or {} for r in arm.get("remedies") or []],
        "perturbation": [s.get("name") for s in arm.get("perturbers") or []], "twin": twin, "baseline": baseline,
        "n": n, "accuracy_off": acc_off, "accuracy_off_ci": off_ci, "accuracy_perturbed": acc_pert,
        "accuracy_perturbed_ci": pert_ci, "accuracy_remedied": acc_rem, "accuracy_remedied_ci": rem_ci,
        "won_back": share, "won_back_ci": None if interval is None else list(interval), "won_back_note": note,
        "cases_won": won, "cases_lost": lost, "p_value": p_value,
        "significant": None if p_value is None else p_value < ALPHA,
        "tokens_saved": ratio(sum(saved), len(saved)), "tokens_saved_cases": len(saved), **dropped,
    }


def _report(step: dict[str, Any]) -> dict[str, Any]:
    """A recorded remedy step's report ({} when it is not a remedy's, or not an object)."""
    report = step.get("report") if step.get("kind") == "remedy" else None
    return report if isinstance(report, dict) else {}


def _saved(usage: dict[tuple[str, str, str], tuple[int | None, Any]], model: str, twin: str | None, profile: str,
           case: str) -> int | None:
    """The request tokens a remedy saved on one case: what its steps say they cut (`tokens_before` −
    `tokens_after` in a remedy's report, by the proxy's counter) when they say it, else the prompt tokens the backend
    counted for the twin's request minus the remedied one's; None when neither is known."""
    tokens, steps = usage.get((model, profile, case), (None, []))
    cut = [r for r in map(_report, steps) if isinstance(r.get("tokens_before"), int)
           and isinstance(r.get("tokens_after"), int)]
    if cut:
        return sum(r["tokens_before"] - r["tokens_after"] for r in cut)
    before = usage.get((model, twin or "", case), (None, []))[0]
    return None if before is None or tokens is None else before - tokens


def _dropped_needed(recorded: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Over an arm's recorded pairs: how many had a remedy step whose report says which needed tools it dropped
    (`dropped_needed`: the proxy knew the case), and in how many of those it dropped at least one."""
    known = hit = 0
    for steps in recorded:
        found = [r["dropped_needed"] for r in map(_report, steps) if "dropped_needed" in r]
        if found:
            known += 1
            hit += any(bool(d) for d in found)
    return {"needed_dropped": hit if known else None, "needed_dropped_known": known}


def _share_text(e: dict[str, Any]) -> str:
    if e["won_back"] is None:
        return "undefined (no loss)" if e["won_back_note"] == NO_LOSS else "–"
    ci = e["won_back_ci"]
    return f"{e['won_back'] * 100:.0f} %" + (" [unbounded]" if ci is None else
                                            f" [{ci[0] * 100:.0f}, {ci[1] * 100:.0f}]")


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The remedies table (title, header, rows); none when the report has no remedied arm."""
    entries = summary.get("remedies") or []
    if not entries:
        return []
    baseline = summary["baseline"]
    rows = []
    for e in entries:
        rows.append([e["model"], " + ".join(map(str, e["remedies"])), e["profile"], e["twin"] or "–", str(e["n"]),
                     pct_ci(e["accuracy_off"], e["accuracy_off_ci"]),
                     pct_ci(e["accuracy_perturbed"], e["accuracy_perturbed_ci"]),
                     pct_ci(e["accuracy_remedied"], e["accuracy_remedied_ci"]), _share_text(e),
                     str(e["cases_won"]), str(e["cases_lost"]), p_text(e["p_value"]),
                     "–" if e["tokens_saved"] is None else f"{e['tokens_saved']:.0f}",
                     "–" if e["needed_dropped"] is None else f"{e['needed_dropped']}/{e['needed_dropped_known']}"])
    return [(f"Remedies: accuracy on the same cases in `{baseline}`, perturbed (the twin: the same perturbation, no "
             "remedy) and remedied; the share of the loss won back, (remedied − perturbed) / "
             f"({baseline} − perturbed), with Fieller's 95 % interval (undefined where the perturbation lost "
             "nothing); McNemar of remedied against perturbed, the cases won and lost; prompt tokens saved per "
             "request; cases where the remedy dropped a tool the ground truth needs (of the cases the proxy knew)",
             ["model", "remedy", "profile", "twin (perturbed)", "paired cases", f"{baseline} [95 % CI]",
              "perturbed [95 % CI]", "remedied [95 % CI]", "loss won back [95 % CI]", "cases won", "cases lost",
              "McNemar p", "tokens saved / request", "needed tool dropped"], rows)]


#: the columns the CSV appends when the results hold a remedied arm (empty cells on the other arms)
CSV_COLUMNS = ["Remedy", "Twin", "Loss Won Back", "Won Back CI Low", "Won Back CI High", "Cases Won", "Cases Lost",
               "Remedy McNemar p", "Tokens Saved", "Needed Tool Dropped"]


def csv_columns(summary: dict[str, Any]) -> list[str]:
    return CSV_COLUMNS if summary.get("remedies") else []


def csv_cells(summary: dict[str, Any], model: str, profile: str) -> list[Any]:
    if not csv_columns(summary):
        return []
    e = next((x for x in summary["remedies"] if x["model"] == model and x["profile"] == profile), None)
    if e is None:
        return ["N/A"] * len(CSV_COLUMNS)
    lo, hi = e["won_back_ci"] or (None, None)
    return ["+".join(map(str, e["remedies"])), e["twin"] or "N/A",
            *("N/A" if x is None else f"{x * 100:.2f}%" for x in (e["won_back"], lo, hi)), e["cases_won"],
            e["cases_lost"], "N/A" if e["p_value"] is None else f"{e['p_value']:.6g}",
            "N/A" if e["tokens_saved"] is None else f"{e['tokens_saved']:.1f}",
            "N/A" if e["needed_dropped"] is None else e["needed_dropped"]]
