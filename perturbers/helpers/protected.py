"""The parts of a user message that carry argument values and must survive any rewording.

Numbers (`3`, `200,000`, `-2.5`, `2024-05-01`, `10:30`), quoted strings ("…", '…', `…`, “…”),
URLs and e-mail addresses, and identifiers (snake_case, camelCase, dotted names, file names,
paths, words with digits, ALL-CAPS acronyms, capitalised names inside a sentence). Surface noise
never touches them; a paraphrase must keep every number and quoted string (a number may be spelled out:
"5 years" and "five years" say the same).
"""

from __future__ import annotations

import re

# Every alternative costs O(1) amortised per start position, so a scan is linear in the text (client text: a
# backtracking shape here stalls the event loop, issue 28). A failed attempt is never repeated over the same
# characters by the next start: a straight quote's failed attempt leaves no such quote after it on the line, a
# curly opening quote with no closing one after it on its line is hidden before the scan (`_scannable`), and the
# parts that a run of starts would each rescan to the end of the run are bounded: a URL scheme (40 characters,
# more than any registered one), an e-mail address's local part (64, RFC 5321) and its domain's first label (63).
_QUOTED = r"\"[^\"\n]+\"|“[^”\n]+”|‘[^’\n]+’|`[^`\n]+`|(?<![A-Za-z])'[^'\n]+'(?![A-Za-z])"
_URL = (r"\b(?:[a-zA-Z][a-zA-Z0-9+.-]{0,39}+://|www\.)\S+"
        r"|\b[\w.+-]{1,64}+@[\w-]{1,63}+(?:\.[\w-]+)+")
_NUMBER = r"[-+]?(?<![\w.])\d+(?:[.,:/-]\d+)*(?:\.\d+)?%?"
_IDENT = (r"\b\w+(?:[./\\]\w+)+\b|(?<!\w)/[\w./-]+"   # dotted names, file names, paths
          r"|\b\w*[_\d]\w*\b"                        # snake_case, words with digits
          r"|\b[a-z]+[A-Z]\w*\b"                       # camelCase
          r"|\b[A-Z]{2,}\w*\b")                        # acronyms
PROTECTED = re.compile("|".join(f"(?:{p})" for p in (_QUOTED, _URL, _NUMBER, _IDENT)))
_NAME = re.compile(r"(?<=[^\s.!?]\s)[A-Z][a-z]+")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*")
QUOTED = re.compile(_QUOTED)
# per curly pair: the rest of a line after its last closing quote (or the whole line), when it holds an opening
# quote; each part between closing quotes and line ends is read once
_DEAD_OPENERS = tuple((opening, re.compile(f"(?<![^{closing}\\n])[^{closing}{opening}\\n]*+{opening}[^{closing}\\n]*+$",
                                           re.MULTILINE)) for opening, closing in (("“", "”"), ("‘", "’")))


def _scannable(text: str) -> str:
    """`text` with every curly opening quote that no closing quote follows on its line replaced by NUL (same length,
    same class for every other pattern here). Such a quote can start no quoted string, and searching from each of
    a line of them for the closing quote would take quadratic time."""
    for opening, dead in _DEAD_OPENERS:
        if opening in text:
            text = dead.sub(lambda m, o=opening: m.group().replace(o, "\0"), text)
    return text


def protected_spans(text: str) -> list[tuple[int, int]]:
    """Sorted, non-overlapping (start, end) spans that must stay as they are."""
    text = _scannable(text)
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


_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9}
_ORDINALS = {"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8,
             "ninth": 9, "tenth": 10, "twelfth": 12, "twentieth": 20, "hundredth": 100}
_NUMBER_TOKEN = re.compile(r"[A-Za-z]+(?:-[A-Za-z]+)?|[^\sA-Za-z]")


def spelled_numbers(text: str) -> list[str]:
    """Numbers written in English words, as digits: 'five years' -> ['5'], 'two hundred and fifty' -> ['250'],
    'twenty-one' -> ['21'], 'five, four and three' -> ['5', '4', '3'], 'third' -> ['3'], 'a dozen' -> ['12']."""
    out: list[str] = []
    total = current = 0
    last = ""  # kind of the previous number word: unit, tens, scale ("" outside a number)

    def flush() -> None:
        nonlocal total, current, last
        if last:
            out.append(str(total + current))
        total = current = 0
        last = ""

    tokens = [t.lower() for t in _NUMBER_TOKEN.findall(text)]
    for i, word in enumerate(tokens):
        parts = word.split("-")
        if len(parts) == 2 and parts[0] in _TENS and parts[1] in _UNITS:  # twenty-one
            if last in ("unit", "tens"):
                flush()
            current += _TENS[parts[0]] + _UNITS[parts[1]]
            last = "unit"
        elif word in _UNITS:
            if last in ("unit",):
                flush()
            current += _UNITS[word]
            last = "unit"
        elif word in _TENS:
            if last in ("unit", "tens"):
                flush()
            current += _TENS[word]
            last = "tens"
        elif word in _SCALES and last:
            if _SCALES[word] == 100:
                current = (current or 1) * 100
            else:
                total += (current or 1) * _SCALES[word]
                current = 0
            last = "scale"
        elif word == "and" and last == "scale" and i + 1 < len(tokens) and (
                tokens[i + 1] in _UNITS or tokens[i + 1].split("-")[0] in _TENS):
            continue
        elif word in _ORDINALS or word == "dozen":
            if last in ("unit", "tens") and word == "dozen":
                current *= 12
            else:
                if last in ("unit",):
                    flush()
                current += 12 if word == "dozen" else _ORDINALS[word]
            last = "unit"
            flush()
        else:
            flush()
    flush()
    return out


def quoted(text: str) -> list[str]:
    """The inner text of every quoted string in `text`."""
    return [m.group()[1:-1] for m in QUOTED.finditer(_scannable(text))]


def missing_from(original: str, rewritten: str) -> list[str]:
    """The numbers and quoted strings of `original` that `rewritten` lost (empty when it kept all); a number
    kept in words counts as kept, and so does one written in digits that the original spelled out."""
    lost = []
    have = set(numbers(rewritten)) | set(spelled_numbers(rewritten))
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
    have = set(numbers(original)) | set(spelled_numbers(original))
    have |= {n.lstrip("-") for n in have}
    return [n for n in dict.fromkeys(numbers(rewritten)) if n not in have and n.lstrip("-") not in have]
