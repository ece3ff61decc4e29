"""Lexical relatedness for the remedies: a tokenizer without backtracking and Okapi BM25, both linear in the text.

`terms(text)` splits text into lower-case word pieces (camelCase and snake_case split, a plural `s` dropped, a few
English function words left out); `Doc` is one scored text's term statistics (built once, cached by the caller);
`Index(docs).scores(query)` is Okapi BM25 of every doc against the query's terms, the documents' frequencies taken
from `docs` themselves (a request's tools, a tool response's records). Not a remedy: the registry skips `_` modules.
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


class Index:
    """Okapi BM25 over a list of docs: each term's postings (doc, count), each doc's length normalisation; the
    documents' frequencies and mean length are those of these docs. Built once for a list of docs (a toolkit, a
    response's records) in time linear in their terms; scoring a query touches only the postings of its terms."""

    def __init__(self, docs: list[Doc]) -> None:
        self.size = len(docs)
        mean = sum(d.length for d in docs) / self.size if docs else 0.0
        self.norms = [K1 * (1.0 - B + B * d.length / (mean or 1.0)) for d in docs]
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for i, doc in enumerate(docs):
            for term, count in doc.counts.items():
                self.postings.setdefault(term, []).append((i, count))

    def nbytes(self) -> int:
        """About what the index holds in memory (for a byte-bounded cache)."""
        return 64 * self.size + sum(100 + 72 * len(p) for p in self.postings.values())

    def scores(self, query: Iterable[str]) -> list[float]:
        """BM25 of each doc for the query's terms (each counted once)."""
        scores = [0.0] * self.size
        norms = self.norms
        for term in set(query):
            postings = self.postings.get(term)
            if not postings:
                continue
            df = len(postings)
            idf = math.log(1.0 + (self.size - df + 0.5) / (df + 0.5))
            for i, tf in postings:
                scores[i] += idf * tf * (K1 + 1.0) / (tf + norms[i])
        return scores
