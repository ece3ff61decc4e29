"""Statistics: each arm's accuracy with its intervals, categories, error types and failed pairs; the paired test
against the baseline; repeated trials; the cases whose verdict flipped.

A pair whose request failed on the backend's side (refused, timed out after retries, unreadable: replay scores it
as BFCL scores an inference error, proxy/replay/failures.py) is a scored, invalid pair with its `error_code`: it
counts in the accuracy, the intervals and the paired tests, and `failed` / `failed_codes` say how many and why;
`answered_accuracy` is the accuracy over the other pairs. A pair the backend refused for the request's shape (a
hosted API's validation: too many tools, a parameter it does not take; failures.REFUSALS) has no verdict: it is
in none of the numbers, and `not_comparable` counts it by code. Pairs not scored yet (toolquake's or the network's
failures, retried on the next run) are in none of the numbers: `unscored` / `unscored_codes`, so an arm whose
perturber could not run never shows up as a drop. With repeated trials, every number
but `trials` is trial 0's (one answer per case: the tests assume independent cases).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.replay.failures import NOT_COMPARABLE
from toolquake.proxy.replay.report.rows import Results, Row
from toolquake.scorers.aggregate import (
    ALPHA,
    mcnemar,
    paired_drop_ci,
    pass_at_k,
    pass_hat_k,
    ratio,
    relative_drop,
    spread,
    wilson_ci,
)

BASELINE = "off"


def perturbed_counts(rows: list[Any]) -> dict[str, Any]:
    """An arm's pairs left unperturbed on purpose, and the share of its answered pairs that were perturbed."""
    scored = sum(1 for r in rows if r.status == "scored")
    kept = sum(1 for r in rows if r.status == NOT_PERTURBED)
    return {"not_perturbed": kept, "perturbed_share": ratio(scored, scored + kept)}


def arm_numbers(rows: list[Row]) -> dict[str, Any]:
    scored = [r for r in rows if r.status == "scored"]
    valid = sum(1 for r in scored if r.valid)
    by_cat: dict[str, list[Row]] = defaultdict(list)
    for r in scored:
        by_cat[r.category].append(r)
    refused_by_cat = Counter(r.category for r in rows if r.status == NOT_COMPARABLE)
    for c in refused_by_cat:
        by_cat.setdefault(c, [])
    errors = Counter(r.taxonomy or r.error_type or "unknown" for r in scored if not r.valid)
    failed = Counter(r.error_code for r in scored if r.error_code)
    unscored = Counter(r.error_code or "unknown" for r in rows
                       if r.status not in ("scored", NOT_PERTURBED, NOT_COMPARABLE))
    refused = Counter(r.error_code or "unknown" for r in rows if r.status == NOT_COMPARABLE)
    answered = [r for r in scored if not r.error_code]
    answered_valid = sum(1 for r in answered if r.valid)
    fair = [r for r in scored if r.fair_valid is not None]
    fair_valid = sum(1 for r in fair if r.fair_valid)
    has_semantic = any(r.semantic_valid is not None for r in scored)
    semantic_valid = sum(1 for r in scored if r.valid or r.semantic_valid)
    failures = len(scored) - valid
    return {
        "n": len(scored),
        "accuracy": ratio(valid, len(scored)),
        "accuracy_ci": wilson_ci(valid, len(scored)),
        "by_category": {c: {"n": len(rs), "accuracy": ratio(sum(1 for r in rs if r.valid), len(rs)),
                            "accuracy_ci": wilson_ci(sum(1 for r in rs if r.valid), len(rs)),
                            "failed": sum(1 for r in rs if r.error_code),
                            "not_comparable": refused_by_cat.get(c, 0)}
                        for c, rs in sorted(by_cat.items())},
        "errors": dict(sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))),
        # Wilson interval of each error type's share among the arm's failures
        "errors_ci": {k: wilson_ci(v, failures) for k, v in sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))},
        "failed": sum(failed.values()),
        **perturbed_counts(rows),
        "failed_codes": dict(sorted(failed.items())),
        "answered": len(answered),
        "answered_accuracy": ratio(answered_valid, len(answered)),
        "answered_accuracy_ci": wilson_ci(answered_valid, len(answered)),
        # refused by the backend for the request's shape: no verdict, out of n and of every statistic
        "not_comparable": dict(sorted(refused.items())),
        "unscored": sum(unscored.values()),
        "unscored_codes": dict(sorted(unscored.items())),
        "final_call": final_call_numbers(scored),
        "next_call": next_call_numbers(scored),
        "fair_accuracy": ratio(fair_valid, len(fair)) if fair else None,
        "fair_accuracy_ci": wilson_ci(fair_valid, len(fair)) if fair else None,
        # semantic mode was only asked for invalid BFCL verdicts: valid ones stay valid
        "semantic_accuracy": ratio(semantic_valid, len(scored)) if has_semantic else None,
        "semantic_accuracy_ci": wilson_ci(semantic_valid, len(scored)) if has_semantic else None,
        # failures the semantic mode would have passed
        "semantic_flips": sum(1 for r in scored if not r.valid and r.semantic_valid),
    }


def final_call_numbers(scored: list[Row]) -> dict[str, Any] | None:
    """Seed 003 challenge 3's AST verdict on each conversation's last turn, over the arm's scored multi-turn rows
    that have one: {"n", "valid", "accuracy", "accuracy_ci"}, and BFCL's whole-conversation verdict over the same
    rows (`bfcl_accuracy`, `bfcl_accuracy_ci`); None when no row has one."""
    mine = [r for r in scored if r.final_valid is not None]
    if not mine:
        return None
    valid, bfcl = sum(1 for r in mine if r.final_valid), sum(1 for r in mine if r.valid)
    return {"n": len(mine), "valid": valid, "accuracy": ratio(valid, len(mine)),
            "accuracy_ci": wilson_ci(valid, len(mine)), "bfcl_accuracy": ratio(bfcl, len(mine)),
            "bfcl_accuracy_ci": wilson_ci(bfcl, len(mine))}


def next_call_numbers(scored: list[Row]) -> dict[str, Any] | None:
    """Seed 003 challenge 3 as the paper measures it: the AST verdict on the next call of each given conversation
    (the row's own verdict), {"n", "valid", "accuracy", "accuracy_ci"}, and the same apart for the last turns whose
    ground truth makes one call or none (`one_call`) and several (`multi_call`: only the first is graded); None when
    no row is a given conversation."""
    mine = [r for r in scored if r.next_expected is not None]
    if not mine:
        return None

    def numbers(rows: list[Row]) -> dict[str, Any]:
        valid = sum(1 for r in rows if r.valid)
        return {"n": len(rows), "valid": valid, "accuracy": ratio(valid, len(rows)),
                "accuracy_ci": wilson_ci(valid, len(rows))}

    return {**numbers(mine), "one_call": numbers([r for r in mine if (r.next_expected or 0) <= 1]),
            "multi_call": numbers([r for r in mine if (r.next_expected or 0) > 1])}


def paired(base: dict[str, bool], arm: dict[str, bool]) -> dict[str, Any]:
    """The arm against the baseline on the cases both scored ({case id: valid} each): the 2×2 table,
    McNemar's exact p-value, both accuracies on these cases, and the relative drop on them with its approximate
    95 % interval."""
    cases = [c for c in arm if c in base]
    both = sum(1 for c in cases if base[c] and arm[c])
    lost = sum(1 for c in cases if base[c] and not arm[c])
    gained = sum(1 for c in cases if not base[c] and arm[c])
    neither = len(cases) - both - lost - gained
    p = mcnemar(lost, gained)
    ci = paired_drop_ci(both, lost, gained, neither)
    return {"n": len(cases), "both_valid": both, "valid_to_invalid": lost, "invalid_to_valid": gained,
            "both_invalid": neither, "p_value": p, "significant": p < ALPHA,
            "accuracy": ratio(both + gained, len(cases)), "baseline_accuracy": ratio(both + lost, len(cases)),
            "drop": relative_drop(ratio(both + gained, len(cases)), ratio(both + lost, len(cases))),
            "drop_ci": None if ci is None else list(ci)}


def _verdicts(rows: list[Row], category: str | None = None) -> dict[str, bool]:
    """{case id: valid} of the scored rows, the latest of a case answered more than once (live traffic)."""
    return {r.case_id: bool(r.valid) for r in rows if r.status == "scored" and r.case_id and
            (category is None or r.category == category)}


def with_drops(arms: dict[str, dict[str, Any]], baseline: str, rows: dict[str, list[Row]] | None = None) -> None:
    """Each arm's relative drop against the baseline, overall and per category, paired: on the cases both scored
    (an arm that left some pairs unperturbed, or has pairs not scored yet, is compared on its own cases only).
    Arms that share no case (live traffic where no case came through both profiles yet) get the relative
    difference of their accuracies, without an interval or a test."""
    base = arms.get(baseline)
    rows = rows or {}
    base_rows = rows.get(baseline, [])
    for p, arm in arms.items():
        cmp = paired(_verdicts(base_rows), _verdicts(rows.get(p, []))) if base and p != baseline else None
        arm["drop_vs_off"] = (cmp["drop"] if cmp and cmp["n"] else
                              relative_drop(arm["accuracy"], base["accuracy"] if base else None))
        arm["paired"] = cmp
        arm["drop_vs_off_ci"] = cmp["drop_ci"] if cmp else None
        for name, cat in arm["by_category"].items():
            b = base["by_category"].get(name) if base else None
            cat_cmp = (paired(_verdicts(base_rows, name), _verdicts(rows.get(p, []), name))
                       if b and p != baseline else None)
            cat["drop_vs_off"] = (cat_cmp["drop"] if cat_cmp and cat_cmp["n"] else
                                  relative_drop(cat["accuracy"], b["accuracy"] if b else None))
            cat["drop_vs_off_ci"] = cat_cmp["drop_ci"] if cat_cmp else None


def arms_summary(res: Results, baseline: str = BASELINE) -> dict[str, Any]:
    """The report's core: {"arms", "models", "baseline", "sources", "duplicates", "flips"} (see `summarize`)."""
    by_arm: dict[tuple[str, str], list[Row]] = defaultdict(list)
    all_trials: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in res.rows:
        all_trials[(r.model, r.profile)].append(r)
        if r.trial == 0:
            by_arm[(r.model, r.profile)].append(r)
    models: dict[str, dict[str, Any]] = {}
    for model in res.models:
        arms = {p: arm_numbers(by_arm.get((model, p), [])) for p in res.profiles(model)}
        with_drops(arms, baseline, {p: by_arm.get((model, p), []) for p in res.profiles(model)})
        for p, arm in arms.items():
            arm["perturbers"] = res.arms[(model, p)].get("perturbers", [])
            arm["remedies"] = res.arms[(model, p)].get("remedies", [])
            arm["conversation"] = res.arms[(model, p)].get("conversation", "played")
            arm["trials"] = trial_numbers(all_trials.get((model, p), []))
            arm["source"] = "live" if model in res.live_rows else "replay"
        models[model] = {"arms": arms}
    single = len(models) == 1
    flat = {(p if single else f"{p} [{m}]"): arm for m, data in models.items() for p, arm in data["arms"].items()}
    return {"arms": flat, "models": models, "baseline": baseline, "sources": [str(s) for s in res.sources],
            "duplicates": res.duplicates,
            "flips": [{k: v for k, v in f.items() if not k.startswith("_")} for f in flips(res, baseline)]}


def trial_numbers(rows: list[Row]) -> dict[str, Any] | None:
    """Repeated trials of one arm (None with a single trial): each trial's accuracy, their mean and spread,
    and pass^k / pass@k for k = 1..K over the cases (tau-bench's definitions, `scorers/aggregate.py`)."""
    scored = [r for r in rows if r.status == "scored"]
    k_max = max((r.trial for r in rows), default=0) + 1
    if k_max < 2:
        return None
    per_trial = []
    for t in range(k_max):
        mine = [r for r in scored if r.trial == t]
        per_trial.append({"trial": t, "n": len(mine), "accuracy": ratio(sum(1 for r in mine if r.valid), len(mine))})
    by_case: dict[str, list[bool]] = defaultdict(list)
    for r in scored:
        by_case[r.case_id].append(bool(r.valid))
    counts = [(len(v), sum(v)) for v in by_case.values()]
    accs = [t["accuracy"] for t in per_trial if t["accuracy"] is not None]
    return {"k": k_max, "cases": len(by_case), "complete_cases": sum(1 for n, _ in counts if n == k_max),
            "per_trial": per_trial, "accuracy": spread(accs),
            "pass_hat_k": {str(k): pass_hat_k(counts, k) for k in range(1, k_max + 1)},
            "pass_at_k": {str(k): pass_at_k(counts, k) for k in range(1, k_max + 1)}}


def flips(res: Results, baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Every case whose verdict differs between an arm and the baseline (both scored), arm by arm.

    `direction` is valid_to_invalid (the perturbation broke it) or invalid_to_valid; `error_type` is the
    invalid side's (the arm's, or the baseline's for invalid_to_valid).
    """
    # the latest verdict of each case (a live store may hold several), as the paired comparison reads them
    by_key = {(r.model, r.profile, r.case_id): r for r in res.rows if r.trial == 0 and r.status == "scored"
              and r.case_id}
    out = []
    for model in res.models:
        for p in res.profiles(model):
            if p == baseline:
                continue
            for r in by_key.values():
                if r.model != model or r.profile != p:
                    continue
                base = by_key.get((model, baseline, r.case_id))
                if base is None or bool(base.valid) == bool(r.valid):
                    continue
                wrong = base if r.valid else r
                out.append({"model": model, "profile": p, "case_id": r.case_id, "category": r.category,
                            "direction": "invalid_to_valid" if r.valid else "valid_to_invalid",
                            "error_type": wrong.taxonomy or wrong.error_type or "unknown",
                            "_sources": (r.source, base.source)})
    return out
