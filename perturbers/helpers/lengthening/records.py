"""Synthetic records shaped like a JSON tool response's own records (seed 003, challenge 2).

`RecordSource(value, rng)` finds the main array of records in a decoded JSON value (the longest
array, records being objects where there are any) and makes new records with the same keys and
nesting: numbers, booleans, dates and free text varied from the values the original records hold,
and every identifier (ids, codes, names, titles, URLs, e-mails, file names) fresh and unique, so
that no synthetic record answers a question about an original one.

Speed matters (80K tokens of records in a few ms): a handful of fully varied *variants* are built
once, each serialised into a text template with holes where its identifiers go; every record
after that is a template with freshly drawn identifiers. A fresh identifier keeps the character
classes and run lengths of the value it replaces (letters for letters, digits for digits, words
for words of the same length), so a record costs exactly as many `estimate` tokens as its variant.
"""

from __future__ import annotations

import datetime as _dt
import json
import random
import re
import string
from typing import Any, Iterator

from toolquake.perturbers.helpers.lengthening.budget import text_cost

_HOLE = "\u241eTQHOLE{}\u241e"  # a sentinel that never occurs in real data
_HOLE_RE = re.compile('"\u241eTQHOLE(\\d+)\u241e"')
_ID_KEY = re.compile(r"(^|[_\-.])(id|ids|uuid|guid|code|key|token|sku|slug|hash|ref|url|uri|link|href|email|mail|"
                     r"number|no|name|title|label|file|filename|path)$")
_ID_CAMEL = re.compile(r"[a-z0-9](Id|ID|Ids|Uuid|Code|Key|Url|URL|Uri|Name|Title|Number|Email|Path)$")
_WORDY_KEY = re.compile(r"(^|[_\-.])(name|title|label)$|[a-z](Name|Title|Label)$")
_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})")
# possessive: giving back part of the host never helps the rest match, and backtracking into it was quadratic
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*+://[^/]++)(.*+)$")
_EXT = re.compile(r"(\.[A-Za-z0-9]{1,5})$")
_RUNS = re.compile(r"[a-z]+|[A-Z]+|[0-9]+|[^a-zA-Z0-9]+")
_WORD_RUNS = re.compile(r"[A-Za-z]+|[0-9]+|[^A-Za-z0-9]+")
_WORD = re.compile(r"[A-Za-z]+")
_MIXED = re.compile(r"^(?=.*[A-Za-z])(?=.*\d)\S+$")
_HEXISH = re.compile(r"^(?=.*[a-fA-F])[0-9a-fA-F-]{8,}$")

# randbytes(k).translate(table) draws k characters of one class at C speed
_LOWER_T = bytes(ord(string.ascii_lowercase[i % 26]) for i in range(256))
_UPPER_T = bytes(ord(string.ascii_uppercase[i % 26]) for i in range(256))
_DIGIT_T = bytes(ord(string.digits[i % 10]) for i in range(256))
_HEXL_T = bytes(ord("abcdef"[i % 6]) for i in range(256))
_HEXU_T = bytes(ord("ABCDEF"[i % 6]) for i in range(256))


def find_main_array(value: Any) -> tuple[list[Any], list[Any]] | None:
    """(path, array) of the main array of records: the longest array of objects, else the longest
    non-empty array; None when the value holds no array. Paths are lists of keys and indices."""
    best: tuple[tuple[int, int], list[Any], list[Any]] | None = None

    def walk(v: Any, path: list[Any]) -> None:
        nonlocal best
        if isinstance(v, list):
            if v:
                rank = (1 if all(isinstance(x, dict) for x in v) else 0, len(v))
                if best is None or rank > best[0]:
                    best = (rank, list(path), v)
            for i, x in enumerate(v):
                if isinstance(x, (dict, list)):
                    walk(x, path + [i])
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(x, (dict, list)):
                    walk(x, path + [k])

    walk(value, [])
    return None if best is None else (best[1], best[2])


def _set_path(value: Any, path: list[Any], new: Any) -> Any:
    """A copy of `value` with the element at `path` replaced (only the containers on the path are copied)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = list(value) if isinstance(value, list) else dict(value)
    copy[head] = _set_path(value[head], rest, new)
    return copy


def _is_identifier(key: str | None, value: Any) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return False
    named = key is not None and (bool(_ID_KEY.search(key.lower())) or bool(_ID_CAMEL.search(key)))
    if isinstance(value, int):
        return named
    if not isinstance(value, str) or not value.strip():
        return False
    if not named and _DATE.match(value):
        return False
    return named or bool(_MIXED.match(value)) or bool(_HEXISH.match(value)) or bool(_URL.match(value))


class _Hole:
    """An identifier slot: a compiled plan for drawing fresh values shaped like `original`.

    A plan is a list of steps: a literal string, a (translate table, length) run of random
    characters of one class, or a (words, capitalisation) run choosing a same-length word.
    """

    __slots__ = ("original", "wordy", "plan", "safe", "misses", "width", "widened")

    def __init__(self, original: Any, wordy: bool) -> None:
        self.original = original
        self.wordy = wordy
        self.misses = 0  # drawn values that were taken already: many means too few words to combine
        self.width = len(str(abs(original))) if isinstance(original, int) else 0  # digits of an integer id
        self.widened = False  # drawn values are longer than the original: their cost must be counted
        self.plan: list[Any] = []
        self.safe = False  # True when a drawn value needs no JSON escaping

    def compile(self, words: dict[int, list[str]]) -> None:
        v = self.original
        if isinstance(v, int):
            return
        prefix, body, suffix = "", v, ""
        m = _URL.match(v)
        if m and not self.wordy:
            prefix, body = m[1], m[2]
        m = _EXT.search(body)
        if m and m.start() > 0 and not self.wordy and not body[m.start() + 1:].isdigit():
            body, suffix = body[:m.start()], m[1]
        plan: list[Any] = [prefix] if prefix else []
        hexish = _HEXISH.match(v) is not None
        for run in (_WORD_RUNS if self.wordy else _RUNS).findall(body):
            c = run[0]
            same = words.get(len(run)) if self.wordy and run.isalpha() else None
            if same and len(same) > 1:
                style = str.upper if run.isupper() and len(run) > 1 else str.capitalize if c.isupper() else str.lower
                plan.append((same, style))
            elif c.isascii() and c.isalpha() and run.isalpha() and run.isascii():
                if run.islower() or run.isupper():
                    low = run.islower()
                    kind = (_HEXL_T if low else _HEXU_T) if hexish else (_LOWER_T if low else _UPPER_T)
                    plan.append((kind, len(run)))
                else:  # mixed case (wordy runs): keep the first letter's case, lower the rest
                    plan.append((_UPPER_T if c.isupper() else _LOWER_T, 1))
                    plan.append((_LOWER_T, len(run) - 1))
            elif run.isdigit() and run.isascii():
                plan.append((_DIGIT_T, len(run)))
            else:
                plan.append(run)
        if suffix:
            plan.append(suffix)
        self.plan = plan
        literal = "".join(step for step in plan if isinstance(step, str))
        words_ok = all(
            w.isascii() and w.isalpha()
            for step in plan
            if isinstance(step, tuple) and isinstance(step[0], list)
            for w in step[0]
        )
        self.safe = words_ok and json.dumps(literal, ensure_ascii=False)[1:-1] == literal


class RecordSource:
    """Draws synthetic records like the originals of one JSON value's main array."""

    def __init__(
        self,
        value: Any,
        rng: random.Random,
        separators: tuple[str, str] = (", ", ": "),
        words: str = "",
        variants: int = 16,
    ) -> None:
        found = find_main_array(value)
        if found is None:
            raise LookupError("the JSON holds no array of records")
        self.path, self.originals = found
        self.value = value
        self.rng = rng
        self.separators = separators
        self._pools: dict[tuple, list[Any]] = {}
        self._forbidden: set[Any] = set()
        self._words: dict[int, list[str]] = {}
        for rec in self.originals:
            self._collect(rec, ())
        self._forbidden |= _all_leaves(value)
        for w in _WORD.findall(
            words + " " + " ".join(x for x in self._forbidden if isinstance(x, str) and not _URL.match(x))
        ):
            if len(w) > 1:
                self._words.setdefault(len(w), []).append(w.lower())
        for length in self._words:
            self._words[length] = sorted(set(self._words[length]))
        self._used: set[Any] = set()
        originals = set(self.original_texts())
        self._variants = []
        for _ in range(variants):
            parts, holes, cost = self._template(self._vary(rng.choice(self.originals), ()))
            if holes or parts[0] not in originals:  # a record without identifiers must differ from every original
                self._variants.append((parts, holes, cost))
        if not self._variants:
            raise LookupError("the records hold nothing that can be varied")

    # -- what the originals hold ------------------------------------------------------------------
    def _collect(self, v: Any, path: tuple) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                self._collect(x, path + (k,))
        elif isinstance(v, list):
            for x in v:
                self._collect(x, path + ("[]",))
        else:
            self._pools.setdefault(path, []).append(v)
            if isinstance(v, str):
                for w in _WORD.findall(v):
                    if len(w) > 1:
                        self._words.setdefault(len(w), []).append(w.lower())

    # -- one fully varied record (slow path, a few times per request) ------------------------------
    def _vary(self, v: Any, path: tuple, key: str | None = None) -> Any:
        if isinstance(v, dict):
            return {k: self._vary(x, path + (k,), k) for k, x in v.items()}
        if isinstance(v, list):
            return [self._vary(x, path + ("[]",), key) for x in v]
        if _is_identifier(key, v) or (not path and isinstance(v, (str, int)) and not isinstance(v, bool)):
            # identifiers, and records that are bare strings or integers (ids, file names): fresh values
            return _Hole(v, isinstance(v, str) and (" " in v.strip() or bool(key and _WORDY_KEY.search(key))))
        rng = self.rng
        if isinstance(v, bool):
            return rng.random() < 0.5
        if isinstance(v, int):
            # 0/1 are usually flags; other counts and amounts move by up to ±30 %, keeping their sign
            return v if abs(v) <= 1 else round(v * rng.uniform(0.7, 1.3))
        if isinstance(v, float):
            decimals = len(repr(v).partition(".")[2]) if "e" not in repr(v) else 6
            return round(v * rng.uniform(0.7, 1.3), min(decimals, 6))
        if isinstance(v, str):
            m = _DATE.match(v)
            if m:
                try:
                    day = _dt.date(int(m[1]), int(m[2]), int(m[3])) + _dt.timedelta(days=rng.randint(-30, 30))
                    return day.isoformat() + v[10:]
                except ValueError:
                    return v
            pool = self._pools.get(path) or [v]
            return rng.choice(pool)
        return v

    def _template(self, record: Any) -> tuple[list[str], list[_Hole], int]:
        """Serialise a varied record with holes for its identifiers: (text parts, holes, token cost)."""
        holes: list[_Hole] = []

        def mark(v: Any) -> Any:
            if isinstance(v, _Hole):
                v.compile(self._words)
                holes.append(v)
                return _HOLE.format(len(holes) - 1)
            if isinstance(v, dict):
                return {k: mark(x) for k, x in v.items()}
            if isinstance(v, list):
                return [mark(x) for x in v]
            return v

        text = json.dumps(mark(record), ensure_ascii=False, separators=self.separators)
        parts = _HOLE_RE.split(text)  # text, hole index, text, hole index, ..., text
        sample = self._fill(parts, holes)
        return parts, holes, text_cost(sample) + text_cost(self.separators[0].strip() or ",")

    # -- fresh identifiers (fast path, every record) ----------------------------------------------
    def _fresh(self, hole: _Hole) -> Any:
        while True:
            for attempt in range(4):
                value = self._draw(hole, attempt >= 2 or hole.misses > 16)
                if value not in self._forbidden and value not in self._used:
                    self._used.add(value)
                    return value
                hole.misses += 1
            if hole.misses > 32:
                # the shape allows few values (a 1-digit id, "B1"): widen it for the rest of the records
                if isinstance(hole.original, int):
                    hole.width += 1
                else:  # two more digits, before a file extension if there is one
                    at = (
                        len(hole.plan) - 1
                        if hole.plan and isinstance(hole.plan[-1], str) and hole.plan[-1].startswith(".")
                        else len(hole.plan)
                    )
                    hole.plan.insert(at, (_DIGIT_T, 2))
                hole.widened, hole.misses = True, 0

    def _draw(self, hole: _Hole, plain: bool) -> Any:
        rng = self.rng
        original = hole.original
        if isinstance(original, int):
            digits = hole.width
            drawn = rng.randrange(10 ** (digits - 1), 10**digits)
            return -drawn if original < 0 else drawn
        rb = rng.randbytes
        out = []
        for step in hole.plan:
            if isinstance(step, str):
                out.append(step)
            elif isinstance(step[0], bytes):
                out.append(rb(step[1]).translate(step[0]).decode())
            elif plain:  # a word run when words keep colliding: random letters of the same length
                out.append(step[1](rb(len(step[0][0])).translate(_LOWER_T).decode()))
            else:
                out.append(step[1](rng.choice(step[0])))
        return "".join(out)

    def _fill(self, parts: list[str], holes: list[_Hole]) -> str:
        out = [parts[0]]
        for i in range(1, len(parts), 2):
            hole = holes[int(parts[i])]
            value = self._fresh(hole)
            if hole.safe and isinstance(value, str):
                out.append('"' + value + '"')
            elif isinstance(value, int):
                out.append(str(value))
            else:
                out.append(json.dumps(value, ensure_ascii=False))
            out.append(parts[i + 1])
        return "".join(out)

    # -- the stream --------------------------------------------------------------------------------
    def records(self) -> Iterator[tuple[str, int]]:
        """An endless stream of (record JSON text, estimate cost including its separator)."""
        variants = self._variants
        i = 0
        sep = text_cost(self.separators[0].strip() or ",")
        while True:
            parts, holes, cost = variants[i % len(variants)]
            text = self._fill(parts, holes)
            if any(h.widened for h in holes):
                cost = text_cost(text) + sep
            yield text, cost
            i += 1

    def render(self, records: list[str]) -> str:
        """The whole JSON value as text, its main array holding `records` (already serialised)."""
        return render_array(self.value, self.path, self.separators, records)

    def original_texts(self) -> list[str]:
        return [json.dumps(r, ensure_ascii=False, separators=self.separators) for r in self.originals]


def render_array(value: Any, path: list[Any], separators: tuple[str, str], records: list[str]) -> str:
    """`value` as JSON text, the array at `path` holding `records` (already serialised)."""
    marker = _HOLE.format("array")
    text = json.dumps(_set_path(value, path, marker), ensure_ascii=False, separators=separators)
    return text.replace(json.dumps(marker, ensure_ascii=False), "[" + separators[0].join(records) + "]", 1)


def _all_leaves(v: Any) -> set[Any]:
    out: set[Any] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, (str, int)) and not isinstance(x, bool):
            out.add(x)
    return out


def separators_of(text: str) -> tuple[str, str]:
    """The JSON separators a serialised value uses (compact or with spaces)."""
    return (", ", ": ") if re.search(r'":\s|,\s', text) else (",", ":")
