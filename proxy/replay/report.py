"""Reports from replay results: seed 001's Table 2, seed 003's and seed 002's heatmaps, BFCL-style CSV.

Everything is computed from the verdicts stored by `toolquake replay` (proxy/replay/run.py). Several
directories (or files) are merged, e.g. the shards of one run, or runs of different models; a
(model, profile, case) pair found twice counts once (a scored row wins over a failed one).

Accuracy counts scored pairs only; pairs that failed (backend or perturber errors) are reported
beside it as `failed`, so an arm whose perturber could not run never shows up as a drop.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolquake.scorers.aggregate import ratio, relative_drop
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


def load(paths: list[str | Path]) -> Results:
    """Read and merge replay results (read-only; safe while a replay is still writing)."""
    res = Results()
    seen: dict[tuple[str, str, str], int] = {}
    for path in result_files(paths):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            model = meta.get("model", "unknown")
            for profile, spec in db.execute("SELECT profile, spec FROM arms ORDER BY rowid"):
                res.arms.setdefault((model, profile), json.loads(spec))
            for r in db.execute("SELECT profile, case_id, category, status, valid, taxonomy, error_type, error_code, "
                                "fair_valid, semantic_valid FROM results ORDER BY rowid"):
                row = Row(model, r[0], r[1], r[2], r[3], _bool(r[4]), r[5], r[6], r[7], _bool(r[8]), _bool(r[9]))
                key = (model, row.profile, row.case_id)
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




def _arm_numbers(rows: list[Row]) -> dict[str, Any]:
    scored = [r for r in rows if r.status == "scored"]
    valid = sum(1 for r in scored if r.valid)
    by_cat: dict[str, list[Row]] = defaultdict(list)
    for r in scored:
        by_cat[r.category].append(r)
    errors = Counter(r.taxonomy or r.error_type or "unknown" for r in scored if not r.valid)
    failed = Counter(r.error_code or "unknown" for r in rows if r.status != "scored")
    fair = [r for r in scored if r.fair_valid is not None]
    return {
        "n": len(scored),
        "accuracy": ratio(valid, len(scored)),
        "by_category": {c: {"n": len(rs), "accuracy": ratio(sum(1 for r in rs if r.valid), len(rs))}
                        for c, rs in sorted(by_cat.items())},
        "errors": dict(sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))),
        "failed": sum(failed.values()),
        "failed_codes": dict(sorted(failed.items())),
        "fair_accuracy": ratio(sum(1 for r in fair if r.fair_valid), len(fair)) if fair else None,
        # semantic mode was only asked for invalid BFCL verdicts: valid ones stay valid
        "semantic_accuracy": (ratio(sum(1 for r in scored if r.valid or r.semantic_valid), len(scored))
                              if any(r.semantic_valid is not None for r in scored) else None),
    }


def _with_drops(arms: dict[str, dict[str, Any]], baseline: str) -> None:
    base = arms.get(baseline)
    for arm in arms.values():
        arm["drop_vs_off"] = relative_drop(arm["accuracy"], base["accuracy"] if base else None)
        for name, cat in arm["by_category"].items():
            b = base["by_category"].get(name) if base else None
            cat["drop_vs_off"] = relative_drop(cat["accuracy"], b["accuracy"] if b else None)


def summarize(res: Results, baseline: str = BASELINE) -> dict[str, Any]:
    """The JSON report: {"arms": {profile: {"n", "accuracy", "by_category", "errors", ...}}, "models": {...}}.

    With one model, `arms` is keyed by profile; with several, by "profile [model]", and `models`
    holds each model's arms keyed by profile. `drop_vs_off` is the relative change against the
    baseline profile's accuracy (None without one).
    """
    by_arm: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in res.rows:
        by_arm[(r.model, r.profile)].append(r)
    models: dict[str, dict[str, Any]] = {}
    for model in res.models:
        arms = {p: _arm_numbers(by_arm.get((model, p), [])) for p in res.profiles(model)}
        _with_drops(arms, baseline)
        for p, arm in arms.items():
            arm["perturbers"] = res.arms[(model, p)].get("perturbers", [])
        models[model] = {"arms": arms}
    single = len(models) == 1
    flat = {(p if single else f"{p} [{m}]"): arm for m, data in models.items() for p, arm in data["arms"].items()}
    return {"arms": flat, "models": models, "baseline": baseline, "sources": [str(s) for s in res.sources],
            "duplicates": res.duplicates}


# ---------------------------------------------------------------------------------------------
# heatmaps


def _params(perturbers: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for p in perturbers:
        if p.get("name") == name:
            return p.get("params") or {}
    return None


def padding_grid(summary: dict[str, Any], model: str) -> tuple[list[int], list[float], dict[tuple[int, float], float]]:
    """Seed 003 Fig. 3 data for one model: budgets, positions, accuracy per (budget, position)."""
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
    cells = {k: v / n for k, (v, n) in pooled.items() if n}
    return sorted({b for b, _ in cells}), sorted({p for _, p in cells}), cells


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


def _budget_label(b: int) -> str:
    return f"{b // 1024}K" if b % 1024 == 0 else f"{b / 1000:g}K"


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
            grid = [[cells.get((b, p), float("nan")) for b in budgets] for p in positions]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(budgets)), [_budget_label(b) for b in budgets])
            ax.set_yticks(range(len(positions)), [f"{p:g}" for p in positions])
            ax.set_xlabel("catalog size (tokens)")
            ax.set_ylabel("position of the original tools")
            ax.set_title(model, fontsize=9)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=axes[0].tolist(), label="AST accuracy")
        fig.suptitle("Large tool catalog: accuracy by catalog size × position (seed 003, challenge 1)", fontsize=10)
        out["heatmap-catalog.png"] = _png(fig, plt)
    labels, models, cells = format_grid(summary)
    if labels:
        fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(models), 1.2 + 0.32 * len(labels)))
        grid = [[cells.get((c, m), float("nan")) for m in models] for c in labels]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(models)), models, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax, label="AST accuracy")
        ax.set_title("Format sensitivity: configuration × model (seed 002)", fontsize=10)
        out["heatmap-formats.png"] = _png(fig, plt)
    return out


def _png(fig: Any, plt: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# rendering


def _acc(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _rel(x: float | None) -> str:
    return "" if x is None else f" ({x * 100:+.0f}%)"


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
        for p in profiles:
            arm = data["arms"].get(p)
            drop = "" if arm is None or p == baseline else _rel(arm["drop_vs_off"])
            row.append("" if arm is None else _acc(arm["accuracy"]) + drop)
        rows.append(row)
    out.append((f"AST accuracy per arm (relative change against `{baseline}` in brackets)", header, rows))

    cols = _taxonomy_columns(summary)
    rows = []
    for model, data in models.items():
        for p, arm in data["arms"].items():
            failures = sum(arm["errors"].values())
            if p == baseline or not failures:
                continue
            rows.append([model, p, str(failures), *(f"{arm['errors'].get(c, 0) / failures:.2f}" for c in cols)])
    if rows:
        out.append(
            (
                "Error analysis of perturbed arms (share of each error type among failures)",
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
                ]
            )
    out.append(
        (
            "Arms: scored pairs, accuracy in the three scoring modes, failed pairs",
            ["model", "profile", "n", "bfcl", "fair", "semantic", "failed"],
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
                )
            rows.append([p, *cells])
        out.append((f"Per category: {model}", ["profile", *categories], rows))
    return out


def render_markdown(summary: dict[str, Any], images: dict[str, str] | None = None) -> str:
    lines = ["# toolquake replay report", ""]
    lines.append(f"Sources: {', '.join(summary['sources'])}")
    if summary["duplicates"]:
        lines.append(f"({summary['duplicates']} pairs found in more than one file were counted once.)")
    lines.append("")
    for title, header, rows in tables(summary):
        lines += [
            f"## {title}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    for name, ref in (images or {}).items():
        lines += [f"![{name}]({ref})", ""]
    return "\n".join(lines)


def render_html(summary: dict[str, Any], pngs: dict[str, bytes]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>toolquake replay report</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}",
        "th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}th:first-child,td:first-child,"
        "td:nth-child(2){text-align:left}th{background:#f3f3f3}img{max-width:100%}</style></head><body>",
        "<h1>toolquake replay report</h1>",
        f"<p>Sources: {esc(', '.join(summary['sources']))}</p>",
    ]
    for title, header, rows in tables(summary):
        parts.append(f"<h2>{esc(title)}</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    for name, png in pngs.items():
        parts.append(
            f"<h2>{esc(name)}</h2><img alt='{esc(name)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def render_csv(summary: dict[str, Any]) -> str:
    """BFCL's leaderboard CSV shape: Rank, Overall Acc, Model, then one column per category (percent)."""
    categories = sorted(
        {c for data in summary["models"].values() for arm in data["arms"].values() for c in arm["by_category"]}
    )
    entries = [(model, p, arm) for model, data in summary["models"].items() for p, arm in data["arms"].items()]
    entries.sort(key=lambda e: -(e[2]["accuracy"] or 0.0))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["Rank", "Overall Acc", "Model", "Profile", "N", *categories])

    def pct(x: float | None) -> str:
        return "N/A" if x is None else f"{x * 100:.2f}%"

    for rank, (model, p, arm) in enumerate(entries, 1):
        w.writerow(
            [
                rank,
                pct(arm["accuracy"]),
                model,
                p,
                arm["n"],
                *(pct(arm["by_category"][c]["accuracy"]) if c in arm["by_category"] else "N/A" for c in categories),
            ]
        )
    return buf.getvalue()


def build(
    paths: list[str | Path], fmt: str, out: Path | None, baseline: str = BASELINE, plots: bool = True
) -> tuple[str, list[Path]]:
    """The report text in `fmt`, and the PNG files written next to `out` (md with --out; never to stdout)."""
    summary = summarize(load(paths), baseline)
    written: list[Path] = []
    if fmt == "json":
        return json.dumps(summary, indent=2, ensure_ascii=False) + "\n", written
    if fmt == "csv":
        return render_csv(summary), written
    pngs = heatmaps(summary) if plots else {}
    if fmt == "html":
        return render_html(summary, pngs), written
    refs: dict[str, str] = {}
    if out is not None:
        for name, data in pngs.items():
            path = out.with_name(f"{out.stem}-{name}")
            path.write_bytes(data)
            written.append(path)
            refs[name] = path.name
    return render_markdown(summary, refs), written
