"""The HTML report: one self-contained page (summary, tables, embedded plots, filterable per-case diffs), no
network; every name and text that came from a client or a model goes through proxy/escape.py."""

from __future__ import annotations

import base64
from typing import Any

from toolquake.proxy.escape import CTL_CSS, html_attr, html_text
from toolquake.proxy.replay.report.tables import (
    DIRECTION,
    flip_groups,
    headline,
    report_title,
    summary_table,
    tables,
    trials_table,
)
from toolquake.proxy.replay.report.text import compact, short

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
        items.append(f"<dt>{esc(str(st.get('name')))}</dt><dd>params <code>{esc(short(compact(st['params'])))}"
                     "</code></dd>")
        report = st.get("report")
        items.append("<dd>" + ("defined; none recorded as applied" if report is None else "reported nothing"
                               if not report else f"did <code>{esc(short(compact(report)))}</code>") + "</dd>")
    return "<dl class='steps'>" + "".join(items) + "</dl>"


def _html_cases(summary: dict[str, Any]) -> str:
    groups = flip_groups(summary)
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
            cells = [esc(f["case_id"]), esc(DIRECTION[f["direction"]]), esc(f["error_type"]),
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
    title = esc(report_title(summary))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{title}</h1>",
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
