"""`toolquake report` from replay results and the live results store: load, summarize, draw, render in the format
asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolquake.proxy.replay.report.cases import case_details
from toolquake.proxy.replay.report.csv_out import render_cases_csv, render_csv, render_sweeps_csv, render_tables_csv
from toolquake.proxy.replay.report.html import render_html
from toolquake.proxy.replay.report.json_out import json_text
from toolquake.proxy.replay.report.markdown import render_markdown
from toolquake.proxy.replay.report.paper_tables import response_plot_name
from toolquake.proxy.replay.report.plots import accuracy_plot, heatmaps, response_plots, survival_plots
from toolquake.proxy.replay.report.rows import load
from toolquake.proxy.replay.report.stats import BASELINE, flips
from toolquake.proxy.replay.report.summary import summarize


def build(
    paths: list[str | Path], fmt: str, out: Path | None, baseline: str = BASELINE, plots: bool = True,
    csv_stats: bool = False, csv_cases: bool = False, csv_tables: bool = False, db: str | Path | None = None,
) -> tuple[str, list[Path]]:
    """The report text in `fmt`, and the PNG files written next to `out` (md with --out; never to stdout), from
    the replay results in `paths` and the live results store `db`."""
    res = load(paths, db)
    summary = summarize(res, baseline)
    written: list[Path] = []
    if fmt == "csv" and summary.get("sweeps") and not summary["models"]:
        return render_sweeps_csv(summary), written
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
        fig4 = {response_plot_name(k): v for k, v in (response_plots(summary, "svg") if plots else {}).items()}
        survival = survival_plots(summary, "svg") if plots else {}
        svgs = {**({"accuracy per arm": svg} if svg else {}), **fig4, **survival}
        return render_html(summary, pngs, svgs or None), written
    acc = accuracy_plot(summary, "png") if plots else None
    if acc is not None:
        pngs = {"accuracy.png": acc, **pngs}
    if plots:
        pngs.update(response_plots(summary, "png"))
        pngs.update(survival_plots(summary, "png"))
    refs: dict[str, str] = {}
    if out is not None:
        for name, data in pngs.items():
            path = out.with_name(f"{out.stem}-{name}")
            path.write_bytes(data)
            written.append(path)
            refs[name] = path.name
    return render_markdown(summary, refs), written


def summarize_db(path: str | Path, baseline: str = BASELINE) -> dict[str, Any]:
    """The JSON report of a live results store (`toolquake report --db PATH --format json`), per-case diffs
    included."""
    res = load([], path)
    summary = summarize(res, baseline)
    summary["flips"] = case_details(res, flips(res, baseline), baseline)
    return summary
