"""The CSV reports: BFCL's leaderboard shape (with `--csv-stats`, the intervals and paired tests), the per-case diffs
(`--csv-cases`) and seed 003's tables in long form (`--csv-tables`); every cell through `csv_row`
(proxy/escape.py)."""

from __future__ import annotations

import csv
import io
from typing import Any

from toolquake.proxy.escape import csv_row
from toolquake.proxy.replay.report.families import csv_cells, csv_columns
from toolquake.proxy.replay.report.paper_tables import CSV_TABLES_COLUMNS, csv_rows
from toolquake.proxy.replay.report.remedies import csv_cells as remedy_cells
from toolquake.proxy.replay.report.remedies import csv_columns as remedy_columns

#: the statistics columns `--csv-stats` appends to the BFCL-shaped CSV
CSV_STATS_COLUMNS = ["Overall Acc CI Low", "Overall Acc CI High", "Drop vs Baseline", "Drop CI Low", "Drop CI High",
                     "Paired N", "Valid to Invalid", "Invalid to Valid", "McNemar p", "Significant",
                     # requests that failed on the backend's side (counted in N as wrong), their codes, and the
                     # accuracy over the answered requests only
                     "Failed", "Failed Codes", "Answered N", "Answered Acc",
                     # pairs the backend refused for the request's shape: in no number (not in N)
                     "Not Comparable", "Not Comparable Codes"]


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
                        *(CSV_STATS_COLUMNS if stats else ()), *trial_cols, *csv_columns(summary),
                        *remedy_columns(summary)]))

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
                     "N/A" if not cmp else f"{cmp['p_value']:.6g}", "N/A" if not cmp else str(cmp["significant"]),
                     arm["failed"], " ".join(f"{k}:{v}" for k, v in arm["failed_codes"].items()), arm["answered"],
                     pct(arm["answered_accuracy"]), sum((arm.get("not_comparable") or {}).values()),
                     " ".join(f"{k}:{v}" for k, v in (arm.get("not_comparable") or {}).items())]
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
                *csv_cells(summary, model, p),
                *remedy_cells(summary, model, p),
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
    w.writerow(CSV_TABLES_COLUMNS)
    w.writerows(csv_row(r) for r in csv_rows(summary))
    return buf.getvalue()


#: `toolquake report --format csv` of sweep results (a directory with no replay): one row per (run, axis, case)
CSV_SWEEP_COLUMNS = ["Model", "Axis", "Unit", "Case", "Category", "Last Right", "First Wrong", "Requests", "Censored",
                     "Wrong At Min", "Monotone", "Complete"]


def render_sweeps_csv(summary: dict[str, Any]) -> str:
    """The per-case breaking points of every sweep run (CSV_SWEEP_COLUMNS); empty cells for null intensities."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_row(CSV_SWEEP_COLUMNS))
    for label, axes in (summary.get("sweeps") or {}).items():
        for axis, r in axes.items():
            for cid, c in sorted(r["cases"].items()):
                done = cid not in r["incomplete"]
                w.writerow(csv_row([label, axis, r["unit"], cid, r["case_categories"].get(cid, ""),
                                    "" if c["last_right"] is None else f"{c['last_right']:g}",
                                    "" if c["first_wrong"] is None else f"{c['first_wrong']:g}", str(c["requests"]),
                                    str(done and c["first_wrong"] is None).lower(),
                                    str(done and c["last_right"] is None).lower(),
                                    str(cid not in r["non_monotone"]).lower(), str(done).lower()]))
    return buf.getvalue()
