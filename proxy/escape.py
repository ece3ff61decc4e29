"""Escaping for the reports: text that came from clients or models (model, profile and tool names, case ids,
error messages, calls) shown in Markdown, HTML, CSV and plots.

Every function is one pass of `str.translate` (plus, for Markdown, one regular expression of fixed width), so
time is linear in the text and nothing backtracks.

- `visible`: control, format (bidi overrides, zero-width, tag characters), separator and lone surrogate
  code points as `\\u202e`-style text, so a name cannot reorder or hide what is shown around it.
- `md_text`: plain text inside Markdown (table cells, headings, list items): Markdown and HTML-significant
  characters escaped, newlines as spaces, control and bidi characters visible.
- `html_text`: `html.escape` (quotes included, safe in attributes) with control and bidi characters shown in
  a marked `<span class='ctl'>`.
- `csv_cell`: a text cell that a spreadsheet would read as a formula (=, +, -, @, tab, CR first) gets a leading
  `'` (OWASP's CSV injection advice; a CR is shown as `\\u000d`); numbers, and text that is a number such as
  `-0.25` or `-12.50%`, stay as they are.
- `plot_text`: a label for matplotlib: visible, `$` escaped (no mathtext parsing), cut to a length.
"""

from __future__ import annotations

import functools
import html
import re
import unicodedata
from typing import Any

#: categories shown as escapes: control, format (bidi, zero-width, tags), line / paragraph separators, surrogates
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
#: the zero-width joiner stays: emoji sequences use it, and it reorders nothing
_KEPT = frozenset({0x200D})
#: the planes that hold code points of those categories (the rest are letters, symbols or unassigned)
_SCAN = (range(0x0, 0x30000), range(0xE0000, 0xE1000))


def _escape(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


@functools.cache
def _hidden() -> tuple[int, ...]:
    return tuple(cp for block in _SCAN for cp in block
                 if cp not in _KEPT and unicodedata.category(chr(cp)) in _HIDDEN_CATEGORIES)


@functools.cache
def _hidden_pattern(keep: str) -> re.Pattern[str]:
    """One character class of every hidden code point but those in `keep` (as ranges: a linear scan in C)."""
    cps = [cp for cp in _hidden() if chr(cp) not in keep]
    ranges: list[list[int]] = []
    for cp in cps:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    body = "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)
    return re.compile(f"[{body}]")


def _sub_hidden(text: str, keep: str, markup: bool = False) -> str:
    if markup:
        return _hidden_pattern(keep).sub(
            lambda m: f"<span class='ctl' title='U+{ord(m.group()):04X}'>{_escape(ord(m.group()))}</span>", text)
    return _hidden_pattern(keep).sub(lambda m: _escape(ord(m.group())), text)


def visible(text: str, keep: str = "") -> str:
    """`text` with every control, format, separator and surrogate code point (except those in `keep`, and the
    zero-width joiner) written as `\\uXXXX` / `\\UXXXXXXXX`."""
    return _sub_hidden(text, keep)


# ---------------------------------------------------------------------------------------------
# Markdown

#: in this order (the backslash first, `&` before the entities that use it); each a `str.replace`
_MD_REPLACE = (("\\", "\\\\"), ("&", "&amp;"), ("<", "&lt;"), ("`", "\\`"), ("*", "\\*"), ("|", "\\|"),
               ("~", "\\~"), ("#", "\\#"), ("$", "\\$"), ("\n", " "), ("\r", " "), ("\t", " "),
               # `]` only where it could end a link's or an image's text (with no reference definitions in a
               # report, no other bracket makes a link), so that the report's own `[lo, hi]` stays as it was
               ("](", "\\]("), ("][", "\\]["), ("_", "\\_"))
#: `_` is put back where it cannot open or close emphasis: between two letters or digits (`simple_python_0`)
_INTRAWORD = re.compile(r"(?<=[0-9A-Za-z])\\_(?=[0-9A-Za-z])")


def md_text(text: Any) -> str:
    """`text` as literal Markdown text, one line (safe in a table cell, a heading or a list item). `>` is left:
    without `<` it opens no tag, and a table cell never starts a line (no block quote)."""
    s = str(text)
    for old, new in _MD_REPLACE:
        if old in s:
            s = s.replace(old, new)
    if "\\_" in s:
        s = _INTRAWORD.sub("_", s)
    return _sub_hidden(s, "")


# ---------------------------------------------------------------------------------------------
# HTML

CTL_CSS = ".ctl{color:#b03a2e;background:#fdecea;border-radius:2px;font-family:monospace}"


def html_text(text: Any, keep: str = "\n\t") -> str:
    """`text` escaped for HTML element content and quoted attribute values, with control and bidi characters
    (except those in `keep`) shown as marked `\\uXXXX` spans."""
    return _sub_hidden(html.escape(str(text)), keep, markup=True)


def html_attr(text: Any) -> str:
    """`text` for a quoted attribute value: escaped, control characters as plain `\\uXXXX` (no markup)."""
    return visible(html.escape(str(text)))


# ---------------------------------------------------------------------------------------------
# CSV

#: first characters that make a spreadsheet read a cell as a formula (with their full-width forms)
FORMULA_STARTS = frozenset("=+-@\t\r\uff1d\uff0b\uff0d\uff20")
#: a number as the reports write it: sign, digits, decimals, exponent, an optional percent sign
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?%?")


def csv_cell(value: Any) -> Any:
    """A CSV cell: numbers (and text that is a number) as they are; other text with control characters visible
    (newlines and tabs kept; a CR is shown too: the writers end lines with `\\n`, so `csv` would not quote a
    bare CR, and a reader would split the row there) and a leading `'` when its first character starts a
    formula."""
    if not isinstance(value, str):
        return value
    if not value or _NUMBER.fullmatch(value):
        return value
    value = visible(value, "\n\t")
    return "'" + value if value[0] in FORMULA_STARTS else value


def csv_row(row: Any) -> list[Any]:
    return [csv_cell(v) for v in row]


# ---------------------------------------------------------------------------------------------
# plots


def plot_text(text: Any, limit: int = 80) -> str:
    """A matplotlib label: cut to `limit` characters, control characters visible, `$` taken literally."""
    s = str(text)
    if len(s) > limit:
        s = s[:limit] + "…"
    return visible(s).replace("$", "\\$")
