"""Lexical relatedness for the remedies: a tokenizer without backtracking and Okapi BM25, both linear in the text.

`terms(text)` splits text into lower-case word pieces (camelCase and snake_case split, a plural `s` dropped, a few
English function words left out); `Doc` is one scored text's term statistics (built once, cached by the caller);
`bm25(docs, query)` scores every doc against the query's terms, the documents' frequencies taken from `docs`
themselves (a request's tools, a tool response's records). Not a remedy: the registry skips `_` modules.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

# possessive: an upper-case run never gives characters back, so a long run is scanned once
_PIECE = re.compile(r"[A-Z]*+[a-z]+|[A-Z]++|[0-9]++")
_STOP = frozenset(
    "a an and are as at be by can could do does for from how i in is it its me my of on or our please show "
    "some that the their them then there these this to us was we what when where which who will with would you "
    "your".split()
)
#: BM25's usual constants: term-frequency saturation and length normalisation
K1 = 1.2
B = 0.75


def terms(text: str) -> list[str]:
    """The text's word pieces, lower-cased, in order (function words left out, a plural `s` dropped)."""
    out = []
    for piece in _PIECE.findall(text):
        word = piece.lower()
        if word in _STOP:
            continue
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        out.append(word)
    return out


@dataclass(frozen=True, slots=True)
class Doc:
    """One text's term statistics: the set of its terms, how often each occurs, how many it holds."""

    vocabulary: frozenset[str]
    counts: dict[str, int]
    length: int

    @classmethod
    def of(cls, text: str, only: frozenset[str] | None = None) -> Doc:
        """The statistics of `text`; with `only`, of those terms alone (its length still counts every term):
        all that scoring against a query whose terms are `only` reads, in memory bounded by the query."""
        found = terms(text)
        counts = Counter(found if only is None else (t for t in found if t in only))
        return cls(frozenset(counts), dict(counts), len(found))

    def nbytes(self) -> int:
        """About what this entry holds in memory (for a byte-bounded cache)."""
        return 240 + 120 * len(self.counts)


def bm25(docs: list[Doc], query: Iterable[str]) -> list[float]:
    """Okapi BM25 of each doc for the query's terms (each counted once), the documents' frequencies and mean
    length taken over `docs`. Linear in the docs and their matching terms: a doc sharing no term costs one set
    intersection."""
    wanted = frozenset(query)
    n = len(docs)
    if not n or not wanted:
        return [0.0] * n
    shared = [wanted & d.vocabulary for d in docs]
    df: Counter[str] = Counter()
    for common in shared:
        df.update(common)
    idf = {t: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}
    mean = sum(d.length for d in docs) / n or 1.0
    scores = [0.0] * n
    for i, common in enumerate(shared):
        if not common:
            continue
        doc = docs[i]
        norm = K1 * (1.0 - B + B * doc.length / mean)
        total = 0.0
        for t in common:
            tf = doc.counts[t]
            total += idf[t] * tf * (K1 + 1.0) / (tf + norm)
        scores[i] = total
    return scores
