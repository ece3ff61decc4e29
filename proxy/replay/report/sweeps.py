"""Breaking points from `toolquake sweep` results: per run (model, or model and directory when one model was swept
under several settings) and axis, each case's last right and first wrong intensity, the survival curve with
pointwise 95 % Wilson intervals, the median breaking point with a distribution-free interval, per category; and
the paired comparison of two runs' breaking points on their common cases.

A case's outcome comes from its recorded verdicts through `toolquake.proxy.replay.breaking` — the function the
sweep itself decided with — so the report says exactly what the sweep found, and a case still being swept (or with
a failed request) is `incomplete` and left out of the curve.

Survival S(x): the share of the cases still right at x, i.e. whose last right intensity is ≥ x (a case wrong at
the minimum is right nowhere; a censored case, right even at the maximum, everywhere). The curve is given at the
minimum and at every first-wrong intensity, where it steps down. The median breaking point is the smallest x with
S(x) ≤ 1/2 (null: more than half the cases survive the maximum); its interval is the order-statistic interval
[B(j), B(n+1−j)] of the first-wrong intensities B (censored ones as +∞), j the largest rank with
P(Binomial(n, 1/2) < j) ≤ 2.5 %; with fewer than 6 cases no j reaches 95 %, and the whole range [B(1), B(n)] is
given with its actual coverage.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

from toolquake.proxy.replay.breaking import outcome, remedy_moves, verdict
from toolquake.proxy.replay.failures import NOT_COMPARABLE
from toolquake.proxy.replay.report.rows import Results, SweepRow, SweepRun
from toolquake.scorers.aggregate import mcnemar, wilson_ci

INF = math.inf


def _name(run: SweepRun) -> str:
    """A run's model, with its remedies when it has some (`sweep --remedy`: "model + tool_search")."""
    return run.model + "".join(f" + {r}" for r in run.remedies)


def _labels(runs: list[SweepRun]) -> list[str]:
    """Each run's label: its model (and remedies); "model (directory)" when one model was swept along one axis in
    several directories (two proxies, two settings) — except the shards of one sweep (sweep-shard-*.sqlite,
    sweep-remedied-shard-*.sqlite, the same settings), which are one run wherever they lie."""
    groups: dict[tuple[str, str], list[SweepRun]] = defaultdict(list)
    for r in runs:
        groups[(_name(r), r.axis)].append(r)
    split = set()
    for key, members in groups.items():
        dirs = {r.source.parent for r in members}
        shards = all("-shard-" in r.source.name for r in members) and \
            len({(tuple(r.points), r.rule, r.trials, r.position) for r in members}) == 1
        if len(dirs) > 1 and not shards:
            split.add(key)
    return [f"{_name(r)} ({r.source.parent.name})" if (_name(r), r.axis) in split else _name(r) for r in runs]


def case_outcomes(res: Results) -> dict[tuple[str, str], dict[str, Any]]:
    """(label, axis) → {"run": the run's settings, "cases": {case: {...}}} from the recorded verdicts."""
    labels = _labels(res.sweep_runs)
    rows: dict[tuple[str, str], dict[str, list[SweepRow]]] = defaultdict(lambda: defaultdict(list))
    for row in res.sweep_rows:
        run = res.sweep_runs[row.run]
        rows[(labels[row.run], run.axis)][row.case_id].append(row)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for (label, axis), cases in rows.items():
        run = res.sweep_runs[next(r.run for rs in cases.values() for r in rs)]
        out[(label, axis)] = {"run": run, "cases": {cid: _case(run, rs) for cid, rs in cases.items()}}
    return out


def _case(run: SweepRun, rows: list[SweepRow]) -> dict[str, Any]:
    index = {x: i for i, x in enumerate(run.points)}
    trials: dict[int, dict[int, bool]] = defaultdict(dict)
    failed: dict[float, list[str]] = defaultdict(list)
    refused = [r.error_code or "unknown" for r in rows if r.status == NOT_COMPARABLE]
    for r in rows:
        if r.status == "scored" and r.x in index:
            trials[index[r.x]][r.trial] = bool(r.valid)
            if r.error_code:
                failed[r.x].append(r.error_code)
    known = {i: verdict([ts[t] for t in range(run.trials)], run.rule) for i, ts in trials.items()
             if all(t in ts for t in range(run.trials))}
    o = outcome(len(run.points), known)
    pts = run.points
    first = None if o.first_wrong is None else pts[o.first_wrong]
    return {"category": rows[0].category, "requests": len(rows), "done": o.done,
            "last_right": None if o.last_right is None else pts[o.last_right], "first_wrong": first,
            "right_after": [pts[i] for i in o.right_after], "failed": [c for cs in failed.values() for c in cs],
            # the backend refused a point for the request's shape (failures.REFUSALS): no breaking point, in no number
            "not_comparable": refused,
            # the backend's refusal (e.g. context_length_exceeded) when that is what made the first wrong point wrong
            "first_wrong_failed": sorted(set(failed[first]))[0] if first in failed else None}


def curve(cases: list[dict[str, Any]], low: float) -> list[dict[str, Any]]:
    """S(x) at the minimum and at every first-wrong intensity: {"x", "right", "n", "share", "ci"}."""
    n = len(cases)
    xs = sorted({low, *(c["first_wrong"] for c in cases if c["first_wrong"] is not None)})
    out = []
    for x in xs:
        k = sum(1 for c in cases if c["last_right"] is not None and c["last_right"] >= x)
        out.append({"x": x, "right": k, "n": n, "share": k / n if n else None, "ci": wilson_ci(k, n)})
    return out


def _binom_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n if k >= 0 else 0.0


def median(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The median breaking point and its interval (module docstring); None stands for "above the maximum"."""
    n = len(cases)
    if not n:
        return {"median": None, "median_ci": None, "median_ci_level": None}
    b = sorted(INF if c["first_wrong"] is None else c["first_wrong"] for c in cases)
    m = b[(n - 1) // 2]
    j = max((j for j in range(1, n // 2 + 1) if _binom_cdf(j - 1, n) <= 0.025), default=None)
    j = j or 1
    level = 1 - 2 * _binom_cdf(j - 1, n)
    lo, hi = b[j - 1], b[n - j]
    return {"median": None if m == INF else m, "median_ci": [None if lo == INF else lo, None if hi == INF else hi],
            "median_ci_level": round(level, 4)}


def _axis_numbers(run: SweepRun, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    refused = {cid: c for cid, c in cases.items() if c["not_comparable"]}
    done = {cid: c for cid, c in cases.items() if c["done"] and cid not in refused}
    listed = list(done.values())
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in listed:
        by_cat[c["category"]].append(c)
    low, high = run.points[0], run.points[-1]
    return {
        "unit": run.unit, "min": low, "max": high, "points": len(run.points), "rule": run.rule, "trials": run.trials,
        "cases": {cid: {"last_right": c["last_right"], "first_wrong": c["first_wrong"], "requests": c["requests"]}
                  for cid, c in cases.items()},
        **median(listed), "curve": curve(listed, low),
        "n": len(listed), "censored": sorted(cid for cid, c in done.items() if c["first_wrong"] is None),
        "wrong_at_min": sorted(cid for cid, c in done.items() if c["last_right"] is None),
        "non_monotone": {cid: c["right_after"] for cid, c in sorted(done.items()) if c["right_after"]},
        "incomplete": sorted(cid for cid, c in cases.items() if not c["done"] and cid not in refused),
        # cases stopped where the backend refused the request for its shape: left out of n and every statistic
        "not_comparable": dict(sorted(Counter(code for c in refused.values() for code in c["not_comparable"]).items())),
        "not_comparable_cases": sorted(refused),
        # requests the backend refused, or that timed out: scored wrong, as BFCL scores an inference error
        "failed": sum(len(c["failed"]) for c in cases.values()),
        "failed_codes": dict(sorted(Counter(code for c in cases.values() for code in c["failed"]).items())),
        "first_wrong_failed": {cid: c["first_wrong_failed"] for cid, c in sorted(cases.items())
                               if c["first_wrong_failed"]},
        "categories": {cat: {"n": len(cs), **median(cs), "curve": curve(cs, low)}
                       for cat, cs in sorted(by_cat.items())},
        "case_categories": {cid: c["category"] for cid, c in cases.items()},
        "requests_per_case": (sum(c["requests"] for c in listed) / len(listed)) if listed else None,
    }


def sweep_numbers(res: Results) -> dict[str, Any]:
    """{"sweeps": {label: {axis: {...}}}, "sweep_comparisons": [...]} (empty when there is no sweep)."""
    if not res.sweep_runs:
        return {}
    found = case_outcomes(res)
    sweeps: dict[str, dict[str, Any]] = {}
    for (label, axis), data in found.items():
        sweeps.setdefault(label, {})[axis] = _axis_numbers(data["run"], data["cases"])
    return {"sweeps": sweeps, "sweep_comparisons": comparisons(sweeps), "sweep_remedies": remedy_shifts(res, sweeps)}


def remedy_shifts(res: Results, sweeps: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per remedied run (`sweep --remedy`) and axis: its twin (the same model swept without the remedy, in the same
    directory), both medians, and the sentence "with tool_search the median breaking point moves from X to Y …"."""
    labels = _labels(res.sweep_runs)
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()  # the shards of one sweep are one run
    for i, run in enumerate(res.sweep_runs):
        twin = next((labels[j] for j, t in enumerate(res.sweep_runs) if not t.remedies and t.model == run.model
                     and t.axis == run.axis and t.source.parent == run.source.parent), None)
        if not run.remedies or twin is None or (labels[i], run.axis) in seen or \
                run.axis not in sweeps.get(labels[i], {}) or run.axis not in sweeps.get(twin, {}):
            continue
        seen.add((labels[i], run.axis))
        before, after = sweeps[twin][run.axis], sweeps[labels[i]][run.axis]
        out.append({"axis": run.axis, "remedies": list(run.remedies), "run": labels[i], "twin": twin,
                    "unit": after["unit"], "median_without": before["median"], "median_with": after["median"],
                    "max": after["max"], "text": remedy_moves(run.remedies, before["median"], after["median"],
                                                             after["max"], after["unit"])})
    return out


def comparisons(sweeps: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per axis, the first run against each other on the cases both finished: who broke later, the sign test."""
    out = []
    by_axis: dict[str, list[str]] = defaultdict(list)
    for label, axes in sweeps.items():
        for axis in axes:
            by_axis[axis].append(label)
    for axis, labels in by_axis.items():
        for other in labels[1:]:
            out.append(paired(axis, labels[0], other, sweeps[labels[0]][axis], sweeps[other][axis]))
    return out


def _point(case: dict[str, Any]) -> float:
    return INF if case["first_wrong"] is None else case["first_wrong"]


def paired(axis: str, a: str, b: str, na: dict[str, Any], nb: dict[str, Any]) -> dict[str, Any]:
    """Paired breaking points of runs a and b on their common finished cases (censored as +∞, so a censored case
    breaks later than any other): a later, b later, ties, the exact two-sided sign test, and the median
    difference b − a over the cases broken in both."""
    skip = set(na["incomplete"]) | set(nb["incomplete"]) | set(na.get("not_comparable_cases") or ()) | \
        set(nb.get("not_comparable_cases") or ())
    common = sorted((set(na["cases"]) & set(nb["cases"])) - skip)
    pa = {c: _point(na["cases"][c]) for c in common}
    pb = {c: _point(nb["cases"][c]) for c in common}
    a_later = sum(1 for c in common if pa[c] > pb[c])
    b_later = sum(1 for c in common if pb[c] > pa[c])
    diffs = sorted(pb[c] - pa[c] for c in common if pa[c] != INF and pb[c] != INF)
    mid = None
    if diffs:
        h = len(diffs) // 2
        mid = diffs[h] if len(diffs) % 2 else (diffs[h - 1] + diffs[h]) / 2
    return {"axis": axis, "a": a, "b": b, "n": len(common), "a_later": a_later, "b_later": b_later,
            "ties": len(common) - a_later - b_later, "p_value": mcnemar(a_later, b_later) if common else None,
            "median_difference": mid}
