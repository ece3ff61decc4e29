"""Reports from replay results and the live results store: seed 001's Table 2, seed 003's and seed 002's heatmaps,
BFCL-style CSV.

Everything is computed from the verdicts stored by `toolquake replay` (proxy/replay/run.py) and, with `--db`, by
`toolquake serve --results-db` (proxy/live/results.py: read by `rows.load` into the same rows, one more source,
its arms under the model "live"; every statistic is the same code for both). Several
directories (or files) are merged, e.g. the shards of one run, or runs of different models; a
(model, profile, case) pair found twice counts once (a scored row wins over a failed one).

A request that failed on the backend's side is a scored, invalid pair (as BFCL counts an inference error):
it counts in every number and is reported by code as `failed`, with the accuracy over the answered
requests beside. Pairs not scored yet (toolquake's or the network's failures) are in no number
(`unscored`), so an arm whose perturber could not run never shows up as a drop.

With repeated trials (`replay --trials K`), the accuracies, intervals, paired tests and per-case diffs
are those of trial 0 (one answer per case, as without --trials: the tests assume independent cases);
`trials` adds, per arm, the accuracy of every trial with their mean and spread, pass^k and pass@k.

The report is built in layers, each module importing only those below it (a contract in pyproject.toml):

    build                                   load, summarize, draw, render in the format asked for
    markdown | html | csv_out | json_out    the renderers
    plots                                   matplotlib figures
    tables                                  every table as (title, header, rows) of text cells
    summary | cases                         the JSON report; the per-case diffs
    families | paper_tables | sweeps | live perturbation families and recovery; the papers' measures;
      | remedies                            `toolquake sweep`'s breaking points and survival curves; the
                                            anytime-valid intervals, shadow consistency and noise floor; what
                                            remedied arms win back against their unremedied twins
    stats                                   accuracy, intervals, paired tests, trials, flips
    rows | arms                             load: results files → rows (every SQLite read); the experiment
                                            each step belongs to, as its perturber declares it
    text                                    numbers and stored values as text

This package's namespace re-exports the names the CLI, the scripts and the tests use.
"""

from __future__ import annotations

from toolquake.proxy.replay.report.build import build, summarize_db
from toolquake.proxy.replay.report.cases import calls_text, case_details, perturbation_steps, perturbation_text
from toolquake.proxy.replay.report.csv_out import (
    CSV_CASES_COLUMNS,
    CSV_STATS_COLUMNS,
    CSV_TRIALS_COLUMNS,
    render_cases_csv,
    render_csv,
    render_tables_csv,
)
from toolquake.proxy.replay.report.html import extra_html_sections, render_html
from toolquake.proxy.replay.report.json_out import json_text
from toolquake.proxy.replay.report.markdown import render_markdown
from toolquake.proxy.replay.report.paper_tables import (
    budget_ticks,
    format_configurations,
    format_counts,
    format_grid,
    format_label,
    padding_counts,
    padding_grid,
)
from toolquake.proxy.replay.report.plots import accuracy_plot, heatmaps, response_plots, survival_plots
from toolquake.proxy.replay.report.rows import LIVE, Results, Row, load, result_files
from toolquake.proxy.replay.report.stats import ALPHA, BASELINE, flips, paired, trial_numbers
from toolquake.proxy.replay.report.summary import summarize
from toolquake.proxy.replay.report.sweeps import sweep_numbers
from toolquake.proxy.replay.report.tables import headline, summary_table, tables, trials_table
from toolquake.proxy.replay.report.text import drop_ci, p_text, pct_ci

__all__ = [
    "ALPHA", "BASELINE", "LIVE", "CSV_CASES_COLUMNS", "CSV_STATS_COLUMNS", "CSV_TRIALS_COLUMNS", "Results", "Row",
    "accuracy_plot", "budget_ticks", "build", "calls_text", "case_details", "drop_ci", "extra_html_sections",
    "flips", "format_configurations", "format_counts", "format_grid", "format_label", "headline", "heatmaps",
    "json_text", "load", "p_text", "padding_counts", "padding_grid", "paired", "pct_ci", "perturbation_steps",
    "perturbation_text", "render_cases_csv", "render_csv", "render_html", "render_markdown", "render_tables_csv",
    "response_plots", "result_files", "summarize", "summarize_db", "summary_table", "survival_plots",
    "sweep_numbers", "tables", "trial_numbers", "trials_table",
]
