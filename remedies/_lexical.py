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
    def of(cls, text: str) -> Doc:
        found = terms(text)
        counts = Counter(found)
        return cls(frozenset(counts), dict(counts), len(found))

    @classmethod
    def for_query(cls, text: str, query: frozenset[str]) -> Doc:
        """The statistics of `text` for the query's terms alone (a term or its plural; the length counts every
        word piece): all that scoring against that query reads, in memory bounded by the query, and counted at
        C speed (a tool response's records may hold millions of words)."""
        pieces = _PIECE.findall(text)
        seen = Counter(map(str.lower, pieces))
        counts = {}
        for term in query:
            n = seen.get(term, 0) + seen.get(term + "s", 0)
            if n:
                counts[term] = n
        return cls(frozenset(counts), counts, len(pieces))

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


def scores(docs: list[Doc], query: Iterable[str]) -> list[float]:
    """The same BM25 as `Index(docs).scores(query)`, without building the index: one set intersection per doc (at
    C speed), so a list of docs scored once costs less this way than indexed."""
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
    out = [0.0] * n
    for i, common in enumerate(shared):
        if common:
            doc = docs[i]
            norm = K1 * (1.0 - B + B * doc.length / mean)
            out[i] = sum(idf[t] * doc.counts[t] * (K1 + 1.0) / (doc.counts[t] + norm) for t in common)
    return out
