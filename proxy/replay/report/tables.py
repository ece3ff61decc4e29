"""The report's tables, each (title, header, rows) of text cells, in the order every format shows them: the summary
(largest drop first), repeated trials, accuracy per arm, error types, arms in the three scoring modes, categories,
then the families' and the papers' tables."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from toolquake.proxy.replay.report.families import tables as family_tables
from toolquake.proxy.replay.report.live import tables as live_tables
from toolquake.proxy.replay.report.paper_tables import tables as paper_tables
from toolquake.proxy.replay.report.remedies import tables as remedy_tables
from toolquake.proxy.replay.report.stats import ALPHA
from toolquake.proxy.replay.report.sweeps import INF
from toolquake.proxy.replay.report.text import acc, ci, compact, drop_ci, p_text, pct_ci, rel
from toolquake.scorers.aggregate import wilson_ci
from toolquake.scorers.taxonomy import TAXONOMY


def _spec_text(perturbers: list[dict[str, Any]], remedies: list[dict[str, Any]] | None = None) -> str:
    """An arm's steps in one cell; a remedied arm's remedies after them, labelled (`… + remedy tool_search(…)`)."""
    text = "; ".join(f"{a.get('name')}({compact(a.get('params') or {})})" for a in perturbers) or "none"
    text = text if len(text) <= 120 else text[:120] + " …"
    return text + "".join(f" + remedy {r.get('name')}({compact(r.get('params') or {})})" for r in remedies or [])


def report_title(summary: dict[str, Any]) -> str:
    """The report's title, after what its results files hold: replays, sweeps (`toolquake sweep`), or both."""
    sweeps = bool(summary.get("sweeps"))
    sources = {a.get("source", "replay") for a in summary.get("arms", {}).values()}
    if "db" in summary:
        sources.add("live")
    kinds = [k for k in ("live", "replay") if k in sources] + (["sweep"] if sweeps else [])
    return f"toolquake {' and '.join(kinds) or 'replay'} report"


def summary_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Which perturbations hurt this model most: the arms against the baseline, largest drop first."""
    baseline = summary["baseline"]
    entries = [(m, p, a) for m, data in summary["models"].items() for p, a in data["arms"].items()
               if p != baseline and a.get("paired")]
    entries.sort(key=lambda e: (e[2]["drop_vs_off"] is None, e[2]["drop_vs_off"] or 0.0, e[0], e[1]))
    rows = []
    for model, p, arm in entries:
        cmp = arm["paired"]
        rows.append([model, p, _spec_text(arm.get("perturbers") or [], arm.get("remedies")),
                     pct_ci(arm["accuracy"], arm["accuracy_ci"]),
                     codes_text(arm["failed"], arm["failed_codes"]), not_comparable_text(arm),
                     drop_ci(arm["drop_vs_off"], arm["drop_vs_off_ci"]), str(cmp["n"]),
                     str(cmp["valid_to_invalid"]), str(cmp["invalid_to_valid"]), p_text(cmp["p_value"]),
                     "yes" if cmp["significant"] else "no"])
    return (f"Summary: which perturbations hurt most (largest relative drop against `{baseline}` first)",
            ["model", "profile", "perturbation", "accuracy [95 % CI]", "failed requests (counted wrong)",
             NOT_COMPARABLE_HEADER, f"drop vs {baseline} [95 % CI]",
             "paired cases", "valid→invalid", "invalid→valid", "McNemar p", f"drop ≠ 0 at {ALPHA}"], rows)


def trials_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Repeated trials: per arm, the accuracy of each trial, mean ± standard deviation [min, max],
    pass^k and pass@k for k = 1..K. No rows when no arm has more than one trial."""
    entries = [(m, p, a["trials"]) for m, data in summary["models"].items() for p, a in data["arms"].items()
               if a.get("trials")]
    k_max = max((t["k"] for _, _, t in entries), default=0)
    rows = []
    for model, p, t in entries:
        spread_ = t["accuracy"]
        mean = "–" if spread_["mean"] is None else (f"{spread_['mean']:.3f}" + ("" if spread_["std"] is None else
                                                                              f" ± {spread_['std']:.3f}"))
        span = "" if spread_["min"] is None else f"[{spread_['min']:.3f}, {spread_['max']:.3f}]"
        rows.append([model, p, str(t["k"]), f"{t['complete_cases']}/{t['cases']}",
                     " ".join(acc(x["accuracy"]) for x in t["per_trial"]), mean, span,
                     *(acc(t["pass_hat_k"].get(str(k))) for k in range(1, k_max + 1)),
                     *(acc(t["pass_at_k"].get(str(k))) for k in range(2, k_max + 1))])
    header = ["model", "profile", "trials", "cases with every trial", "accuracy per trial", "mean ± sd",
              "[min, max]", *(f"pass^{k}" for k in range(1, k_max + 1)), *(f"pass@{k}" for k in range(2, k_max + 1))]
    return ("Repeated trials: accuracy of each trial, its mean and spread; pass^k (all k of k trials right) and "
            "pass@k (at least one right), tau-bench's estimators over the cases", header, rows)


def headline(summary: dict[str, Any]) -> list[str]:
    """One sentence per model: the arm that hurt most, and whether that is distinguishable from noise."""
    out = []
    for model, data in summary["models"].items():
        arms = [(p, a) for p, a in data["arms"].items() if a.get("paired") and a["drop_vs_off"] is not None]
        if not arms:
            continue
        p, a = min(arms, key=lambda pa: pa[1]["drop_vs_off"])
        sig = [q for q, b in arms if b["paired"]["significant"] and b["drop_vs_off"] < 0]
        if a["drop_vs_off"] >= 0:
            out.append(f"{model}: no arm scored below `{summary['baseline']}` (the lowest, `{p}`: "
                       f"{drop_ci(a['drop_vs_off'], a['drop_vs_off_ci'])}, McNemar p = "
                       f"{p_text(a['paired']['p_value'])}).")
            continue
        out.append(f"{model}: `{p}` hurt most ({drop_ci(a['drop_vs_off'], a['drop_vs_off_ci'])}, McNemar p = "
                   f"{p_text(a['paired']['p_value'])}); {len(sig)} of {len(arms)} arms lower accuracy "
                   f"distinguishably from zero at {ALPHA}" + (f" ({', '.join(sig)})" if sig else "") + ".")
    return out


def _taxonomy_columns(summary: dict[str, Any]) -> list[str]:
    seen = {k for data in summary["models"].values() for arm in data["arms"].values() for k in arm["errors"]}
    return [t for t in TAXONOMY if t in seen] + sorted(seen - set(TAXONOMY))


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table in the report (the sweeps' after the replays')."""
    replays = [_accuracy_table(summary), *_error_table(summary), _arms_table(summary), *_category_tables(summary),
               *family_tables(summary), *remedy_tables(summary), *paper_tables(summary)] if summary["models"] else []
    return [*_sent_with_table(summary), *replays, *live_tables(summary), *sweep_tables(summary)]


def _sent_with_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """What each model's requests were sent with, as its results files recorded it."""
    rows = [[model, {"none": "none (not sent: the model's default)"}.get(s.get("temperature", ""),
                                                                          s.get("temperature", "not recorded")),
             s.get("token_counter", "not recorded")]
            for model, s in (summary.get("sent_with") or {}).items()]
    if not rows:
        return []
    return [("Sent with: the temperature each request carried (none: the field left out, as BFCL does for models "
             "that take only their default) and the token counter of the budgets", ["model", "temperature",
                                                                                    "token counter"], rows)]


def _x(value: float | None, above: float | None = None) -> str:
    """An intensity; None as "> max" when `above` is given (censored), "-" otherwise."""
    if value is None or value == INF:
        return f"> {above:g}" if above is not None else "-"
    return f"{value:g}"


def _median_text(numbers: dict[str, Any], high: float) -> str:
    lo, hi = numbers["median_ci"] or (None, None)
    if numbers["median_ci"] is None:
        return "-"
    level = numbers.get("median_ci_level")
    note = f", {level:.0%}" if level is not None and level < 0.95 else ""
    return f"{_x(numbers['median'], high)} [{_x(lo, high)}, {_x(hi, high)}{note}]"


def _share_at(points: list[dict[str, Any]], x: float) -> dict[str, Any] | None:
    """The survival curve's step at x: its last point at or below x."""
    return next((p for p in reversed(points) if p["x"] <= x), None)


def sweep_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per axis: the breaking points of every run, the survival curves side by side, per category, per case; the
    paired comparisons."""
    sweeps = summary.get("sweeps") or {}
    axes = list(dict.fromkeys(a for runs in sweeps.values() for a in runs))
    out = []
    for axis in axes:
        runs = {label: data[axis] for label, data in sweeps.items() if axis in data}
        out += [_breaking_table(axis, runs), _curve_table(axis, runs), _sweep_category_table(axis, runs),
                _sweep_case_table(axis, runs)]
    comparisons = summary.get("sweep_comparisons") or []
    if comparisons:
        out.append(("Paired breaking points (cases both runs finished; censored as above the maximum; sign test)",
                    ["axis", "run a", "run b", "cases", "a breaks later", "b breaks later", "ties", "p",
                     "median b − a"],
                    [[c["axis"], c["a"], c["b"], str(c["n"]), str(c["a_later"]), str(c["b_later"]), str(c["ties"]),
                      p_text(c["p_value"]), _x(c["median_difference"])] for c in comparisons]))
    shifts = summary.get("sweep_remedies") or []
    if shifts:
        out.append(("Remedies along an axis: the median breaking point without and with the remedy (the survival "
                    "curves of both are drawn on one plot)", ["axis", "remedy", "run", "twin", "median without",
                                                              "median with", "what it means"],
                    [[e["axis"], " + ".join(e["remedies"]), e["run"], e["twin"], _x(e["median_without"], e["max"]),
                      _x(e["median_with"], e["max"]), e["text"]] for e in shifts]))
    return out


def _breaking_table(axis: str, runs: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    any_run = next(iter(runs.values()))
    rows = [[label, str(r["n"]), _median_text(r, r["max"]), str(len(r["censored"])), str(len(r["wrong_at_min"])),
             str(len(r["non_monotone"])), str(len(r["incomplete"])),
             "-" if r["requests_per_case"] is None else f"{r['requests_per_case']:.1f}",
             codes_text(r.get("failed", 0), r.get("failed_codes") or {}),
             f"{len(r.get('not_comparable_cases') or [])} cases; " + not_comparable_text(r)]
            for label, r in runs.items()]
    return (f"Breaking points along {axis} ({any_run['unit']}, {any_run['min']:g} to {any_run['max']:g}): median "
            "first wrong intensity [95 % interval]", ["run", "cases", "median breaking point", "right at max "
            "(censored)", "wrong at min", "not monotone", "incomplete", "requests / case",
            "failed requests (counted wrong)", NOT_COMPARABLE_HEADER], rows)


def _curve_table(axis: str, runs: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    xs = sorted({p["x"] for r in runs.values() for p in r["curve"]})
    rows = []
    for x in xs:
        row = [f"{x:g}"]
        for r in runs.values():
            p = _share_at(r["curve"], x)
            row.append("-" if p is None or p["share"] is None else
                       f"{p['share']:.3f} {ci(p['ci'])} ({p['right']}/{p['n']})")
        rows.append(row)
    return (f"Survival along {axis}: share of cases still right at x (pointwise 95 % Wilson intervals)",
            ["x", *runs], rows)


def _sweep_category_table(axis: str, runs: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for label, r in runs.items():
        for cat, c in r["categories"].items():
            last = c["curve"][-1] if c["curve"] else None
            at_max = sum(1 for cid in r["censored"] if r["case_categories"].get(cid) == cat)
            rows.append([label, cat, str(c["n"]), _median_text(c, r["max"]), f"{at_max}/{c['n']}"
                         if last is not None else "-"])
    return (f"Breaking points along {axis} per category", ["run", "category", "cases", "median breaking point",
                                                              "right at max"], rows)


def _sweep_case_table(axis: str, runs: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for label, r in runs.items():
        for cid, c in sorted(r["cases"].items()):
            note = ("not comparable: the backend refused a point for the request's shape"
                    if cid in (r.get("not_comparable_cases") or []) else
                    "incomplete (rerun the sweep)" if cid in r["incomplete"] else
                    "right again at " + ", ".join(f"{x:g}" for x in r["non_monotone"][cid])
                    if cid in r["non_monotone"] else "censored: right at the maximum" if c["first_wrong"] is None
                    else "wrong at the minimum" if c["last_right"] is None else "")
            refused = (r.get("first_wrong_failed") or {}).get(cid)
            if refused:  # the first wrong point got no answer (a refusal, a timeout): counted wrong, as BFCL does
                why = f"first wrong: failed on the backend ({refused}), counted wrong"
                note = f"{note}; {why}" if note else why
            rows.append([label, cid, r["case_categories"].get(cid, ""), _x(c["last_right"]), _x(c["first_wrong"]),
                         str(c["requests"]), note])
    return (f"Per case along {axis}", ["run", "case", "category", "last right", "first wrong", "requests", "note"],
            rows)


def _accuracy_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    baseline = summary["baseline"]
    models = summary["models"]
    profiles = list(dict.fromkeys(p for data in models.values() for p in data["arms"]))
    header = ["model", *profiles]
    rows = []
    for model, data in models.items():
        row = [model]
        ci_row = [f"{model} 95 % CI"]
        for p in profiles:
            arm = data["arms"].get(p)
            drop = "" if arm is None or p == baseline else rel(arm["drop_vs_off"])
            refused = sum((arm or {}).get("not_comparable", {}).values())
            row.append("" if arm is None else acc(arm["accuracy"]) + drop +
                       (f" ({refused} not comparable)" if refused else ""))
            ci_row.append("" if arm is None else ci(arm.get("accuracy_ci")))
        rows += [row, ci_row]
    return (f"AST accuracy per arm (in brackets the relative change against `{baseline}` on the same cases: both "
            "arms' accuracy over the cases both scored, so an arm that left some unperturbed is compared on the "
            "ones it perturbed; 95 % Wilson intervals on the row below)", header, rows)


def _error_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    cols = _taxonomy_columns(summary)
    rows = []
    for model, data in summary["models"].items():
        for p, arm in data["arms"].items():
            failures = sum(arm["errors"].values())
            if p == summary["baseline"] or not failures:
                continue
            rows.append([model, p, str(failures), *(f"{arm['errors'].get(c, 0) / failures:.2f}" for c in cols)])
            cis = arm.get("errors_ci") or {}
            rows.append([model, f"{p} 95 % CI", "",
                         *(ci(cis[c] if c in cis else wilson_ci(0, failures)) for c in cols)])
    if not rows:
        return []
    return [("Error analysis of perturbed arms (share of each error type among failures; 95 % Wilson intervals "
             "on the row below)", ["model", "profile", "failures", *cols], rows)]


#: the column every arm table gives the pairs the backend refused for the request's shape (failures.REFUSALS)
NOT_COMPARABLE_HEADER = "not comparable (refused for the request's shape, in no number)"


def not_comparable_text(numbers: dict[str, Any]) -> str:
    """`3 (array_above_max_length 3)`: an arm's (or a sweep's) pairs refused for their shape, by code."""
    codes = numbers.get("not_comparable") or {}
    return codes_text(sum(codes.values()), codes)


def codes_text(count: int, codes: dict[str, int]) -> str:
    """`12 (context_length_exceeded 12)`: a count of failed pairs and their codes."""
    text = ", ".join(f"{k} {v}" for k, v in codes.items())
    return str(count) + (f" ({text})" if text else "")


def _arms_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    rows = []
    for model, data in summary["models"].items():
        for p, arm in data["arms"].items():
            rows.append([model, p, str(arm["n"]), acc(arm["accuracy"]), acc(arm["fair_accuracy"]),
                         acc(arm["semantic_accuracy"]), codes_text(arm["failed"], arm["failed_codes"]),
                         pct_ci(arm.get("answered_accuracy"), arm.get("answered_accuracy_ci")),
                         not_comparable_text(arm), codes_text(arm.get("unscored", 0), arm.get("unscored_codes") or {}),
                         ci(arm.get("accuracy_ci")), ci(arm.get("fair_accuracy_ci")),
                         ci(arm.get("semantic_accuracy_ci"))])
    return ("Arms: scored pairs, accuracy in the three scoring modes, requests that failed on the backend's side "
            "(refused, timed out after retries, unreadable: counted in n as wrong answers, as BFCL counts an "
            "inference error; by code), bfcl accuracy over the answered requests only, pairs the backend refused "
            "for the request's shape (a hosted API's limit such as 128 tools, a parameter the model does not take: "
            "they measure the API, not the model, and are left out of n), pairs not scored yet "
            "(the proxy's or network's failures, retried on the next run), 95 % Wilson intervals",
            ["model", "profile", "n", "bfcl", "fair", "semantic", "failed (counted wrong)",
             "bfcl over answered [95 % CI]", NOT_COMPARABLE_HEADER, "not scored yet", "bfcl CI", "fair CI",
             "semantic CI"], rows)


def _category_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    baseline = summary["baseline"]
    models = summary["models"]
    categories = sorted({c for data in models.values() for arm in data["arms"].values() for c in arm["by_category"]})
    out = []
    for model, data in models.items():
        rows = []
        for p, arm in data["arms"].items():
            cells = []
            for c in categories:
                cat = arm["by_category"].get(c)
                cells.append(
                    ""
                    if cat is None
                    else f"{acc(cat['accuracy'])} (n={cat['n']})"
                    + ("" if p == baseline else rel(cat.get("drop_vs_off")))
                    + (f" {ci(cat['accuracy_ci'])}" if cat.get("accuracy_ci") else "")
                    + (f" ({cat['not_comparable']} not comparable)" if cat.get("not_comparable") else "")
                )
            rows.append([p, *cells])
        out.append((f"Per category: {model} (accuracy, n, relative change, 95 % Wilson interval)",
                    ["profile", *categories], rows))
    return out


#: the two directions of a flip, as the per-case diffs write them
DIRECTION = {"valid_to_invalid": "valid → invalid", "invalid_to_valid": "invalid → valid"}


def flip_groups(summary: dict[str, Any]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for f in summary.get("flips") or []:
        groups[(f["model"], f["profile"])].append(f)
    return [(m, p, fs) for (m, p), fs in groups.items()]
