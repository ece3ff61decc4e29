"""The Markdown report: the headline, every table, the plots' files, the per-case diffs; every name and text
that came from a client or a model goes through `md_text` (proxy/escape.py)."""

from __future__ import annotations

from typing import Any

from toolquake.proxy.escape import md_text
from toolquake.proxy.replay.report.tables import (
    DIRECTION,
    flip_groups,
    headline,
    report_title,
    summary_table,
    tables,
    trials_table,
)


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
    lines = [f"# {report_title(summary)}", ""]
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
    groups = flip_groups(summary)
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
                cells = [md_text(f["case_id"]), DIRECTION[f["direction"]], md_text(f["error_type"]),
                         _md_cell(f.get("perturbation")),
                         *([_md_cell(f.get("expected"))] if with_expected else []), _md_cell(f.get("calls")),
                         _md_cell(f.get("baseline_calls"))]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)
