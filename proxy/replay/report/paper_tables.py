"""The papers' own measures and tables from replay results; every paper-specific name of the report lives
here (seed 001's Table 2, seed 002's format configurations and Fig. 2, seed 003's Tables 1, 2, 5, 6, 7 and
Figs. 3 and 4):

- seed 001 Table 2 (right): the error breakdown over the failures the perturbation *caused* — cases valid
  in the baseline and invalid in the arm — in the paper's four classes, with our nine beside them;
- toolkit expansion: the source that wrote the added tools, and the distribution of their cosine to the
  nearest original (what "related but not equivalent" measured in this run);
- pairs not perturbed (a rephrasing rejected by the value check): counted apart, out of the accuracy;
- seed 003's grids (catalog size × position, response size and answer position, conversation size × setting)
  and seed 002's format configurations, for the tables and the plots.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.replay.report.arms import experiment_of, names_of, param, remedied, step_of
from toolquake.proxy.replay.report.rows import Results, scored_steps, step_reports, step_usage
from toolquake.scorers.aggregate import ratio, relative_drop, wilson_ci
from toolquake.scorers.taxonomy import PAPER_CLASS, PAPER_CLASSES, TAXONOMY

#: the papers' experiments, as the perturbers that run them declare it (`Perturber.experiment`)
CATALOG = "catalog_size"  # seed 003 challenge 1: the catalog padded to a budget, the original tools at a position
RESPONSES = "response_size"  # seed 003 challenge 2: the last tool response grown, the answer at a position
CONVERSATIONS = "conversation_size"  # seed 003 challenge 3: the conversation lengthened, the fact in a setting
FORMATS = "answer_format"  # seed 002: the format the model answers in and the tools are documented in
EXPANSION = "related_tools"  # seed 001 §2.2: related but not equivalent tools added to the toolkit
REPHRASING = "rephrasing"  # seed 001 §2.1: the user's query rephrased by a generator model

#: seed 001 Table 2's class of a caused failure whose request failed on the backend's side (not one of the paper's)
FAILED_CLASS = "request failed"

#: the plots' titles, in the papers' words
FORMAT_HEATMAP_TITLE = "Format sensitivity: accuracy (valid/scored), configuration × model (seed 002)"
#: seed 003 Fig. 4: (experiment, file name, x label, title) of its two line plots
RESPONSE_PLOTS = (
    ("context_length", "response-size", "tool response budget (tokens)",
     "Long tool responses: accuracy by response size, answer at the first position (seed 003 Fig. 4a)"),
    ("answer_position", "response-position", "position of the answer in the response",
     "Long tool responses: accuracy by answer position at the largest size (seed 003 Fig. 4b)"),
)


def response_plot_name(file_name: str) -> str:
    """The name of a Fig. 4 plot in the HTML report, from its file name."""
    size = file_name.startswith("response-size")
    return f"seed 003 Fig. 4{'a' if size else 'b'}: accuracy by {'response size' if size else 'answer position'}"


# the 26 configurations of seed 002 / BFCL V4 format sensitivity, in their published order
_RETURN_FORMATS = ("python", "json", "verbose_xml", "concise_xml")
_DOC_FORMATS = ("python", "xml", "json")


def format_configurations() -> list[dict[str, Any]]:
    """The 26 format_rewrite parameter sets of seed 002, in BFCL's order (24 combinations, then md, exp)."""
    out = [{"return_format": r, "tool_call_tag": t, "function_doc_format": d, "prompt_format": "plaintext",
            "prompt_style": "classic"} for r in _RETURN_FORMATS for t in (True, False) for d in _DOC_FORMATS]
    base = {"return_format": "python", "tool_call_tag": False, "function_doc_format": "json"}
    out.append({**base, "prompt_format": "markdown", "prompt_style": "classic"})
    out.append({**base, "prompt_format": "plaintext", "prompt_style": "experimental"})
    return out


def format_label(params: dict[str, Any]) -> str:
    """Seed 002's notation: `{function_doc_format}->{return_format},{has_tool_call_tag}` (+ md / exp)."""
    label = (f"{params.get('function_doc_format', 'json')}->{params.get('return_format', 'python')},"
             f"{bool(params.get('tool_call_tag', False))}")
    if params.get("prompt_format", "plaintext") == "markdown":
        label += ",md"
    if params.get("prompt_style", "classic") == "experimental":
        label += ",exp"
    return label


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
        classes[PAPER_CLASS.get(fine, FAILED_CLASS if r.error_code else "unclassified")] += 1
        fines[fine] += 1
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model in res.models:
        for p in res.profiles(model):
            if p == baseline or (model, p) not in counts or remedied(res.arms.get((model, p), {})):
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


def _spread(values: list[float], digits: int = 4) -> dict[str, float] | None:
    if not values:
        return None
    return {k: round(_quantile(values, q), digits) for k, q in
            (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("max", 1.0))}


def expansion_stats(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"requests", "sources": {source: n}, "tools_added", "cosine": {min, p25, median, p75,
    max}, "twins_skipped", "below_band"}}} from what toolkit_expansion reported on each scored pair."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for model, profile, report in step_reports(res, names_of(EXPANSION)):
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


#: an arm whose counter's tokens and the backend's own count (`usage.prompt_tokens`) differ by more than this share
#: is flagged: its budgets do not mean the model's tokens
BACKEND_TOLERANCE = 0.05


def backend_tokens(pairs: list[tuple[float, float]]) -> dict[str, Any] | None:
    """The backend's own count beside the counter's, over the requests that have both ((counter, backend) each):
    {"requests", "median", "counter_median", "ratio" (backend / counter), "differs" (by more than
    BACKEND_TOLERANCE)}; None when no request has both."""
    if not pairs:
        return None
    mine, theirs = _quantile([c for c, _ in pairs], 0.5), _quantile([b for _, b in pairs], 0.5)
    ratio_ = theirs / mine if mine else None
    return {"requests": len(pairs), "median": round(theirs), "counter_median": round(mine),
            "ratio": None if ratio_ is None else round(ratio_, 3),
            "differs": ratio_ is None or abs(ratio_ - 1) > BACKEND_TOLERANCE}


def padding_stats(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"requests", "budget_tokens", "token_counter": {source: n}, "tokens_after": spread,
    "tools_after": spread, "backend_tokens": `backend_tokens`, "mode"}}}: the tokens each catalog_padding arm
    actually reached, by the counter it used, and as the backend counted them."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for model, profile, report, usage in step_usage(res, names_of(CATALOG)):
        a = acc.setdefault((model, profile), {"requests": 0, "token_counter": Counter(), "tokens": [], "tools": [],
                                              "backend": []})
        a["requests"] += 1
        a["token_counter"][str(report.get("token_counter", "unknown"))] += 1
        if isinstance(report.get("tokens_after"), int):
            a["tokens"].append(float(report["tokens_after"]))
            if usage is not None:
                a["backend"].append((float(report["tokens_after"]), float(usage)))
        if isinstance(report.get("tools_after"), int):
            a["tools"].append(float(report["tools_after"]))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, profile), a in acc.items():
        spec = res.arms.get((model, profile), {}).get("perturbers") or []
        step = step_of(spec, CATALOG)
        budget = None if step is None else step.get("params", {}).get("budget_tokens")
        out.setdefault(model, {})[profile] = {
            "requests": a["requests"], "budget_tokens": budget, "token_counter": dict(a["token_counter"]),
            "tokens_after": _spread(a["tokens"], 0), "tools_after": _spread(a["tools"], 1),
            "backend_tokens": backend_tokens(a["backend"]), "mode": catalog_mode({"perturbers": spec})}
    return out


def padding_reached(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {budget: {"requests", "median", "token_counter": {source: n}}}}: the tokens the catalog_padding arms
    of each budget actually reached (their reports' `tokens_after`, all positions pooled), for the heatmap labels."""
    acc: dict[tuple[str, int], dict[str, Any]] = {}
    for model, profile, report in step_reports(res, names_of(CATALOG)):
        spec = res.arms.get((model, profile), {}).get("perturbers") or []
        step = step_of(spec, CATALOG)
        budget = None if step is None else param(step, "budget_tokens")
        if budget is None or not isinstance(report.get("tokens_after"), int):
            continue
        a = acc.setdefault((model, int(budget)), {"tokens": [], "token_counter": Counter()})
        a["tokens"].append(float(report["tokens_after"]))
        a["token_counter"][str(report.get("token_counter", "unknown"))] += 1
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, budget), a in sorted(acc.items()):
        out.setdefault(model, {})[str(budget)] = {"requests": len(a["tokens"]),
                                                  "median": round(_quantile(a["tokens"], 0.5)),
                                                  "token_counter": dict(a["token_counter"])}
    return out


def rephrasers(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"rephraser", "generator_url", "self", "pairs": {rephraser: n}}}}: who rephrased each arm
    with a rephrasing step (seed 001's rephrased query): the fixed generator model the arm names, or the model under
    test itself (`self`, accepted with `replay --self-rephrase`); `pairs` counts the scored pairs' reports."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, profile), spec in res.arms.items():
        step = step_of(spec.get("perturbers") or [], REPHRASING)
        if step is None:
            continue
        fixed = (step.get("params") or {}).get("generator_model") or ""
        out.setdefault(model, {})[profile] = {
            "rephraser": fixed or "the model under test", "self": not fixed,
            "generator_url": (step.get("params") or {}).get("generator_url"), "pairs": Counter()}
    for model, profile, report in step_reports(res, names_of(REPHRASING)):
        if isinstance(report.get("rephraser"), str) and profile in out.get(model, {}):
            out[model][profile]["pairs"][report["rephraser"]] += 1
    for arms in out.values():
        for a in arms.values():
            a["pairs"] = dict(a["pairs"])
    return out


#: which of seed 001's two rephrasing drops its Table 2 gives: over all cases (its manual review found no drift)
CHECKED, ALL_CASES = "checked", "all cases"


def rephrasing_drops(res: Results, summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 001's rephrasing drop both ways, per model and rephrasing arm: `cases` = "checked" (a rephrasing the
    value check rejects, `rejected_for`, is not sent; the pair leaves the arm, not perturbed) or "all cases"
    (`rejected = "send"`: sent anyway, and counted in `rejected_sent`); `table2` says which one the paper's Table 2
    corresponds to (all cases: the paper rephrased all 200 and kept them after a review). {model: {profile: {"cases",
    "table2", "n", "accuracy", "drop_vs_off", "drop_vs_off_ci", "paired_n", "not_perturbed", "rejected_sent"}}}."""
    sent: Counter[tuple[str, str]] = Counter()
    for model, profile, report in step_reports(res, names_of(REPHRASING)):
        if report.get("rejected_for") and NOT_PERTURBED not in report:  # rejected by the value check, sent anyway
            sent[(model, profile)] += 1
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model, data in summary["models"].items():
        for p, arm in data["arms"].items():
            step = None if remedied(arm) else step_of(arm.get("perturbers") or [], REPHRASING)
            if step is None:
                continue
            every = (step.get("params") or {}).get("rejected") == "send"
            out.setdefault(model, {})[p] = {
                "cases": ALL_CASES if every else CHECKED, "table2": every, "n": arm["n"], "accuracy": arm["accuracy"],
                "drop_vs_off": arm.get("drop_vs_off"), "drop_vs_off_ci": arm.get("drop_vs_off_ci"),
                "paired_n": (arm.get("paired") or {}).get("n"), "not_perturbed": arm.get("not_perturbed", 0),
                "rejected_sent": sent[(model, p)]}
    return out


def lengthening_stats(res: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {profile: {"requests", "budget_tokens", "token_counter": {counter: n}, "tokens_total": spread}}}: the
    tokens each long-response / long-conversation arm (seed 003 challenges 2 and 3) reached, by the counter it
    used (one report per lengthened request; a multi-turn pair may hold several). A request left out of its arm (a
    given conversation that did not hold its budget) is counted in `requests`, not in the tokens reached."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    for model, profile, report, usage in step_usage(res, names_of(RESPONSES) + names_of(CONVERSATIONS)):
        a = acc.setdefault((model, profile), {"requests": 0, "token_counter": Counter(), "tokens": [],
                                              "budget": report.get("budget_tokens"), "backend": []})
        a["requests"] += 1
        a["token_counter"][str(report.get("counter", "unknown"))] += 1
        if isinstance(report.get("tokens_total"), int) and NOT_PERTURBED not in report:
            a["tokens"].append(float(report["tokens_total"]))
            # the whole request's tokens (a response-scoped budget counts the response alone: not compared)
            if usage is not None and report.get("budget_scope", "request") != "response":
                a["backend"].append((float(report["tokens_total"]), float(usage)))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, profile), a in acc.items():
        out.setdefault(model, {})[profile] = {"requests": a["requests"], "budget_tokens": a["budget"],
                                              "token_counter": dict(a["token_counter"]),
                                              "tokens_total": _spread(a["tokens"], 0),
                                              "backend_tokens": backend_tokens(a["backend"])}
    return out


def _arms_with(data: dict[str, Any], experiment: str) -> dict[str, dict[str, Any]]:
    return {p: arm for p, arm in data["arms"].items()
            if not remedied(arm) and any(experiment_of(s) == experiment for s in arm.get("perturbers") or [])
            and (experiment != FORMATS or _format_arm(arm))}


def _format_arm(arm: dict[str, Any]) -> bool:
    """An arm of seed 002's format configurations: a format_rewrite step and no catalog padding (the prompting-mode
    catalog arms of @seed003-prompt belong to seed 003's grid)."""
    steps = arm.get("perturbers") or []
    return step_of(steps, FORMATS) is not None and step_of(steps, CATALOG) is None


def format_sensitivity(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """BFCL's per-model statistics over the format configurations (arms with format_rewrite): `max_delta` =
    (max − min) accuracy in points, `std` = sample standard deviation in points, `variance` in points²,
    rounded to 2 decimals as BFCL prints them (bfcl-spec §4.6)."""
    out = {}
    for model, data in summary["models"].items():
        accs = [a["accuracy"] for a in _arms_with(data, FORMATS).values() if a["accuracy"] is not None]
        if len(accs) < 2:
            continue
        out[model] = {"configs": len(accs), "max_delta": round((max(accs) - min(accs)) * 100, 2),
                      "std": round(statistics.stdev(accs) * 100, 2),
                      "variance": round(statistics.variance(accs) * 10000, 2)}
    return out


def _extremes(values: list[tuple[float, str]]) -> dict[str, Any]:
    """Max and Min of (accuracy, arm) pairs, the arms that gave them, `deg` = (Max − Min) in points and
    `deg_relative` = (Max − Min) / Max in percent (seed 003 Tables 6 and 7 follow this one)."""
    hi, lo = max(values), min(values)
    return {"max": hi[0], "max_arm": hi[1], "min": lo[0], "min_arm": lo[1], "deg": round((hi[0] - lo[0]) * 100, 2),
            "deg_relative": round((hi[0] - lo[0]) / hi[0] * 100, 2) if hi[0] else None, "arms": len(values)}


def padding_extremes(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 1: per model and category, the best (Max) and worst (Min) accuracy over the catalog-padding
    arms (budgets × positions), the arms that gave them, `deg` = (Max − Min) in points, and the paper's directional
    `drop` from the smallest budget to the largest, each pooled over its positions (`directional_drop`)."""
    return _category_extremes(summary, lambda budget, position, grid: True, directional=True)


def directional_drop(by_budget: dict[int, list[int]]) -> dict[str, Any] | None:
    """Seed 003's % degradation (Tables 1 and 5), which is directional: from the shortest catalog to the longest,
    `relative` = (first − last) / first in percent (negative when accuracy rose: the paper's −20.88 for GPT-4o on
    live_simple in Table 5), `points` = (first − last) in points; `by_budget` = {budget: [valid, scored]} (arms
    of one budget pooled). None with fewer than two budgets."""
    scored = {b: vn for b, vn in by_budget.items() if vn[1]}
    if len(scored) < 2:
        return None
    first, last = min(scored), max(scored)
    a, z = ratio(*scored[first]), ratio(*scored[last])
    rel = relative_drop(z, a)
    return {"from_budget": first, "to_budget": last, "from_accuracy": a, "to_accuracy": z,
            "points": round((a - z) * 100, 2), "relative": None if rel is None else round(-rel * 100, 2)}


def position_key(position: Any) -> tuple[int, float]:
    """Sort key of a position: a fraction in [0, 1], or a 1-based index (index 1 is the first slot, like 0.0)."""
    if isinstance(position, bool) or not isinstance(position, (int, float)):
        return (2, 0.0)
    if isinstance(position, int):
        return (0, 0.0) if position == 1 else (1, float(position))
    return (0, float(position))


def grid_arms(data: dict[str, Any], experiment: str, *keys: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(profile, {key: value}, arm) of one model's scored arms with a step of `experiment`, its parameters `keys`
    read from the arm's definition (the perturber's default when the arm leaves one out); arms lacking a budget are
    skipped."""
    out = []
    for p, arm in data["arms"].items():
        step = None if remedied(arm) else step_of(arm.get("perturbers") or [], experiment)
        if step is None or not arm["n"]:
            continue
        values = {k: param(step, k) for k in keys}
        if values.get("budget_tokens") is None:
            continue
        out.append((p, values, arm))
    return out


def _category_extremes(summary: dict[str, Any], keep: Any, directional: bool = False, held: Any = None
                       ) -> dict[str, dict[str, dict[str, Any]]]:
    """Max / Min / %Deg per model and category over the catalog-padding arms that `keep(budget, position, grid)`
    selects (grid: every (budget, position) of the model's arms); with `directional`, the paper's `drop` from the
    smallest budget to the largest (`directional_drop`); `held(grid)` gives the keys each entry adds (what the
    table holds fixed). Arms in prompting mode (`@seed003-prompt`) are their own
    group, `<model> [prompting]`: never mixed with native tools."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model, data in summary["models"].items():
        for mode, arms in catalog_modes(grid_arms(data, CATALOG, "budget_tokens", "position")).items():
            label = model if mode == NATIVE else f"{model} [{mode}]"
            grid = [(int(v["budget_tokens"]), v["position"]) for _, v, _ in arms]
            per_cat: dict[str, list[tuple[float, str]]] = defaultdict(list)
            failed: dict[tuple[str, str], int] = {}
            refused: Counter[str] = Counter()
            by_budget: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
            for p, v, arm in arms:
                if not keep(int(v["budget_tokens"]), v["position"], grid):
                    continue
                for cat, numbers in arm["by_category"].items():
                    refused[cat] += numbers.get("not_comparable", 0)
                    if numbers["accuracy"] is not None:
                        per_cat[cat].append((numbers["accuracy"], p))
                        failed[(cat, p)] = numbers.get("failed", 0)
                        cell = by_budget[cat][int(v["budget_tokens"])]
                        cell[0] += round(numbers["accuracy"] * numbers["n"])
                        cell[1] += numbers["n"]
            for cat, values in sorted(per_cat.items()):
                e = out.setdefault(label, {})[cat] = _extremes(values)
                e.update(max_failed=failed[(cat, e["max_arm"])], min_failed=failed[(cat, e["min_arm"])],
                         not_comparable=refused[cat], mode=mode)
                if directional:
                    e["drop"] = directional_drop(by_budget[cat])
                if held is not None:
                    e.update(held(grid))
    return out


#: how an arm's catalog reaches the model: as native `tools`, or rendered into the prompt (BFCL's prompting mode)
NATIVE, PROMPTING = "native tools", "prompting"


def catalog_mode(arm: dict[str, Any]) -> str:
    """`prompting` for an arm whose steps also move the tools into the prompt (format_rewrite), else native."""
    return PROMPTING if step_of(arm.get("perturbers") or [], FORMATS) is not None else NATIVE


def catalog_modes(arms: list[tuple[str, dict[str, Any], dict[str, Any]]]
                  ) -> dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]]:
    """`grid_arms`' arms split by `catalog_mode` (native first)."""
    out: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}
    for entry in sorted(arms, key=lambda e: catalog_mode(e[2]) != NATIVE):
        out.setdefault(catalog_mode(entry[2]), []).append(entry)
    return out


def _fixed_position(grid: list[tuple[int, Any]]) -> Any:
    """Seed 003 Table 5's position: 0.1 when an arm has it, else the first position of the grid."""
    positions = [p for _, p in grid]
    return 0.1 if 0.1 in positions else min(positions, key=position_key)


def padding_same_position(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 5: Max / Min / %Deg per model and category over the catalog sizes at one position (0.1 when
    the arms have it, else the first), and the paper's directional `drop` from the smallest budget to the largest
    at that position; each entry names the `position`."""
    return _category_extremes(summary, lambda b, p, grid: p == _fixed_position(grid), directional=True,
                              held=lambda grid: {"position": _fixed_position(grid)})


def padding_same_budget(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 6: Max / Min / %Deg per model and category over the positions at the largest catalog size
    (the paper's 120K; its % degradation there is (Max − Min) / Max); each entry names the `budget_tokens`."""
    return _category_extremes(summary, lambda b, p, grid: b == max(x for x, _ in grid),
                              held=lambda grid: {"budget_tokens": max(b for b, _ in grid)})


def _point(p: str, arm: dict[str, Any], **where: Any) -> dict[str, Any]:
    return {"profile": p, **where, "n": arm["n"], "accuracy": arm["accuracy"], "accuracy_ci": arm["accuracy_ci"],
            "failed": arm["failed"], "not_comparable": sum((arm.get("not_comparable") or {}).values())}


def response_experiments(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 7 and Fig. 4 (challenge 2) from the response_lengthening arms, per model:
    `context_length` = the arms at the first position across response budgets (Fig. 4a), `answer_position` = the
    arms at the largest budget across positions, labelled p1..pN in sorted order (Fig. 4b); each {"position" or
    "budget_tokens" held fixed, "points": [{profile, budget_tokens | position, label, n, accuracy, accuracy_ci}],
    and Max / Min / deg / deg_relative over the points} (an experiment needs two points)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model, data in summary["models"].items():
        arms = grid_arms(data, RESPONSES, "budget_tokens", "position")
        if not arms:
            continue
        first = min((v["position"] for _, v, _ in arms), key=position_key)
        largest = max(int(v["budget_tokens"]) for _, v, _ in arms)
        by_size = sorted((_point(p, a, budget_tokens=int(v["budget_tokens"]), label=_k(int(v["budget_tokens"])))
                          for p, v, a in arms if position_key(v["position"]) == position_key(first)),
                         key=lambda pt: (pt["budget_tokens"], pt["profile"]))
        at_largest = sorted(((p, v, a) for p, v, a in arms if int(v["budget_tokens"]) == largest),
                            key=lambda pva: (position_key(pva[1]["position"]), pva[0]))
        order = list(dict.fromkeys(position_key(v["position"]) for _, v, _ in at_largest))
        by_pos = [_point(p, a, position=v["position"], label=f"p{order.index(position_key(v['position'])) + 1}")
                  for p, v, a in at_largest]
        mine = {}
        for name, fixed, points in (("context_length", {"position": first}, by_size),
                                    ("answer_position", {"budget_tokens": largest}, by_pos)):
            values = [(pt["accuracy"], pt["profile"]) for pt in points if pt["accuracy"] is not None]
            if len(values) >= 2:
                mine[name] = {**fixed, "points": points, **_extremes(values),
                              "not_comparable": sum(pt["not_comparable"] for pt in points)}
        if mine:
            out[model] = mine
    return out


def _k(tokens: int) -> str:
    return f"{tokens / 1000:g}K"


def conversation_grid(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Seed 003 Table 2 (challenge 3): accuracy with its 95 % Wilson interval per model, setting and conversation
    budget, from the conversation_lengthening arms; the setting is the arm's `fact` (where the needed fact sits)
    when the arm names one other than `any`, else its `setting`; arms whose conversations were played live (BFCL's
    loop and verdict) are grouped apart (`played, ` before the setting) from the given ones (the paper's protocol).
    Arms in the same cell are pooled.
    {model: {setting: {budget: {"profiles", "conversation", "n", "valid", "failed", "accuracy", "accuracy_ci",
    "final_call" | "one_call", "multi_call"}}}}; `failed` = the pairs whose requests failed on the backend's side,
    counted in n as wrong. Played: `accuracy` is BFCL's whole-conversation verdict and `final_call` = {"n", "valid",
    "accuracy", "accuracy_ci"} the AST verdict on the last turn's calls (rows recorded before it have none). Given:
    `accuracy` is the next call's AST verdict, and `one_call` / `multi_call` the same over the last turns whose
    ground truth makes one call / several (only the first graded)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for model, data in summary["models"].items():
        cells: dict[tuple[str, int], dict[str, Any]] = {}
        for p, v, arm in grid_arms(data, CONVERSATIONS, "budget_tokens", "setting"):
            step = step_of(arm["perturbers"], CONVERSATIONS) or {}
            fact = (step.get("params") or {}).get("fact")
            given = arm.get("conversation") == "given"
            group = ("" if given else "played, ") + (f"fact {fact}" if fact not in (None, "any")
                                                     else f"setting {v['setting']}")
            c = cells.setdefault((group, int(v["budget_tokens"])),
                                 {"profiles": [], "conversation": "given" if given else "played", "n": 0, "valid": 0,
                                  "failed": 0, "not_comparable": 0})
            c["profiles"].append(p)
            c["n"] += arm["n"]
            c["not_comparable"] += sum((arm.get("not_comparable") or {}).values())
            c["failed"] += arm["failed"]
            c["valid"] += round(arm["accuracy"] * arm["n"])
            parts = ((("final_call", arm.get("final_call")),) if not given else
                     (("one_call", (arm.get("next_call") or {}).get("one_call")),
                      ("multi_call", (arm.get("next_call") or {}).get("multi_call"))))
            for key, part in parts:
                if part:
                    c.setdefault(key, {"n": 0, "valid": 0})
                    c[key]["n"] += part["n"]
                    c[key]["valid"] += part["valid"]
        for (group, budget), c in sorted(cells.items()):
            c.update(accuracy=ratio(c["valid"], c["n"]), accuracy_ci=wilson_ci(c["valid"], c["n"]))
            for key in ("final_call", "one_call", "multi_call"):
                if key in c:
                    f = c[key]
                    f.update(accuracy=ratio(f["valid"], f["n"]), accuracy_ci=wilson_ci(f["valid"], f["n"]))
            out.setdefault(model, {}).setdefault(group, {})[str(budget)] = c
    return out


def conversation_unplaced(res: Results, summary: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The given conversations (seed 003 challenge 3) whose fact could not be placed, or whose request did not hold
    its budget: {model: [{"case_id", "profiles", "reason"}]}, one entry per case and reason (the arms it held in).
    Such a pair is left out of its arm, never scored at another length."""
    given = {(m, p) for m, data in summary["models"].items() for p, arm in data["arms"].items()
             if arm.get("conversation") == "given"}
    found: dict[str, dict[tuple[str, str], list[str]]] = {}
    for model, profile, case_id, text in scored_steps(res):
        if (model, profile) not in given or not text or NOT_PERTURBED not in text:
            continue
        applied = (json.loads(text) or {}).get("applied")
        reasons = [str(a["report"][NOT_PERTURBED]) for a in applied if isinstance(a, dict)
                   and NOT_PERTURBED in (a.get("report") or {})] if isinstance(applied, list) else []
        if applied and len(reasons) == len(applied):
            found.setdefault(model, {}).setdefault((case_id, "; ".join(reasons)), []).append(profile)
    order = {(m, p): i for m, data in summary["models"].items() for i, p in enumerate(data["arms"])}
    return {model: [{"case_id": c, "profiles": sorted(ps, key=lambda p: order[(model, p)]), "reason": why}
                    for (c, why), ps in sorted(pairs.items())] for model, pairs in found.items()}


def _params(perturbers: list[dict[str, Any]], experiment: str) -> dict[str, Any] | None:
    step = step_of(perturbers, experiment)
    return None if step is None else step.get("params") or {}


def padding_grid(summary: dict[str, Any], model: str, category: str | None = None, mode: str = NATIVE
                 ) -> tuple[list[int], list[float], dict[tuple[int, float], float]]:
    """Seed 003 Fig. 3 data for one model (one subset with `category`, else all pooled) and one `catalog_mode`:
    budgets, positions, accuracy per (budget, position)."""
    cells = {k: v / n for k, (v, n) in padding_counts(summary, model, category, mode).items() if n}
    return sorted({b for b, _ in cells}), sorted({p for _, p in cells}), cells


def padding_counts(summary: dict[str, Any], model: str, category: str | None = None, mode: str = NATIVE
                   ) -> dict[tuple[int, float], tuple[int, int]]:
    """(valid, scored) per (catalog budget, position) for one model's arms in one `catalog_mode` (native tools or
    prompting: never pooled together), arms with the same cell pooled; with `category`, that subset's pairs only."""
    pooled: dict[tuple[int, float], list[int]] = defaultdict(lambda: [0, 0])
    for arm in summary["models"][model]["arms"].values():
        if catalog_mode(arm) != mode or remedied(arm):
            continue
        params = _params(arm["perturbers"], CATALOG)
        numbers = arm if category is None else arm["by_category"].get(category)
        if params is None or not numbers or not numbers["n"]:
            continue
        if "budget_tokens" not in params or "position" not in params:
            continue
        key = (int(params["budget_tokens"]), round(float(params["position"]), 3))
        pooled[key][0] += round(numbers["accuracy"] * numbers["n"])
        pooled[key][1] += numbers["n"]
    return {k: (v, n) for k, (v, n) in pooled.items()}


#: seed 003's figure of each BFCL subset in challenge 1 (one heatmap per model each; Fig. 5 averages them)
CATALOG_FIGURES = {"live_simple": "Fig. 3", "simple": "Fig. 6", "simple_python": "Fig. 6", "multiple": "Fig. 7"}


def catalog_categories(summary: dict[str, Any]) -> list[str]:
    """The subsets the catalog-padding arms scored, the paper's figure order first (live_simple, simple,
    multiple), then the others by name."""
    found = {c for data in summary["models"].values() for arm in data["arms"].values()
             if not remedied(arm) and _params(arm["perturbers"], CATALOG) is not None
             for c, n in arm["by_category"].items() if n["n"]}
    order = list(CATALOG_FIGURES)
    return sorted(found, key=lambda c: (order.index(c) if c in order else len(order), c))


def catalog_heatmap_title(category: str | None) -> str:
    """The title of the catalog heatmap of one subset (None: every subset pooled)."""
    if category is None:
        return "Seed 003 challenge 1, all subsets: accuracy (valid/scored), catalog size × position"
    figure = CATALOG_FIGURES.get(category)
    return f"Seed 003 {figure or 'challenge 1'}, {category}: accuracy (valid/scored), catalog size × position"


def format_grid(summary: dict[str, Any]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """Seed 002 Fig. 2 data: configuration labels (published order first), models, accuracy per cell."""
    order = {format_label(c): i for i, c in enumerate(format_configurations())}
    cells: dict[tuple[str, str], float] = {}
    for model, data in summary["models"].items():
        for arm in data["arms"].values():
            params = _params(arm["perturbers"], FORMATS)
            if params is None or not arm["n"] or not _format_arm(arm):
                continue
            cells[(format_label(params), model)] = arm["accuracy"]
    labels = sorted({c for c, _ in cells}, key=lambda c: (order.get(c, len(order)), c))
    return labels, [m for m in summary["models"] if any(k[1] == m for k in cells)], cells


def format_counts(summary: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """(valid, scored) per (format configuration, model), the counts behind `format_grid`'s cells."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for model, data in summary["models"].items():
        for arm in data["arms"].values():
            params = _params(arm["perturbers"], FORMATS)
            if params is not None and arm["n"] and _format_arm(arm):
                out[(format_label(params), model)] = (round(arm["accuracy"] * arm["n"]), arm["n"])
    return out


def _budget_label(b: int) -> str:
    return f"{b // 1024}K" if b % 1024 == 0 else f"{b / 1000:g}K"


def budget_ticks(summary: dict[str, Any], model: str, budgets: list[int]) -> list[str]:
    """The catalog heatmap's budget labels: the nominal budget, and the median tokens its arms actually reached
    (their reports' `tokens_after`, `padding_reached`), e.g. `32K (≈31.9K)`."""
    reached = (summary.get("padding_reached") or {}).get(model) or {}
    return [_budget_label(b) + (f" (≈{reached[str(b)]['median'] / 1000:.1f}K)" if str(b) in reached else "")
            for b in budgets]


def sections(res: Results, baseline: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's keys for these measures (`toolquake report --format json`)."""
    return {"caused_errors": caused_failures(res, baseline), "expansion": expansion_stats(res),
            "padding": padding_stats(res), "padding_extremes": padding_extremes(summary),
            "padding_same_position": padding_same_position(summary),
            "padding_same_budget": padding_same_budget(summary), "padding_reached": padding_reached(res),
            "lengthening": lengthening_stats(res), "rephrasers": rephrasers(res),
            "rephrasing_drops": rephrasing_drops(res, summary),
            "response_experiments": response_experiments(summary), "conversation_grid": conversation_grid(summary),
            "conversation_unplaced": conversation_unplaced(res, summary),
            "format_sensitivity": format_sensitivity(summary)}


_EXTREME_HEADER = ["Max", "Max arm", "Min", "Min arm", "% Deg. (points)", "% Deg. (relative)", "arms",
                   "not comparable"]
#: Tables 1 and 5: the paper's % degradation is directional (shortest catalog → longest), Max − Min beside it
_DIRECTIONAL_HEADER = ["Max", "Max arm", "Min", "Min arm", "% Deg. (relative): shortest → longest",
                       "% Deg. (points): shortest → longest", "Max − Min (points)", "(Max − Min) / Max", "arms",
                       "not comparable"]


def _failed(count: int | None) -> str:
    return f" ({count} failed)" if count else ""


def _conversation_cell(c: dict[str, Any]) -> str:
    return (f"{_acc_ci(c)} (n={c['n']}" + (f", {c['failed']} failed" if c.get("failed") else "")
            + (f", {c['not_comparable']} not comparable" if c.get("not_comparable") else "") + ")")


#: Table 2's row labels: the cell's own verdict (given: None; played) and its parts
CONVERSATION_VERDICTS = {
    None: "AST, next call (the paper's score)",
    "one_call": "… last turns of one call",
    "multi_call": "… last turns of 2+ calls (the first graded)",
    "played": "BFCL, whole conversation",
    "final_call": "AST, the last turn's calls",
}


def _extreme_cells(e: dict[str, Any]) -> list[str]:
    rel = "" if e.get("deg_relative") is None else f"{e['deg_relative']:.2f}"
    spread = [f"{e['deg']:.2f}", rel, str(e["arms"]), str(e.get("not_comparable", 0))]
    head = [f"{e['max']:.3f}", e["max_arm"] + _failed(e.get("max_failed")), f"{e['min']:.3f}",
            e["min_arm"] + _failed(e.get("min_failed"))]
    if "drop" not in e:
        return [*head, *spread]
    drop = e["drop"] or {}
    span = f"{_budget_label(drop['from_budget'])} → {_budget_label(drop['to_budget'])}" if drop else ""
    directional = ["" if drop.get("relative") is None else f"{drop['relative']:.2f} ({span})",
                   "" if drop.get("points") is None else f"{drop['points']:.2f}"]
    return [*head, *directional, *spread]


def _acc_ci(point: dict[str, Any]) -> str:
    ci = point.get("accuracy_ci")
    if point.get("accuracy") is None:
        return "–"
    return f"{point['accuracy']:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def _share(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the tables these measures add to the report."""
    return [*_seed001_tables(summary), *_rephrasing_drop_table(summary), *_rephraser_table(summary),
            *_seed003_tables(summary),
            *_format_and_padding_tables(summary)]


def _rephrasing_drop_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = []
    for model, arms in (summary.get("rephrasing_drops") or {}).items():
        for p, d in arms.items():
            drop, ci = d["drop_vs_off"], d["drop_vs_off_ci"]
            rows.append([model, p, "all cases, rejected rephrasings sent (labelled)" if d["table2"] else
                         "cases whose rephrasing passed the value check", "yes" if d["table2"] else "no",
                         str(d["n"]), "" if d["accuracy"] is None else f"{d['accuracy']:.3f}",
                         "" if drop is None else f"{drop * 100:+.1f} %" + ("" if ci is None else
                                                                          f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]"),
                         str(d["paired_n"] or 0), str(d["not_perturbed"]), str(d["rejected_sent"])])
    if not rows:
        return []
    return [("Seed 001 Table 2 (left), the rephrased query: the drop against the baseline on the cases whose "
             "rephrasing passed the value check, and on all cases (the rejected rephrasings — mostly numbers or dates "
             "reformatted, which break exact matching most — sent anyway and counted); the paper's Table 2 is over "
             "all its cases (a manual review found no drift), so compare the all-cases arm with it",
             ["model", "profile", "cases", "the paper's Table 2", "n", "accuracy", "drop [95 % CI]", "paired cases",
              "not perturbed (left out)", "rejected rephrasings sent"], rows)]


def _rephraser_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = [[model, p, a["rephraser"] + (" (self-rephrasing)" if a["self"] else " (fixed)"), a["generator_url"] or "",
             ", ".join(f"{r} {n}" for r, n in a["pairs"].items())]
            for model, arms in (summary.get("rephrasers") or {}).items() for p, a in arms.items()]
    if not rows:
        return []
    return [("Rephrased arms: who rephrased the queries (seed 001 used one fixed rephraser for every model; "
             "self-rephrasing gives each model its own text)", ["model", "profile", "rephraser", "at", "pairs"], rows)]


def _seed001_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Seed 001 Table 2 (right), the pairs not perturbed, the toolkit expansion."""
    out = []
    caused = summary.get("caused_errors") or {}
    fine_cols = [t for t in TAXONOMY if any(arm["fine_counts"].get(t) for m in caused.values() for arm in m.values())]
    extra = [FAILED_CLASS] if any(arm["counts"].get(FAILED_CLASS) for m in caused.values() for arm in m.values()) \
        else []
    rows = [[model, p, str(arm["n"]), *(_share(arm["classes"].get(c)) for c in PAPER_CLASSES),
             *(_share(arm["classes"].get(c, 0.0)) for c in extra), *(_share(arm["fine"].get(t)) for t in fine_cols)]
            for model, arms in caused.items() for p, arm in arms.items()]
    if rows:
        out.append((f"Seed 001 Table 2 (right): failures the perturbation caused (valid in `{summary['baseline']}`, "
                    "invalid in the arm), share of each of the paper's four classes (and of the requests that failed "
                    "on the backend's side, when any did), our nine types beside",
                    ["model", "profile", "caused failures", *(f"wrong {c}" for c in PAPER_CLASSES), *extra,
                     *fine_cols], rows))
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
    return out


def _seed003_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Seed 003 Tables 1, 5, 6 (catalog padding), 7 (long tool responses) and 2 (long conversations)."""
    out = []
    directional = ("; % degradation as the paper's, directional: from the smallest catalog to the largest "
                   "((first − last) / first; in Table 1 each budget's positions pooled; negative when accuracy rose), "
                   "Max − Min beside it")
    for key, title, fixed in (
            ("padding_extremes", "Seed 003 Table 1: best and worst accuracy over the catalog-padding arms per "
             "category" + directional, None),
            ("padding_same_position", "Seed 003 Table 5: the same over the catalog sizes at one position" + directional,
             "position"),
            ("padding_same_budget", "Seed 003 Table 6: the same over the positions at the largest catalog size; "
             "degradation (Max − Min) in points and relative to Max, as the paper's", "budget_tokens")):
        rows = [[model, cat, *([str(e[fixed])] if fixed else []), *_extreme_cells(e)]
                for model, cats in (summary.get(key) or {}).items() for cat, e in cats.items()]
        if rows:
            header = _DIRECTIONAL_HEADER if key != "padding_same_budget" else _EXTREME_HEADER
            out.append((title + "; a model in prompting mode (@seed003-prompt) is its own row, `<model> [prompting]`; "
                        "pairs the backend refused for the request's shape are not comparable, in no number",
                        ["model", "category", *([fixed.replace("_tokens", "")] if fixed else []), *header], rows))
    rows = []
    for model, exps in (summary.get("response_experiments") or {}).items():
        for name, label, fixed in (("context_length", "context length (response size)", "position"),
                                   ("answer_position", "answer position", "budget_tokens")):
            e = exps.get(name)
            if e:
                rows.append([model, label, f"{fixed.replace('_tokens', '')} {e[fixed]}",
                             ", ".join(f"{pt['label']}" + (f" ({pt['position']:g})" if "position" in pt else "")
                                       + f" {_acc_ci(pt)}" + _failed(pt.get("failed")) for pt in e["points"]),
                             *_extreme_cells(e)])
    if rows:
        out.append(("Seed 003 Table 7 (challenge 2, long tool responses): accuracy [95 % Wilson] over the response "
                    "sizes at the first position, and over the positions at the largest size (Fig. 4)",
                    ["model", "experiment", "held fixed", "points", *_EXTREME_HEADER], rows))
    conv = summary.get("conversation_grid") or {}
    budgets = sorted({int(b) for groups in conv.values() for cells in groups.values() for b in cells})
    rows = []
    for model, groups in conv.items():
        for group, cells in groups.items():
            given = any(c.get("conversation") == "given" for c in cells.values())
            rows.append([model, group, CONVERSATION_VERDICTS[None if given else "played"],
                         *(_conversation_cell(cells[str(b)]) if str(b) in cells else "" for b in budgets)])
            for key in ("one_call", "multi_call") if given else ("final_call",):
                if any(key in c for c in cells.values()):
                    rows.append([model, group, CONVERSATION_VERDICTS[key],
                                 *(_conversation_cell(cells[str(b)][key]) if key in cells.get(str(b), {}) else ""
                                   for b in budgets)])
    if rows:
        out.append(("Seed 003 Table 2 (challenge 3, long conversations): accuracy [95 % Wilson] per setting (where "
                    "the needed fact sits) and conversation size. Given (the paper's protocol): the conversation up "
                    "to its last user turn is the ground truth's, one request, its next call graded by AST against "
                    "the turn's first ground-truth call, apart for last turns of one and of several calls. Played "
                    "(`played, …`): the model plays every turn, BFCL's whole-conversation verdict and the AST "
                    "verdict on the last turn's calls",
                    ["model", "setting", "verdict", *(_k(b) for b in budgets)], rows))
    rows = [[model, u["case_id"], ", ".join(u["profiles"]), u["reason"]]
            for model, items in (summary.get("conversation_unplaced") or {}).items() for u in items]
    if rows:
        out.append(("Seed 003 challenge 3: given conversations whose fact could not be placed, or whose request did "
                    "not hold its budget (±2 % by the run's counter); left out of these arms",
                    ["model", "case", "arms", "why"], rows))
    rows = [[model, p, str(arm["final_call"]["n"]), _acc_ci({"accuracy": arm["final_call"]["bfcl_accuracy"],
                                                             "accuracy_ci": arm["final_call"]["bfcl_accuracy_ci"]}),
             _acc_ci(arm["final_call"])]
            for model, data in summary["models"].items() for p, arm in data["arms"].items() if arm.get("final_call")]
    if rows:
        out.append(("Played multi-turn arms: BFCL's whole-conversation accuracy and, beside it, the AST accuracy of "
                    "all the calls of the last turn (not seed 003's protocol: its next-call score is the given "
                    "conversations' Table 2) [95 % Wilson]",
                    ["model", "profile", "conversations", "BFCL, whole conversation", "AST, final call"], rows))
    return out


#: the column beside the counter's figure: what the backend itself counted
BACKEND_HEADER = "backend's prompt_tokens median (÷ counter's)"


def _backend_cell(b: dict[str, Any] | None) -> str:
    """`8,143 (0.994)`, flagged when the backend's count and the counter's differ by more than 5 %."""
    if not b:
        return "not reported"
    ratio_ = "–" if b["ratio"] is None else f"{b['ratio']:.3f}"
    flag = f" DIFFERS by more than {BACKEND_TOLERANCE:.0%}: budgets are not the model's tokens" if b["differs"] else ""
    return f"{b['median']} ({ratio_}){flag}"


def _format_and_padding_tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Format sensitivity (seed 002) and the tokens the catalog-padding arms reached."""
    out = []
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
            rows.append([model, p, a.get("mode", NATIVE), str(a["budget_tokens"] or ""), counters,
                         str(a["requests"]), *(f"{tok[k]:.0f}" if k in tok else "" for k in ("min", "median", "max")),
                         f"{tools['median']:.0f}" if tools else "", _backend_cell(a.get("backend_tokens"))])
    if rows:
        out.append(("Catalog padding: how the catalog reached the model (native tools, or in the prompt as BFCL's "
                    "prompting mode writes it), the tokens each arm reached (by the counter used; `estimate` "
                    "over-counts real tokens, so its budgets are smaller in the model's tokens) and the tools in the "
                    "catalog", ["model", "profile", "mode", "budget", "token counter", "requests", "tokens min",
                                "tokens median", "tokens max", "tools median", BACKEND_HEADER], rows))
    rows = []
    for model, arms in (summary.get("lengthening") or {}).items():
        for p, a in arms.items():
            tok = a["tokens_total"] or {}
            rows.append([model, p, str(a["budget_tokens"] or ""),
                         ", ".join(f"{s} {n}" for s, n in a["token_counter"].items()), str(a["requests"]),
                         *(f"{tok[k]:.0f}" if k in tok else "" for k in ("min", "median", "max")),
                         _backend_cell(a.get("backend_tokens"))])
    if rows:
        out.append(("Long tool responses and conversations: the tokens each arm's requests reached (by the counter "
                    "used)", ["model", "profile", "budget", "token counter", "requests", "tokens min",
                              "tokens median", "tokens max", BACKEND_HEADER], rows))
    return out


#: the columns of `--csv-tables`: seed 003's tables in long form, one statistic a row
CSV_TABLES_COLUMNS = ["Table", "Model", "Group", "Held Fixed", "Statistic", "Value", "Arm", "N", "CI Low", "CI High",
                      "Failed"]


def csv_rows(summary: dict[str, Any]) -> list[list[Any]]:
    """Seed 003 Tables 1, 5, 6, 7 (Max / Min / % Deg.), Fig. 4's points and Table 2's cells (CSV_TABLES_COLUMNS)."""
    rows: list[list[Any]] = []

    def extremes(table: str, model: str, group: str, fixed: str, e: dict[str, Any]) -> None:
        rows.extend([[table, model, group, fixed, "Max", e["max"], e["max_arm"], "", "", "", e.get("max_failed", "")],
                     [table, model, group, fixed, "Min", e["min"], e["min_arm"], "", "", "", e.get("min_failed", "")]])
        if "drop" in e:  # Tables 1 and 5: the paper's directional degradation, shortest catalog → longest
            drop = e["drop"] or {}
            span = f"{drop['from_budget']}→{drop['to_budget']}" if drop else ""
            rows.extend([[table, model, group, fixed, "% Deg. (points)", drop.get("points"), span, "", "", "", ""],
                         [table, model, group, fixed, "% Deg. (relative)", drop.get("relative"), span, "", "", "", ""],
                         [table, model, group, fixed, "Max − Min (points)", e["deg"], "", "", "", "", ""],
                         [table, model, group, fixed, "(Max − Min) / Max", e["deg_relative"], "", "", "", "", ""]])
        else:
            rows.extend([[table, model, group, fixed, "% Deg. (points)", e["deg"], "", "", "", "", ""],
                         [table, model, group, fixed, "% Deg. (relative)", e["deg_relative"], "", "", "", "", ""]])
        rows.append([table, model, group, fixed, "not comparable", e.get("not_comparable", 0), "", "", "", "", ""])

    def point(table: str, model: str, group: str, fixed: str, stat: str, pt: dict[str, Any], arm: str) -> None:
        ci = pt.get("accuracy_ci") or ["", ""]
        rows.append([table, model, group, fixed, stat, pt["accuracy"], arm, pt["n"], ci[0], ci[1],
                     pt.get("failed", "")])

    for key, table, fixed in (("padding_extremes", "Table 1", None), ("padding_same_position", "Table 5", "position"),
                              ("padding_same_budget", "Table 6", "budget_tokens")):
        for model, cats in (summary.get(key) or {}).items():
            for cat, e in cats.items():
                extremes(f"seed 003 {table}", model, cat, f"{fixed}={e[fixed]}" if fixed else "", e)
    for model, exps in (summary.get("response_experiments") or {}).items():
        for name, fixed in (("context_length", "position"), ("answer_position", "budget_tokens")):
            e = exps.get(name)
            if not e:
                continue
            held = f"{fixed}={e[fixed]}"
            for pt in e["points"]:
                where = pt.get("budget_tokens", pt.get("position"))
                point("seed 003 Fig. 4", model, name, held, f"accuracy at {pt['label']} ({where})", pt, pt["profile"])
            extremes("seed 003 Table 7", model, name, held, e)
    for model, groups in (summary.get("conversation_grid") or {}).items():
        for group, cells in groups.items():
            for budget, c in cells.items():
                point("seed 003 Table 2", model, group, "", f"accuracy at {budget} tokens", c, "+".join(c["profiles"]))
                for key, what in (("final_call", "final-call AST accuracy"),
                                  ("one_call", "one-call last turns' accuracy"),
                                  ("multi_call", "multi-call last turns' accuracy")):
                    if key in c:
                        point("seed 003 Table 2", model, group, "", f"{what} at {budget} tokens", c[key],
                              "+".join(c["profiles"]))
    return rows
