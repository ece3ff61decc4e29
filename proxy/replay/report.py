"""Reports from replay results: seed 001's Table 2, seed 003's and seed 002's heatmaps, BFCL-style CSV.

Everything is computed from the verdicts stored by `toolquake replay` (proxy/replay/run.py). Several
directories (or files) are merged, e.g. the shards of one run, or runs of different models; a
(model, profile, case) pair found twice counts once (a scored row wins over a failed one).

Accuracy counts scored pairs only; pairs that failed (backend or perturber errors) are reported
beside it as `failed`, so an arm whose perturber could not run never shows up as a drop.

With repeated trials (`replay --trials K`), the accuracies, intervals, paired tests and per-case diffs
are those of trial 0 (one answer per case, as without --trials: the tests assume independent cases);
`trials` adds, per arm, the accuracy of every trial with their mean and spread, pass^k and pass@k.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.escape import CTL_CSS, csv_row, html_attr, html_text, md_text, plot_text
from toolquake.proxy.replay import families, paper_tables
from toolquake.scorers.aggregate import (
    mcnemar,
    paired_drop_ci,
    pass_at_k,
    pass_hat_k,
    ratio,
    relative_drop,
    spread,
    wilson_ci,
)
from toolquake.scorers.taxonomy import TAXONOMY

BASELINE = "off"
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


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class Row:
    model: str
    profile: str
    case_id: str
    category: str
    status: str
    valid: bool | None
    taxonomy: str | None
    error_type: str | None
    error_code: str | None
    fair_valid: bool | None
    semantic_valid: bool | None
    #: index into Results.sources of the file the row was read from (for the per-case details)
    source: int = -1
    #: the trial number (`replay --trials`; 0 without, and in files written before it)
    trial: int = 0


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    #: (model, profile) → the profile's definition when it was replayed
    arms: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)
    duplicates: int = 0

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.arms))

    def profiles(self, model: str) -> list[str]:
        return [p for m, p in self.arms if m == model]


def result_files(paths: list[str | Path]) -> list[Path]:
    """Replay files in each path: the file itself, or every replay*.sqlite in a directory."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(p.glob("replay*.sqlite"))
            if not found:
                raise FileNotFoundError(f"{p}: no replay results (replay*.sqlite) in this directory")
            files.extend(found)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return files


def _bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def _trial_column(db: sqlite3.Connection) -> str:
    """`trial` in files written since `--trials` (schema 2), the constant 0 in older ones."""
    return "trial" if any(r[1] == "trial" for r in db.execute("PRAGMA table_info(results)")) else "0"


def load(paths: list[str | Path]) -> Results:
    """Read and merge replay results (read-only; safe while a replay is still writing)."""
    res = Results()
    seen: dict[tuple[str, str, str, int], int] = {}
    for path in result_files(paths):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            model = meta.get("model", "unknown")
            for profile, spec in db.execute("SELECT profile, spec FROM arms ORDER BY rowid"):
                res.arms.setdefault((model, profile), json.loads(spec))
            for r in db.execute("SELECT profile, case_id, category, status, valid, taxonomy, error_type, error_code, "
                                f"fair_valid, semantic_valid, {_trial_column(db)}, perturbers FROM results "
                                "ORDER BY rowid"):
                row = Row(model, r[0], r[1], r[2], paper_tables.row_status(r[3], r[11]), _bool(r[4]), r[5], r[6],
                          r[7], _bool(r[8]), _bool(r[9]), source=len(res.sources), trial=int(r[10]))
                key = (model, row.profile, row.case_id, row.trial)
                if key in seen:
                    res.duplicates += 1
                    if res.rows[seen[key]].status != "scored" and row.status == "scored":
                        res.rows[seen[key]] = row
                    continue
                seen[key] = len(res.rows)
                res.rows.append(row)
                res.arms.setdefault((model, row.profile), {"mode": "unknown", "perturbers": []})
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{path}: not a replay results file ({exc})") from None
        finally:
            db.close()
        res.sources.append(path)
    return res


# ---------------------------------------------------------------------------------------------
# numbers


ALPHA = 0.05


def _arm_numbers(rows: list[Row]) -> dict[str, Any]:
    scored = [r for r in rows if r.status == "scored"]
    valid = sum(1 for r in scored if r.valid)
    by_cat: dict[str, list[Row]] = defaultdict(list)
    for r in scored:
        by_cat[r.category].append(r)
    errors = Counter(r.taxonomy or r.error_type or "unknown" for r in scored if not r.valid)
    failed = Counter(r.error_code or "unknown" for r in rows if r.status not in ("scored", NOT_PERTURBED))
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
                            "accuracy_ci": wilson_ci(sum(1 for r in rs if r.valid), len(rs))}
                        for c, rs in sorted(by_cat.items())},
        "errors": dict(sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))),
        # Wilson interval of each error type's share among the arm's failures
        "errors_ci": {k: wilson_ci(v, failures) for k, v in sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))},
        "failed": sum(failed.values()),
        **paper_tables.perturbed_counts(rows),
        "failed_codes": dict(sorted(failed.items())),
        "fair_accuracy": ratio(fair_valid, len(fair)) if fair else None,
        "fair_accuracy_ci": wilson_ci(fair_valid, len(fair)) if fair else None,
        # semantic mode was only asked for invalid BFCL verdicts: valid ones stay valid
        "semantic_accuracy": ratio(semantic_valid, len(scored)) if has_semantic else None,
        "semantic_accuracy_ci": wilson_ci(semantic_valid, len(scored)) if has_semantic else None,
    }


def paired(base: dict[str, bool], arm: dict[str, bool]) -> dict[str, Any]:
    """The arm against the baseline on the cases both scored ({case id: valid} each): the 2×2 table,
    McNemar's exact p-value, and the relative drop on these cases with its approximate 95 % interval."""
    cases = [c for c in arm if c in base]
    both = sum(1 for c in cases if base[c] and arm[c])
    lost = sum(1 for c in cases if base[c] and not arm[c])
    gained = sum(1 for c in cases if not base[c] and arm[c])
    neither = len(cases) - both - lost - gained
    p = mcnemar(lost, gained)
    ci = paired_drop_ci(both, lost, gained, neither)
    return {"n": len(cases), "both_valid": both, "valid_to_invalid": lost, "invalid_to_valid": gained,
            "both_invalid": neither, "p_value": p, "significant": p < ALPHA,
            "drop": relative_drop(ratio(both + gained, len(cases)), ratio(both + lost, len(cases))),
            "drop_ci": None if ci is None else list(ci)}


def _verdicts(rows: list[Row], category: str | None = None) -> dict[str, bool]:
    return {r.case_id: bool(r.valid) for r in rows if r.status == "scored" and (category is None or
                                                                                r.category == category)}


def _with_drops(arms: dict[str, dict[str, Any]], baseline: str,
                rows: dict[str, list[Row]] | None = None) -> None:
    base = arms.get(baseline)
    rows = rows or {}
    base_rows = rows.get(baseline, [])
    for p, arm in arms.items():
        arm["drop_vs_off"] = relative_drop(arm["accuracy"], base["accuracy"] if base else None)
        cmp = paired(_verdicts(base_rows), _verdicts(rows.get(p, []))) if base and p != baseline else None
        arm["paired"] = cmp
        arm["drop_vs_off_ci"] = cmp["drop_ci"] if cmp else None
        for name, cat in arm["by_category"].items():
            b = base["by_category"].get(name) if base else None
            cat["drop_vs_off"] = relative_drop(cat["accuracy"], b["accuracy"] if b else None)
            cat_cmp = (paired(_verdicts(base_rows, name), _verdicts(rows.get(p, []), name))
                       if b and p != baseline else None)
            cat["drop_vs_off_ci"] = cat_cmp["drop_ci"] if cat_cmp else None


def summarize(res: Results, baseline: str = BASELINE) -> dict[str, Any]:
    """The JSON report: {"arms": {profile: {"n", "accuracy", "by_category", "errors", ...}}, "models": {...}}.

    With one model, `arms` is keyed by profile; with several, by "profile [model]", and `models`
    holds each model's arms keyed by profile. `drop_vs_off` is the relative change against the
    baseline profile's accuracy (None without one).
    """
    by_arm: dict[tuple[str, str], list[Row]] = defaultdict(list)
    all_trials: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in res.rows:
        all_trials[(r.model, r.profile)].append(r)
        if r.trial == 0:
            by_arm[(r.model, r.profile)].append(r)
    models: dict[str, dict[str, Any]] = {}
    for model in res.models:
        arms = {p: _arm_numbers(by_arm.get((model, p), [])) for p in res.profiles(model)}
        _with_drops(arms, baseline, {p: by_arm.get((model, p), []) for p in res.profiles(model)})
        for p, arm in arms.items():
            arm["perturbers"] = res.arms[(model, p)].get("perturbers", [])
            arm["trials"] = trial_numbers(all_trials.get((model, p), []))
        models[model] = {"arms": arms}
    single = len(models) == 1
    flat = {(p if single else f"{p} [{m}]"): arm for m, data in models.items() for p, arm in data["arms"].items()}
    summary = {"arms": flat, "models": models, "baseline": baseline, "sources": [str(s) for s in res.sources],
               "duplicates": res.duplicates,
               "flips": [{k: v for k, v in f.items() if not k.startswith("_")} for f in flips(res, baseline)]}
    summary.update(families=families.family_numbers(summary), recovery=families.recovery_numbers(res))
    summary.update(paper_tables.sections(res, baseline, summary))
    return summary


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
    first = [r for r in res.rows if r.trial == 0]
    by_key = {(r.model, r.profile, r.case_id): r for r in first if r.status == "scored"}
    out = []
    for model in res.models:
        for p in res.profiles(model):
            if p == baseline:
                continue
            for r in first:
                if r.model != model or r.profile != p or r.status != "scored":
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


_MAX_TEXT = 1500


def _short(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + " …"


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def calls_text(answer: Any) -> str | None:
    """The model's calls in a stored answer, one `name(arguments)` per call (its text when it made none)."""
    if answer is None:
        return None
    if isinstance(answer, dict) and isinstance(answer.get("choices"), list) and answer["choices"]:
        message = (answer["choices"][0] or {}).get("message") or {}
        calls = message.get("tool_calls") or []
        if calls:
            return _short("; ".join(f"{(c.get('function') or {}).get('name')}"
                                    f"({(c.get('function') or {}).get('arguments', '')})" for c in calls))
        return _short(f"no call; text: {message.get('content') or ''!s}")
    return _short(_compact(answer))  # a multi-turn summary: {"turns": [[{"calls": [...]}, ...]], ...}


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
        return _short("; ".join(f"{k} on {v} step(s)" for k, v in applied.items()))
    steps = perturbation_steps(perturbers, spec)
    if not steps:
        return "none"
    # parameters left empty (no generator URL, no cache dir, ...) say nothing about what was applied
    text = "; ".join(f"{a['name']}({_compact({k: v for k, v in a['params'].items() if v not in ('', None)})})"
                     + (f" → {_compact(a['report'])}" if a["report"] else "") for a in steps)
    recorded = isinstance(applied, list) and bool(applied)
    return _short(text + ("" if recorded or perturbers is None else " (defined; none recorded as applied)"))


def _expected_calls(case_id: str) -> str | None:
    try:
        from toolquake.bfcl.corpus import is_present, load_case

        if not is_present():
            return None
        return _short(_compact(load_case(case_id).ground_truth))
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
    stored: dict[tuple[int, str, str], tuple[Any, Any]] = {}
    for src, pairs in wanted.items():
        db = sqlite3.connect(f"file:{res.sources[src]}?mode=ro", uri=True)
        try:
            trial = _trial_column(db)
            for profile, case_id in sorted(pairs):
                row = db.execute(f"SELECT answer, perturbers FROM results WHERE profile = ? AND case_id = ? "
                                 f"AND {trial} = 0", (profile, case_id)).fetchone()
                if row is not None:
                    stored[(src, profile, case_id)] = (
                        None if row[0] is None else json.loads(row[0]),
                        None if row[1] is None else json.loads(row[1]),
                    )
        finally:
            db.close()
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


# ---------------------------------------------------------------------------------------------
# heatmaps


def _params(perturbers: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for p in perturbers:
        if p.get("name") == name:
            return p.get("params") or {}
    return None


def padding_grid(summary: dict[str, Any], model: str) -> tuple[list[int], list[float], dict[tuple[int, float], float]]:
    """Seed 003 Fig. 3 data for one model: budgets, positions, accuracy per (budget, position)."""
    cells = {k: v / n for k, (v, n) in padding_counts(summary, model).items() if n}
    return sorted({b for b, _ in cells}), sorted({p for _, p in cells}), cells


def padding_counts(summary: dict[str, Any], model: str) -> dict[tuple[int, float], tuple[int, int]]:
    """(valid, scored) per (catalog budget, position) for one model, arms with the same cell pooled."""
    pooled: dict[tuple[int, float], list[int]] = defaultdict(lambda: [0, 0])
    for arm in summary["models"][model]["arms"].values():
        params = _params(arm["perturbers"], "catalog_padding")
        if params is None or not arm["n"]:
            continue
        if "budget_tokens" not in params or "position" not in params:
            continue
        key = (int(params["budget_tokens"]), round(float(params["position"]), 3))
        pooled[key][0] += round(arm["accuracy"] * arm["n"])
        pooled[key][1] += arm["n"]
    return {k: (v, n) for k, (v, n) in pooled.items()}


def format_grid(summary: dict[str, Any]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """Seed 002 Fig. 2 data: configuration labels (published order first), models, accuracy per cell."""
    order = {format_label(c): i for i, c in enumerate(format_configurations())}
    cells: dict[tuple[str, str], float] = {}
    for model, data in summary["models"].items():
        for arm in data["arms"].values():
            params = _params(arm["perturbers"], "format_rewrite")
            if params is None or not arm["n"]:
                continue
            cells[(format_label(params), model)] = arm["accuracy"]
    labels = sorted({c for c, _ in cells}, key=lambda c: (order.get(c, len(order)), c))
    return labels, [m for m in summary["models"] if any(k[1] == m for k in cells)], cells


def format_counts(summary: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """(valid, scored) per (format configuration, model), the counts behind `format_grid`'s cells."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for model, data in summary["models"].items():
        for arm in data["arms"].values():
            params = _params(arm["perturbers"], "format_rewrite")
            if params is not None and arm["n"]:
                out[(format_label(params), model)] = (round(arm["accuracy"] * arm["n"]), arm["n"])
    return out


def _cell_text(value: float, counts: tuple[int, int] | None) -> str:
    """A heatmap cell: the accuracy, and the valid / scored counts under it."""
    return f"{value:.2f}" + (f"\n{counts[0]}/{counts[1]}" if counts else "")


def _budget_label(b: int) -> str:
    return f"{b // 1024}K" if b % 1024 == 0 else f"{b / 1000:g}K"


def budget_ticks(summary: dict[str, Any], model: str, budgets: list[int]) -> list[str]:
    """The catalog heatmap's budget labels: the nominal budget, and the median tokens its arms actually reached
    (their reports' `tokens_after`, `padding_reached`), e.g. `32K (≈31.9K)`."""
    reached = (summary.get("padding_reached") or {}).get(model) or {}
    return [_budget_label(b) + (f" (≈{reached[str(b)]['median'] / 1000:.1f}K)" if str(b) in reached else "")
            for b in budgets]


def heatmaps(summary: dict[str, Any]) -> dict[str, bytes]:
    """PNG heatmaps that the results support: {file name: PNG bytes}. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    padded = [(m, padding_grid(summary, m)) for m in summary["models"]]
    padded = [(m, g) for m, g in padded if g[2]]
    if padded:
        fig, axes = plt.subplots(1, len(padded), figsize=(4.2 * len(padded) + 1, 4), squeeze=False)
        for ax, (model, (budgets, positions, cells)) in zip(axes[0], padded):
            counts = padding_counts(summary, model)
            grid = [[cells.get((b, p), float("nan")) for b in budgets] for p in positions]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(budgets)), [t.replace(" (", "\n(") for t in budget_ticks(summary, model, budgets)],
                          fontsize=8)
            ax.set_yticks(range(len(positions)), [f"{p:g}" for p in positions])
            ax.set_xlabel("catalog size (tokens): budget (≈ median reached)")
            ax.set_ylabel("position of the original tools")
            ax.set_title(plot_text(model), fontsize=9)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:
                        ax.text(j, i, _cell_text(v, counts.get((budgets[j], positions[i]))), ha="center",
                                va="center", fontsize=7)
        fig.colorbar(im, ax=axes[0].tolist(), label="AST accuracy")
        fig.suptitle("Large tool catalog: accuracy (valid/scored) by catalog size × position (seed 003, challenge 1)",
                     fontsize=10)
        out["heatmap-catalog.png"] = _png(fig, plt)
    labels, models, cells = format_grid(summary)
    if labels:
        counts = format_counts(summary)
        fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(models), 1.2 + 0.45 * len(labels)))
        grid = [[cells.get((c, m), float("nan")) for m in models] for c in labels]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(models)), [plot_text(m) for m in models], rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), [plot_text(c) for c in labels], fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, _cell_text(v, counts.get((labels[i], models[j]))), ha="center", va="center",
                            fontsize=6.5)
        fig.colorbar(im, ax=ax, label="AST accuracy")
        ax.set_title("Format sensitivity: accuracy (valid/scored), configuration × model (seed 002)", fontsize=10)
        out["heatmap-formats.png"] = _png(fig, plt)
    return out


def response_plots(summary: dict[str, Any], fmt: str = "png") -> dict[str, bytes]:
    """Seed 003 Fig. 4 (challenge 2): accuracy with 95 % Wilson whiskers against the response size at the first
    position (a), and against the answer position at the largest size (b), one line per model; {name: bytes} of
    the plots the response_lengthening arms support."""
    exps = summary.get("response_experiments") or {}
    out: dict[str, bytes] = {}
    for name, key, xlabel, title in (
            ("context_length", "response-size", "tool response budget (tokens)",
             "Long tool responses: accuracy by response size, answer at the first position (seed 003 Fig. 4a)"),
            ("answer_position", "response-position", "position of the answer in the response",
             "Long tool responses: accuracy by answer position at the largest size (seed 003 Fig. 4b)")):
        lines = [(m, e[name]) for m, e in exps.items() if name in e]
        if not lines:
            continue
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if fmt == "svg":
            matplotlib.rcParams["svg.hashsalt"] = "toolquake"
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ticks: dict[float, str] = {}
        for i, (model, e) in enumerate(lines):
            pts = [pt for pt in e["points"] if pt["accuracy"] is not None]
            if name == "context_length":
                xs = [float(pt["budget_tokens"]) for pt in pts]
                ticks.update((x, pt["label"]) for x, pt in zip(xs, pts))
            else:
                xs = [float(int(pt["label"][1:])) for pt in pts]
                ticks.update((x, f"{pt['label']}\n({pt['position']:g})") for x, pt in zip(xs, pts))
            ys = [pt["accuracy"] for pt in pts]
            err = [[y - pt["accuracy_ci"][0] for y, pt in zip(ys, pts)], [pt["accuracy_ci"][1] - y for y, pt in
                                                                          zip(ys, pts)]]
            ax.errorbar([x + 0.015 * i * (max(xs) - min(xs) or 1) for x in xs], ys, yerr=err, marker="o", capsize=3,
                        label=plot_text(model))
        ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)], fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("AST accuracy (95 % Wilson)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        out[f"{key}.{fmt}"] = _png(fig, plt, fmt)
    return out


def _png(fig: Any, plt: Any, fmt: str = "png") -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return buf.getvalue()


def accuracy_plot(summary: dict[str, Any], fmt: str = "png") -> bytes | None:
    """Accuracy per arm with 95 % Wilson interval bars, one panel per model (None without scored arms)."""
    panels = [(m, [(p, a) for p, a in data["arms"].items() if a["n"]]) for m, data in summary["models"].items()]
    panels = [(m, arms) for m, arms in panels if arms]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if fmt == "svg":
        matplotlib.rcParams["svg.hashsalt"] = "toolquake"  # the same results give the same file
    width = max(len(arms) for _, arms in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(5.0, 1.0 + 0.55 * width), 3.2 * len(panels)),
                             squeeze=False)
    baseline = summary["baseline"]
    for ax, (model, arms) in zip(axes[:, 0], panels):
        xs = range(len(arms))
        accs = [a["accuracy"] for _, a in arms]
        lows = [a["accuracy"] - a["accuracy_ci"][0] for _, a in arms]
        highs = [a["accuracy_ci"][1] - a["accuracy"] for _, a in arms]
        colors = ["#555555" if p == baseline else
                  ("#c0392b" if (a.get("paired") or {}).get("significant") else "#2e86c1") for p, a in arms]
        for x, y, lo, hi, c in zip(xs, accs, lows, highs, colors):
            ax.errorbar([x], [y], yerr=[[lo], [hi]], fmt="o", color=c, capsize=4)
        base = next((a["accuracy"] for p, a in arms if p == baseline), None)
        if base is not None:
            ax.axhline(base, color="#555555", linestyle="--", linewidth=0.8)
        ax.set_xticks(list(xs), [plot_text(p) for p, _ in arms], rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("AST accuracy")
        ax.set_title(f"{plot_text(model)}: accuracy per arm, 95 % Wilson intervals (red: paired drop vs "
                     f"{plot_text(baseline)} "
                     f"p < {ALPHA})", fontsize=9)
    return _png(fig, plt, fmt)


# ---------------------------------------------------------------------------------------------
# rendering


def _acc(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _rel(x: float | None) -> str:
    return "" if x is None else f" ({x * 100:+.0f}%)"


def _ci(ci: list[float] | None) -> str:
    """[lo, hi] in the 0..1 scale of the tables beside it."""
    return "" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def pct_ci(x: float | None, ci: list[float] | None) -> str:
    """`62.5 % [48.1, 75.0]`."""
    if x is None:
        return "–"
    return f"{x * 100:.1f} %" + ("" if ci is None else f" [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]")


def drop_ci(x: float | None, ci: list[float] | None) -> str:
    """`-12.0 % [-25.3, +1.2]`."""
    if x is None:
        return "–"
    return f"{x * 100:+.1f} %" + ("" if ci is None else f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]")


def p_text(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def _spec_text(perturbers: list[dict[str, Any]]) -> str:
    text = "; ".join(f"{a.get('name')}({_compact(a.get('params') or {})})" for a in perturbers) or "none"
    return text if len(text) <= 120 else text[:120] + " …"


def summary_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Which perturbations hurt this model most: the arms against the baseline, largest drop first."""
    baseline = summary["baseline"]
    entries = [(m, p, a) for m, data in summary["models"].items() for p, a in data["arms"].items()
               if p != baseline and a.get("paired")]
    entries.sort(key=lambda e: (e[2]["drop_vs_off"] is None, e[2]["drop_vs_off"] or 0.0, e[0], e[1]))
    rows = []
    for model, p, arm in entries:
        cmp = arm["paired"]
        rows.append([model, p, _spec_text(arm.get("perturbers") or []), pct_ci(arm["accuracy"], arm["accuracy_ci"]),
                     drop_ci(arm["drop_vs_off"], arm["drop_vs_off_ci"]), str(cmp["n"]),
                     str(cmp["valid_to_invalid"]), str(cmp["invalid_to_valid"]), p_text(cmp["p_value"]),
                     "yes" if cmp["significant"] else "no"])
    return (f"Summary: which perturbations hurt most (largest relative drop against `{baseline}` first)",
            ["model", "profile", "perturbation", "accuracy [95 % CI]", f"drop vs {baseline} [95 % CI]",
             "paired cases", "valid→invalid", "invalid→valid", "McNemar p", f"drop ≠ 0 at {ALPHA}"], rows)


def trials_table(summary: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    """Repeated trials: per arm, the accuracy of each trial, mean ± standard deviation [min, max],
    pass^k and pass@k for k = 1..K. No rows when no arm has more than one trial."""
    entries = [(m, p, a["trials"]) for m, data in summary["models"].items() for p, a in data["arms"].items()
               if a.get("trials")]
    k_max = max((t["k"] for _, _, t in entries), default=0)
    rows = []
    for model, p, t in entries:
        acc = t["accuracy"]
        mean = "–" if acc["mean"] is None else (f"{acc['mean']:.3f}" + ("" if acc["std"] is None else
                                                                          f" ± {acc['std']:.3f}"))
        span = "" if acc["min"] is None else f"[{acc['min']:.3f}, {acc['max']:.3f}]"
        rows.append([model, p, str(t["k"]), f"{t['complete_cases']}/{t['cases']}",
                     " ".join(_acc(x["accuracy"]) for x in t["per_trial"]), mean, span,
                     *(_acc(t["pass_hat_k"].get(str(k))) for k in range(1, k_max + 1)),
                     *(_acc(t["pass_at_k"].get(str(k))) for k in range(2, k_max + 1))])
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
    """(title, header, rows) of every table in the report."""
    baseline = summary["baseline"]
    out = []
    models = summary["models"]
    profiles = list(dict.fromkeys(p for data in models.values() for p in data["arms"]))
    header = ["model", *profiles]
    rows = []
    for model, data in models.items():
        row = [model]
        ci_row = [f"{model} 95 % CI"]
        for p in profiles:
            arm = data["arms"].get(p)
            drop = "" if arm is None or p == baseline else _rel(arm["drop_vs_off"])
            row.append("" if arm is None else _acc(arm["accuracy"]) + drop)
            ci_row.append("" if arm is None else _ci(arm.get("accuracy_ci")))
        rows += [row, ci_row]
    out.append((f"AST accuracy per arm (relative change against `{baseline}` in brackets; 95 % Wilson intervals "
                "on the row below)", header, rows))

    cols = _taxonomy_columns(summary)
    rows = []
    for model, data in models.items():
        for p, arm in data["arms"].items():
            failures = sum(arm["errors"].values())
            if p == baseline or not failures:
                continue
            rows.append([model, p, str(failures), *(f"{arm['errors'].get(c, 0) / failures:.2f}" for c in cols)])
            cis = arm.get("errors_ci") or {}
            rows.append([model, f"{p} 95 % CI", "",
                         *(_ci(cis[c] if c in cis else wilson_ci(0, failures)) for c in cols)])
    if rows:
        out.append(
            (
                "Error analysis of perturbed arms (share of each error type among failures; 95 % Wilson intervals "
                "on the row below)",
                ["model", "profile", "failures", *cols],
                rows,
            )
        )

    rows = []
    for model, data in models.items():
        for p, arm in data["arms"].items():
            failed = ", ".join(f"{k} {v}" for k, v in arm["failed_codes"].items())
            rows.append(
                [
                    model,
                    p,
                    str(arm["n"]),
                    _acc(arm["accuracy"]),
                    _acc(arm["fair_accuracy"]),
                    _acc(arm["semantic_accuracy"]),
                    str(arm["failed"]) + (f" ({failed})" if failed else ""),
                    _ci(arm.get("accuracy_ci")),
                    _ci(arm.get("fair_accuracy_ci")),
                    _ci(arm.get("semantic_accuracy_ci")),
                ]
            )
    out.append(
        (
            "Arms: scored pairs, accuracy in the three scoring modes, failed pairs, 95 % Wilson intervals",
            ["model", "profile", "n", "bfcl", "fair", "semantic", "failed", "bfcl CI", "fair CI", "semantic CI"],
            rows,
        )
    )

    categories = sorted({c for data in models.values() for arm in data["arms"].values() for c in arm["by_category"]})
    for model, data in models.items():
        rows = []
        for p, arm in data["arms"].items():
            cells = []
            for c in categories:
                cat = arm["by_category"].get(c)
                cells.append(
                    ""
                    if cat is None
                    else f"{_acc(cat['accuracy'])} (n={cat['n']})"
                    + ("" if p == baseline else _rel(cat.get("drop_vs_off")))
                    + (f" {_ci(cat['accuracy_ci'])}" if cat.get("accuracy_ci") else "")
                )
            rows.append([p, *cells])
        out.append((f"Per category: {model} (accuracy, n, relative change, 95 % Wilson interval)",
                    ["profile", *categories], rows))
    return out + families.tables(summary) + paper_tables.tables(summary)


_DIRECTION = {"valid_to_invalid": "valid → invalid", "invalid_to_valid": "invalid → valid"}


def _flip_groups(summary: dict[str, Any]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for f in summary.get("flips") or []:
        groups[(f["model"], f["profile"])].append(f)
    return [(m, p, fs) for (m, p), fs in groups.items()]


def _md_cell(text: str | None) -> str:
    """A cell of client- or model-controlled text: literal (no Markdown, no HTML), one line, controls visible."""
    return "" if text is None else md_text(text)


def _md_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    lines = [
        f"## {md_text(title)}",
        "",
        "| " + " | ".join(map(md_text, header)) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(map(md_text, r)) + " |" for r in rows]
    lines.append("")
    return lines


def render_markdown(summary: dict[str, Any], images: dict[str, str] | None = None) -> str:
    lines = ["# toolquake replay report", ""]
    lines.append(f"Sources: {md_text(', '.join(summary['sources']))}")
    if summary["duplicates"]:
        lines.append(f"({summary['duplicates']} pairs found in more than one file were counted once.)")
    lines.append("")
    top = headline(summary)
    title, header, rows = summary_table(summary)
    if rows:
        lines += [f"- {md_text(t)}" for t in top] + [""]
        lines += _md_table(title, header, rows)
    title, header, rows = trials_table(summary)
    if rows:
        lines += _md_table(title, header, rows)
    for title, header, rows in tables(summary):
        lines += _md_table(title, header, rows)
    for name, ref in (images or {}).items():
        lines += [f"![{name}]({ref})", ""]
    groups = _flip_groups(summary)
    if groups:
        baseline = summary["baseline"]
        lines += [f"## Per-case diffs against {md_text(baseline)} (cases whose verdict flipped)", ""]
        with_expected = any(f.get("expected") for _, _, fs in groups for f in fs)
        for model, p, fs in groups:
            lines += [f"### {md_text(p)} [{md_text(model)}]: {len(fs)} flipped", ""]
            head = ["case", "flip", "error type", "perturbation applied (parameters → what it did)",
                    *(["expected (BFCL ground truth)"] if with_expected else []), "model's calls",
                    f"{baseline}'s calls"]
            lines += ["| " + " | ".join(map(md_text, head)) + " |", "|" + "|".join("---" for _ in head) + "|"]
            for f in fs:
                cells = [md_text(f["case_id"]), _DIRECTION[f["direction"]], md_text(f["error_type"]),
                         _md_cell(f.get("perturbation")),
                         *([_md_cell(f.get("expected"))] if with_expected else []), _md_cell(f.get("calls")),
                         _md_cell(f.get("baseline_calls"))]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:110em}"
    "table{border-collapse:collapse;margin:1em 0}"
    "th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}th:first-child,td:first-child,"
    "th:nth-child(2),td:nth-child(2){text-align:left}th{background:#f3f3f3}img{max-width:100%}"
    "nav{background:#f7f7f7;border:1px solid #ddd;padding:.5em 1em;display:inline-block}nav a{margin-right:1em}"
    "details{margin:.4em 0}summary{cursor:pointer}td code{white-space:pre-wrap;word-break:break-word;"
    "font-size:85%}table.cases td{text-align:left;vertical-align:top;max-width:26em}"
    "table.cases td.calls{background:#fafafa}table.cases th.calls{background:#e8eef6}"
    "tr.valid_to_invalid td:nth-child(2){color:#b03a2e}tr.invalid_to_valid td:nth-child(2){color:#1e8449}"
    "dl.steps{margin:0}dl.steps dt{font-weight:600}dl.steps dd{margin:0 0 .3em 1em}"
    "table.summary td:nth-child(3),table.summary th:nth-child(3),table.cases th{text-align:left}"
    ".sig{color:#b03a2e;font-weight:600}"
    ".filter{margin:.5em 0;padding:.5em;background:#f7f7f7;border:1px solid #ddd}.filter input{width:24em}"
    + CTL_CSS
)

# filters the per-case rows by text and direction (a `#q=...` in the address pre-fills the text); no network
_CASES_JS = """
(function () {
  var q = document.getElementById('case-filter'), d = document.getElementById('case-direction');
  var count = document.getElementById('case-count');
  if (!q || !d || !count) { return; }
  if (location.hash.indexOf('#q=') === 0) { q.value = decodeURIComponent(location.hash.slice(3)); }
  function apply() {
    var text = q.value.toLowerCase(), dir = d.value, shown = 0, all = 0;
    document.querySelectorAll('table.cases tbody tr').forEach(function (row) {
      all += 1;
      var ok = (!text || row.textContent.toLowerCase().indexOf(text) >= 0) && (!dir || row.dataset.direction === dir);
      row.hidden = !ok;
      if (ok) { shown += 1; }
    });
    document.querySelectorAll('details.arm').forEach(function (box) {
      var n = box.querySelectorAll('tbody tr:not([hidden])').length;
      box.querySelector('.shown').textContent = String(n);
      if (text && n) { box.open = true; }
    });
    count.textContent = shown + ' of ' + all + ' flipped cases shown';
  }
  q.addEventListener('input', apply);
  d.addEventListener('change', apply);
  apply();
})();
"""


def _html_table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    esc = html_text
    return (f"<table{f' class={cls!r}' if cls else ''}><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header)
            + "</tr></thead><tbody>"
            + "".join("<tr" + (" class='sig'" if cls == "summary" and r[-1] == "yes" else "") + ">"
                      + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</tbody></table>")


def _html_summary(summary: dict[str, Any]) -> str:
    title, header, rows = summary_table(summary)
    if not rows:
        return ""
    esc = html_text
    return (f"<section id='summary'><h2>{esc(title.replace('`', ''))}</h2><ul>"
            + "".join(f"<li>{esc(t.replace('`', ''))}</li>" for t in headline(summary)) + "</ul>"
            + _html_table(header, rows, "summary") + "</section>")


def _html_images(pngs: dict[str, bytes], svgs: dict[str, bytes] | None) -> str:
    esc = html_text
    parts = []
    for name, svg in (svgs or {}).items():
        parts.append(f"<h3>{esc(name)}</h3><img alt='{html_attr(name)}' "
                     f"src='data:image/svg+xml;base64,{base64.b64encode(svg).decode()}'>")
    for name, png in pngs.items():
        parts.append(f"<h3>{esc(name)}</h3><img alt='{html_attr(name)}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    return "<section id='plots'><h2>Plots</h2>" + "".join(parts) + "</section>" if parts else ""


def _html_steps(steps: list[dict[str, Any]] | None, fallback: str | None) -> str:
    """The perturbation applied: each step's parameters, and what it reported adding or changing."""
    esc = html_text
    if not steps:
        return f"<code>{esc(fallback or 'none')}</code>"
    items = []
    for st in steps:
        items.append(f"<dt>{esc(str(st.get('name')))}</dt><dd>params <code>{esc(_short(_compact(st['params'])))}"
                     "</code></dd>")
        report = st.get("report")
        items.append("<dd>" + ("defined; none recorded as applied" if report is None else "reported nothing"
                               if not report else f"did <code>{esc(_short(_compact(report)))}</code>") + "</dd>")
    return "<dl class='steps'>" + "".join(items) + "</dl>"


def _html_cases(summary: dict[str, Any]) -> str:
    groups = _flip_groups(summary)
    if not groups:
        return ""
    esc = html_text
    baseline = summary["baseline"]
    with_expected = any(f.get("expected") for _, _, fs in groups for f in fs)
    total = sum(len(fs) for _, _, fs in groups)
    parts = [f"<section id='cases'><h2>Per-case diffs against {esc(baseline)} (cases whose verdict flipped)</h2>",
             "<div class='filter'><label>filter <input id='case-filter' type='search' placeholder='case id, call, "
             "perturbation, error type…'></label> <label>direction <select id='case-direction'><option value=''>"
             "both</option><option value='valid_to_invalid'>valid → invalid</option><option value='invalid_to_valid'>"
             f"invalid → valid</option></select></label> <span id='case-count'>{total} flipped cases</span></div>"]
    head = ("<th>case</th><th>flip</th><th>error type</th><th>perturbation applied (parameters; what it did)</th>"
            + ("<th class='calls'>expected (BFCL ground truth)</th>" if with_expected else "")
            + f"<th class='calls'>model's calls ({esc('this arm')})</th><th class='calls'>model's calls "
            f"({esc(baseline)})</th>")
    for model, p, fs in groups:
        lost = sum(1 for f in fs if f["direction"] == "valid_to_invalid")
        parts.append(f"<details class='arm'><summary>{esc(p)} [{esc(model)}]: <span class='shown'>{len(fs)}</span> "
                     f"of {len(fs)} flipped ({lost} valid → invalid, {len(fs) - lost} invalid → valid)</summary>"
                     f"<table class='cases'><thead><tr>{head}</tr></thead><tbody>")
        for f in fs:
            cells = [esc(f["case_id"]), esc(_DIRECTION[f["direction"]]), esc(f["error_type"]),
                     _html_steps(f.get("perturbation_steps"), f.get("perturbation"))]
            calls = ([f.get("expected")] if with_expected else []) + [f.get("calls"), f.get("baseline_calls")]
            row = "".join(f"<td>{c}</td>" for c in cells)
            row += "".join(f"<td class='calls'><code>{esc(c or '')}</code></td>" for c in calls)
            parts.append(f"<tr class='{f['direction']}' data-direction='{f['direction']}'>{row}</tr>")
        parts.append("</tbody></table></details>")
    parts.append("</section>")
    return "".join(parts)


def render_html(summary: dict[str, Any], pngs: dict[str, bytes], svgs: dict[str, bytes] | None = None) -> str:
    """One self-contained page: summary, tables, plots (embedded), per-case diffs (filterable); no network."""
    esc = html_text
    sections = [("summary", "Summary", _html_summary(summary))]
    sections += [(sid, name, body) for sid, name, body in extra_html_sections(summary)]
    tables_html = "".join(f"<h3>{esc(title.replace('`', ''))}</h3>" + _html_table(header, rows)
                          for title, header, rows in tables(summary))
    sections.append(("tables", "Tables", f"<section id='tables'><h2>Tables</h2>{tables_html}</section>"))
    sections.append(("plots", "Plots", _html_images(pngs, svgs)))
    sections.append(("cases", "Per-case diffs", _html_cases(summary)))
    sections = [s for s in sections if s[2]]
    nav = "<nav>" + "".join(f"<a href='#{sid}'>{esc(name)}</a>" for sid, name, _ in sections) + "</nav>"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>toolquake replay report</title>"
             f"<style>{_CSS}</style></head><body>", "<h1>toolquake replay report</h1>",
             f"<p>Sources: {esc(', '.join(summary['sources']))}</p>", nav, *(body for _, _, body in sections),
             f"<script>{_CASES_JS}</script></body></html>"]
    return "\n".join(parts)


def extra_html_sections(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, html) of the sections between the summary and the tables (repeated trials)."""
    out = []
    title, header, rows = trials_table(summary)
    if rows:
        out.append(("trials", "Repeated trials", f"<section id='trials'><h2>{html_text(title)}</h2>"
                    + _html_table(header, rows) + "</section>"))
    return out


#: the statistics columns `--csv-stats` appends to the BFCL-shaped CSV
CSV_STATS_COLUMNS = ["Overall Acc CI Low", "Overall Acc CI High", "Drop vs Baseline", "Drop CI Low", "Drop CI High",
                     "Paired N", "Valid to Invalid", "Invalid to Valid", "McNemar p", "Significant"]


#: with repeated trials, `--csv-stats` also appends these (k = the number of trials)
CSV_TRIALS_COLUMNS = ["Trials", "Trial Acc Mean", "Trial Acc SD", "Pass^k", "Pass@k"]


def render_csv(summary: dict[str, Any], stats: bool = False) -> str:
    """BFCL's leaderboard CSV shape: Rank, Overall Acc, Model, then one column per category (percent);
    with `stats`, the interval and paired-test columns (CSV_STATS_COLUMNS) after them."""
    categories = sorted(
        {c for data in summary["models"].values() for arm in data["arms"].values() for c in arm["by_category"]}
    )
    entries = [(model, p, arm) for model, data in summary["models"].items() for p, arm in data["arms"].items()]
    entries.sort(key=lambda e: -(e[2]["accuracy"] or 0.0))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    k_max = max((arm["trials"]["k"] for _, _, arm in entries if arm.get("trials")), default=0)
    trial_cols = CSV_TRIALS_COLUMNS if stats and k_max else []
    w.writerow(csv_row(["Rank", "Overall Acc", "Model", "Profile", "N", *categories,
                        *(CSV_STATS_COLUMNS if stats else ()), *trial_cols, *families.csv_columns(summary)]))

    def pct(x: float | None) -> str:
        return "N/A" if x is None else f"{x * 100:.2f}%"

    for rank, (model, p, arm) in enumerate(entries, 1):
        extra: list[Any] = []
        if stats:
            ci = arm.get("accuracy_ci") or [None, None]
            dci = arm.get("drop_vs_off_ci") or [None, None]
            cmp = arm.get("paired") or {}
            extra = [pct(ci[0]), pct(ci[1]), pct(arm.get("drop_vs_off")), pct(dci[0]), pct(dci[1]),
                     cmp.get("n", "N/A"), cmp.get("valid_to_invalid", "N/A"), cmp.get("invalid_to_valid", "N/A"),
                     "N/A" if not cmp else f"{cmp['p_value']:.6g}", "N/A" if not cmp else str(cmp["significant"])]
            if trial_cols:
                t = arm.get("trials") or {}
                acc = t.get("accuracy") or {}
                k = str(t.get("k", ""))
                extra += [t.get("k", "N/A"), pct(acc.get("mean")), pct(acc.get("std")),
                          pct((t.get("pass_hat_k") or {}).get(k)), pct((t.get("pass_at_k") or {}).get(k))]
        w.writerow(csv_row(
            [
                rank,
                pct(arm["accuracy"]),
                model,
                p,
                arm["n"],
                *(pct(arm["by_category"][c]["accuracy"]) if c in arm["by_category"] else "N/A" for c in categories),
                *extra,
                *families.csv_cells(summary, model, p),
            ]
        ))
    return buf.getvalue()


#: the columns of `--csv-cases`: one row per flipped case, the per-case diffs of the other formats
CSV_CASES_COLUMNS = ["Model", "Profile", "Case", "Category", "Direction", "Error Type", "Perturbation",
                     "Expected", "Calls", "Baseline Calls"]


def render_cases_csv(summary: dict[str, Any]) -> str:
    """The per-case diffs as CSV (CSV_CASES_COLUMNS), in the order of the other formats."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_CASES_COLUMNS)
    for f in summary.get("flips") or []:
        w.writerow(csv_row([f["model"], f["profile"], f["case_id"], f["category"], f["direction"], f["error_type"],
                            f.get("perturbation") or "", f.get("expected") or "", f.get("calls") or "",
                            f.get("baseline_calls") or ""]))
    return buf.getvalue()


def render_tables_csv(summary: dict[str, Any]) -> str:
    """Seed 003's tables (1, 2, 5, 6, 7) and Fig. 4's points in long form (paper_tables.CSV_TABLES_COLUMNS)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(paper_tables.CSV_TABLES_COLUMNS)
    w.writerows(csv_row(r) for r in paper_tables.csv_rows(summary))
    return buf.getvalue()


def json_text(summary: dict[str, Any]) -> str:
    """The JSON report: the values as stored (a reader escapes for its own display); UTF-8 text, except that a
    lone surrogate (a `\\ud800` in a stored answer) makes the whole file ASCII with `\\u` escapes."""
    text = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(summary, indent=2) + "\n"
    return text


def build(
    paths: list[str | Path], fmt: str, out: Path | None, baseline: str = BASELINE, plots: bool = True,
    csv_stats: bool = False, csv_cases: bool = False, csv_tables: bool = False,
) -> tuple[str, list[Path]]:
    """The report text in `fmt`, and the PNG files written next to `out` (md with --out; never to stdout)."""
    res = load(paths)
    summary = summarize(res, baseline)
    written: list[Path] = []
    if fmt == "csv" and csv_tables:
        return render_tables_csv(summary), written
    if fmt == "csv" and not csv_cases:
        return render_csv(summary, stats=csv_stats), written
    summary["flips"] = case_details(res, flips(res, baseline), baseline)
    if fmt == "csv":
        return render_cases_csv(summary), written
    if fmt == "json":
        return json_text(summary), written
    pngs = heatmaps(summary) if plots else {}
    if fmt == "html":
        svg = accuracy_plot(summary, "svg") if plots else None
        fig4 = {f"seed 003 Fig. 4{'a' if k.startswith('response-size') else 'b'}: accuracy by "
                f"{'response size' if k.startswith('response-size') else 'answer position'}": v
                for k, v in (response_plots(summary, "svg") if plots else {}).items()}
        svgs = {**({"accuracy per arm": svg} if svg else {}), **fig4}
        return render_html(summary, pngs, svgs or None), written
    acc = accuracy_plot(summary, "png") if plots else None
    if acc is not None:
        pngs = {"accuracy.png": acc, **pngs}
    if plots:
        pngs.update(response_plots(summary, "png"))
    refs: dict[str, str] = {}
    if out is not None:
        for name, data in pngs.items():
            path = out.with_name(f"{out.stem}-{name}")
            path.write_bytes(data)
            written.append(path)
            refs[name] = path.name
    return render_markdown(summary, refs), written
