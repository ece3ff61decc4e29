"""The parts of a user message that carry argument values and must survive any rewording.

Numbers (`3`, `200,000`, `-2.5`, `2024-05-01`, `10:30`), quoted strings ("…", '…', `…`, “…”),
URLs and e-mail addresses, and identifiers (snake_case, camelCase, dotted names, file names,
paths, words with digits, ALL-CAPS acronyms, capitalised names inside a sentence). Surface noise
never touches them; a paraphrase must keep every number and quoted string.
"""

from __future__ import annotations

import re

_QUOTED = r"\"[^\"\n]+\"|“[^”\n]+”|‘[^’\n]+’|`[^`\n]+`|(?<![A-Za-z])'[^'\n]+'(?![A-Za-z])"
_URL = r"\b(?:[a-zA-Z][a-zA-Z0-9+.-]*://|www\.)\S+|\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
_NUMBER = r"[-+]?(?<![\w.])\d+(?:[.,:/-]\d+)*(?:\.\d+)?%?"
_IDENT = (r"\b\w+(?:[./\\]\w+)+\b|(?<!\w)/[\w./-]+"   # dotted names, file names, paths
          r"|\b\w*[_\d]\w*\b"                        # snake_case, words with digits
          r"|\b[a-z]+[A-Z]\w*\b"                       # camelCase
          r"|\b[A-Z]{2,}\w*\b")                        # acronyms
PROTECTED = re.compile("|".join(f"(?:{p})" for p in (_QUOTED, _URL, _NUMBER, _IDENT)))
_NAME = re.compile(r"(?<=[^\s.!?]\s)[A-Z][a-z]+")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*")
QUOTED = re.compile(_QUOTED)


def protected_spans(text: str) -> list[tuple[int, int]]:
    """Sorted, non-overlapping (start, end) spans that must stay as they are."""
    spans = [m.span() for m in PROTECTED.finditer(text)]
    spans += [m.span() for m in _NAME.finditer(text)]  # names: capitalised words not starting a sentence
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def numbers(text: str) -> list[str]:
    """Every number in `text`, normalised (thousands separators dropped): '200,000' -> '200000'."""
    out = []
    for m in NUMBER.finditer(text):
        raw = m.group().lstrip("+")
        out.append(re.sub(r",(?=\d{3}\b)", "", raw))
    return out


def quoted(text: str) -> list[str]:
    """The inner text of every quoted string in `text`."""
    return [m.group()[1:-1] for m in QUOTED.finditer(text)]


def missing_from(original: str, rewritten: str) -> list[str]:
    """The numbers and quoted strings of `original` that `rewritten` lost (empty when it kept all)."""
    lost = []
    have = set(numbers(rewritten))
    for n in numbers(original):
        if n not in have and n.lstrip("-") not in have:
            lost.append(n)
    for q in quoted(original):
        if q not in rewritten:
            lost.append(f'"{q}"')
    return lost


def added_numbers(original: str, rewritten: str) -> list[str]:
    """Numbers in `rewritten` that `original` does not have: a rewording that brings new values
    (typically a model answering the request instead of rephrasing it) changes the meaning."""
    have = set(numbers(original))
    have |= {n.lstrip("-") for n in have}
    return [n for n in dict.fromkeys(numbers(rewritten)) if n not in have and n.lstrip("-") not in have]
