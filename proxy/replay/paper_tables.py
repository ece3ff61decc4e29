"""Seed papers' own measures from replay results, beside the main report (proxy/replay/report.py):

- seed 001 Table 2 (right): the error breakdown over the failures the perturbation *caused* — cases valid
  in the baseline and invalid in the arm — in the paper's four classes, with our nine beside them;
- toolkit expansion: the source that wrote the added tools, and the distribution of their cosine to the
  nearest original (what "related but not equivalent" measured in this run);
- pairs not perturbed: a scored pair on which every applied step reported `not_perturbed` (a rephrasing
  rejected by the value check) gets the status `not_perturbed` here: counted apart, out of the accuracy.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any, Iterator

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.scorers.aggregate import ratio
from toolquake.scorers.taxonomy import PAPER_CLASS, PAPER_CLASSES, TAXONOMY

if TYPE_CHECKING:
    from toolquake.proxy.replay.report import Results


def row_status(status: str, perturbers: str | None) -> str:
    """`not_perturbed` for a scored pair that every applied step left unperturbed on purpose, else `status`."""
    if status != "scored" or not perturbers or NOT_PERTURBED not in perturbers:
        return status
    try:
        data = json.loads(perturbers) or {}
        applied = data.get("applied")
    except (ValueError, AttributeError):
        return status
    if isinstance(applied, dict) and data.get(NOT_PERTURBED):  # a multi-turn case: no step was perturbed
        return NOT_PERTURBED
    if isinstance(applied, list) and applied and all(NOT_PERTURBED in (a.get("report") or {}) for a in applied):
        return NOT_PERTURBED
    return status


def perturbed_counts(rows: list[Any]) -> dict[str, Any]:
    """An arm's pairs left unperturbed on purpose, and the share of its answered pairs that were perturbed."""
    scored = sum(1 for r in rows if r.status == "scored")
    kept = sum(1 for r in rows if r.status == NOT_PERTURBED)
    return {"not_perturbed": kept, "perturbed_share": ratio(scored, scored + kept)}


def caused_failures(res: Results, baseline: str) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"n", "classes": {class: share}, "fine": {type: share}, "counts", "fine_counts"}}} over
    the cases scored in both the baseline and the arm, valid in the baseline and invalid in the arm."""
    base = {(r.model, r.case_id, getattr(r, "trial", 0)): r for r in res.rows
            if r.profile == baseline and r.status == "scored"}
    counts: dict[tuple[str, str], tuple[Counter[str], Counter[str]]] = defaultdict(lambda: (Counter(), Counter()))
    for r in res.rows:
        if r.profile == baseline or r.status != "scored" or r.valid:
            continue
        b = base.get((r.model, r.case_id, getattr(r, "trial", 0)))
        if b is None or not b.valid:
            continue
        fine = r.taxonomy or "unclassified"
        classes, fines = counts[(r.model, r.profile)]
        classes[PAPER_CLASS.get(fine, "unclassified")] += 1
        fines[fine] += 1
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model in res.models:
        for p in res.profiles(model):
            if p == baseline or (model, p) not in counts:
                continue
            classes, fines = counts[(model, p)]
            n = sum(classes.values())
            extra = sorted(set(classes) - set(PAPER_CLASSES))
            out.setdefault(model, {})[p] = {
                "n": n, "counts": dict(classes), "fine_counts": dict(fines),
                "classes": {c: ratio(classes.get(c, 0), n) for c in (*PAPER_CLASSES, *extra)},
                "fine": {t: ratio(fines.get(t, 0), n) for t in (*TAXONOMY, *sorted(set(fines) - set(TAXONOMY)))},
            }
    return out


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_reports(res: Results, perturber: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(model, profile, report) of every step of `perturber` applied to a scored pair, read from the files."""
    for path in res.sources:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            model = dict(db.execute("SELECT key, value FROM meta").fetchall()).get("model", "unknown")
            rows = db.execute("SELECT profile, perturbers FROM results WHERE status = 'scored' AND perturbers LIKE ?",
                              (f"%{perturber}%",)).fetchall()
        except sqlite3.DatabaseError:
            continue
        finally:
            db.close()
        for profile, text in rows:
            applied = (json.loads(text) or {}).get("applied")
            for step in applied if isinstance(applied, list) else []:
                if step.get("name") == perturber:
                    yield model, profile, step.get("report") or {}


def _spread(values: list[float], digits: int = 4) -> dict[str, float] | None:
    if not values:
        return None
    return {k: round(_quantile(values, q), digits) for k, q in
            (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("max", 1.0))}


def expansion_stats(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"requests", "sources": {source: n}, "tools_added", "cosine": {min, p25, median, p75,
    max}, "twins_skipped", "below_band"}}} from what toolkit_expansion reported on each scored pair."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for model, profile, report in step_reports(res, "toolkit_expansion"):
        a = acc.setdefault((model, profile), {"requests": 0, "sources": Counter(), "cosines": [],
                                              "twins_skipped": 0, "below_band": 0})
        a["requests"] += 1
        a["sources"][str(report.get("source", "unknown"))] += 1
        a["cosines"] += [float(x) for x in report.get("max_cosine_to_original") or []]
        a["twins_skipped"] += int(report.get("twins_skipped") or 0)
        a["below_band"] += int(report.get("below_band") or 0)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, profile), a in acc.items():
        cos = a.pop("cosines")
        a["sources"] = dict(a["sources"])
        a["tools_added"] = len(cos)
        a["cosine"] = _spread(cos)
        out.setdefault(model, {})[profile] = a
    return out


def padding_stats(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"requests", "budget_tokens", "token_counter": {source: n}, "tokens_after": spread,
    "tools_after": spread}}}: the tokens each catalog_padding arm actually reached, by the counter it used."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for model, profile, report in step_reports(res, "catalog_padding"):
        a = acc.setdefault((model, profile), {"requests": 0, "token_counter": Counter(), "tokens": [], "tools": []})
        a["requests"] += 1
        a["token_counter"][str(report.get("token_counter", "unknown"))] += 1
        if isinstance(report.get("tokens_after"), int):
            a["tokens"].append(float(report["tokens_after"]))
        if isinstance(report.get("tools_after"), int):
            a["tools"].append(float(report["tools_after"]))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, profile), a in acc.items():
        spec = res.arms.get((model, profile), {}).get("perturbers") or []
        budget = next((p.get("params", {}).get("budget_tokens") for p in spec if p.get("name") == "catalog_padding"),
                      None)
        out.setdefault(model, {})[profile] = {
            "requests": a["requests"], "budget_tokens": budget, "token_counter": dict(a["token_counter"]),
            "tokens_after": _spread(a["tokens"], 0), "tools_after": _spread(a["tools"], 1)}
    return out


def _arms_with(data: dict[str, Any], perturber: str) -> dict[str, dict[str, Any]]:
    return {p: arm for p, arm in data["arms"].items()
            if any(s.get("name") == perturber for s in arm.get("perturbers") or [])}


def format_sensitivity(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """BFCL's per-model statistics over the format configurations (arms with format_rewrite): `max_delta` =
    (max − min) accuracy in points, `std` = sample standard deviation in points, `variance` in points²,
    rounded to 2 decimals as BFCL prints them (bfcl-spec §4.6)."""
    import statistics

    out = {}
    for model, data in summary["models"].items():
        accs = [a["accuracy"] for a in _arms_with(data, "format_rewrite").values() if a["accuracy"] is not None]
        if len(accs) < 2:
            continue
        out[model] = {"configs": len(accs), "max_delta": round((max(accs) - min(accs)) * 100, 2),
                      "std": round(statistics.stdev(accs) * 100, 2),
                      "variance": round(statistics.variance(accs) * 10000, 2)}
    return out


def padding_extremes(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 1: per model and category, the best (Max) and worst (Min) accuracy over the catalog-padding
    arms (budgets × positions), the arms that gave them, and `deg` = (Max − Min) in points."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model, data in summary["models"].items():
        per_cat: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for p, arm in _arms_with(data, "catalog_padding").items():
            for cat, numbers in arm["by_category"].items():
                if numbers["accuracy"] is not None:
                    per_cat[cat].append((numbers["accuracy"], p))
        for cat, values in sorted(per_cat.items()):
            hi, lo = max(values), min(values)
            out.setdefault(model, {})[cat] = {"max": hi[0], "max_arm": hi[1], "min": lo[0], "min_arm": lo[1],
                                              "deg": round((hi[0] - lo[0]) * 100, 2), "arms": len(values)}
    return out


def sections(res: Results, baseline: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's keys for these measures (`toolquake report --format json`)."""
    return {"caused_errors": caused_failures(res, baseline), "expansion": expansion_stats(res),
            "padding": padding_stats(res), "padding_extremes": padding_extremes(summary),
            "format_sensitivity": format_sensitivity(summary)}


def _share(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the tables these measures add to the report."""
    out = []
    caused = summary.get("caused_errors") or {}
    fine_cols = [t for t in TAXONOMY if any(arm["fine_counts"].get(t) for m in caused.values() for arm in m.values())]
    rows = [[model, p, str(arm["n"]), *(_share(arm["classes"].get(c)) for c in PAPER_CLASSES),
             *(_share(arm["fine"].get(t)) for t in fine_cols)]
            for model, arms in caused.items() for p, arm in arms.items()]
    if rows:
        out.append((f"Seed 001 Table 2 (right): failures the perturbation caused (valid in `{summary['baseline']}`, "
                    "invalid in the arm), share of each of the paper's four classes, our nine types beside",
                    ["model", "profile", "caused failures", *(f"wrong {c}" for c in PAPER_CLASSES), *fine_cols], rows))
    rows = [[model, p, str(arm["n"]), str(arm["not_perturbed"]), f"{arm['perturbed_share']:.3f}"]
            for model, data in summary["models"].items() for p, arm in data["arms"].items()
            if arm.get("not_perturbed")]
    if rows:
        out.append(("Pairs not perturbed (e.g. rephrasings rejected by the value check): served unchanged, left out "
                    "of the arm's accuracy", ["model", "profile", "scored (perturbed)", "not perturbed",
                                               "share perturbed"], rows))
    rows = []
    for model, arms in (summary.get("expansion") or {}).items():
        for p, a in arms.items():
            cos = a["cosine"] or {}
            rows.append([model, p, ", ".join(f"{s} {n}" for s, n in a["sources"].items()), str(a["requests"]),
                         str(a["tools_added"]), *(f"{cos[k]:.3f}" if k in cos else "" for k in
                                                  ("min", "p25", "median", "p75", "max")),
                         str(a["twins_skipped"]), str(a["below_band"])])
    if rows:
        out.append(("Toolkit expansion: source of the added tools and their cosine to the nearest original tool",
                    ["model", "profile", "source", "requests", "tools added", "min", "p25", "median", "p75", "max",
                     "twins skipped", "below band"], rows))
    rows = [[model, cat, f"{e['max']:.3f}", e["max_arm"], f"{e['min']:.3f}", e["min_arm"], f"{e['deg']:.2f}",
             str(e["arms"])]
            for model, cats in (summary.get("padding_extremes") or {}).items() for cat, e in cats.items()]
    if rows:
        out.append(("Seed 003 Table 1: best and worst accuracy over the catalog-padding arms per category, and the "
                    "degradation (Max − Min, in points)",
                    ["model", "category", "Max", "Max arm", "Min", "Min arm", "% Deg.", "arms"], rows))
    rows = [[model, str(f["configs"]), f"{f['max_delta']:.2f}", f"{f['std']:.2f}", f"{f['variance']:.2f}"]
            for model, f in (summary.get("format_sensitivity") or {}).items()]
    if rows:
        out.append(("Format sensitivity (BFCL V4 / seed 002): spread of accuracy over the format configurations",
                    ["model", "configurations", "max delta (points)", "std (points)", "variance"], rows))
    rows = []
    for model, arms in (summary.get("padding") or {}).items():
        for p, a in arms.items():
            tok, tools = a["tokens_after"] or {}, a["tools_after"] or {}
            counters = ", ".join(f"{s} {n}" for s, n in a["token_counter"].items())
            rows.append([model, p, str(a["budget_tokens"] or ""), counters,
                         str(a["requests"]), *(f"{tok[k]:.0f}" if k in tok else "" for k in ("min", "median", "max")),
                         f"{tools['median']:.0f}" if tools else ""])
    if rows:
        out.append(("Catalog padding: the tokens each arm reached (by the counter used; `estimate` over-counts real "
                    "tokens, so its budgets are smaller in the model's tokens) and the tools in the catalog",
                    ["model", "profile", "budget", "token counter", "requests", "tokens min", "tokens median",
                     "tokens max", "tools median"], rows))
    return out
