"""Near-twins: tools that do the same job as another tool under a different name or wording.

Seed 001 (appendix 7.3) filters a generated tool out when its signature embedding is too close to an
original's; one cosine lets twins through (`find_roots(a, b, c)` beside `math_roots_quadratic(a, b, c)`,
`translate_sent(orig_language, target_language, sentence)` beside `sentence.translate(sentence, from, to)`).
A candidate is a twin of an original when, besides that cosine, both hold:

- **signature overlap**: the parameters of each can be filled from the other's, matched one to one by
  type (integer and number count as one type): the share of required parameters (all of them when none is
  required) that find a partner, the smaller of the two directions;
- **same job**: the cosine of their job texts (name words and description) or of their descriptions alone
  (BFCL's note on the language cut from both), or the overlap of their name words, is high.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolquake.bfcl.embeddings import Embedder

# the head of BFCL's note "Note that the provided function is in <language>." with the space before it; started
# only where a run of spaces starts, so a long run is not rescanned from each of its positions (linear time)
_NOTE_HEAD = re.compile(r"(?<!\s)\s*+Note that the provided function is in ", re.IGNORECASE)
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
#: characters of a tool name compared (OpenAI allows 64; the longest BFCL name is far shorter)
MAX_NAME = 256
_FAMILY = {"integer": "number", "number": "number", "float": "number", "int": "number", "string": "string",
           "boolean": "boolean", "array": "array", "tuple": "array", "object": "object", "dict": "object"}


@dataclass(frozen=True)
class Twin:
    """Thresholds of the twin test (see the module docstring)."""

    #: signature overlap at or above which the job decides
    overlap: float = 0.6
    #: job-text cosine at or above which two overlapping tools do the same job
    job: float = 0.6
    #: name-word Jaccard at or above which two overlapping tools do the same job
    name: float = 0.5


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else (tool if isinstance(tool, dict) else {})


def _name(tool: dict[str, Any]) -> str:
    """A tool's name, at most `MAX_NAME` characters of it (a client may send any length; the comparisons run once
    per pair of tools, so a 512 KiB name cost seconds)."""
    return str(_function(tool).get("name", ""))[:MAX_NAME]


def name_words(tool: dict[str, Any]) -> set[str]:
    """The words of a tool's name, lower case, a plural's final s dropped."""
    words = {w.lower() for w in _WORD.findall(_name(tool))}
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w for w in words}


def description(tool: dict[str, Any]) -> str:
    """A tool's description, BFCL's language note removed."""
    return _without_notes(str(_function(tool).get("description") or "")).strip()


def _without_notes(text: str) -> str:
    """`text` without BFCL's language notes (each from its head to the next full stop), in linear time."""
    kept: list[str] = []
    pos = 0
    while (m := _NOTE_HEAD.search(text, pos)) is not None:
        stop = text.find(".", m.end())
        if stop < 0:  # no full stop after this head, so none after any later head either
            break
        kept.append(text[pos:m.start()])
        pos = stop + 1
    kept.append(text[pos:])
    return "".join(kept)


def job_text(tool: dict[str, Any]) -> str:
    """What a tool does, in words: its name's words and its description."""
    words = " ".join(w.lower() for w in _WORD.findall(_name(tool)))
    return f"{words}. {description(tool)}"


def job_similarity(a: list[dict[str, Any]], b: list[dict[str, Any]], embedder: Embedder) -> Any:
    """(len(a), len(b)) array: the larger of the job texts' cosine and the descriptions' cosine."""
    import numpy as np

    jobs = embedder.embed([job_text(t) for t in a]) @ embedder.embed([job_text(t) for t in b]).T
    descs = embedder.embed([description(t) for t in a]) @ embedder.embed([description(t) for t in b]).T
    return np.maximum(jobs, descs)


def _params(tool: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(type family of every parameter, type family of the required ones; all of them when none is)."""
    params = _function(tool).get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return [], []
    required = [r for r in (params.get("required") or []) if r in props]
    fam = {k: _FAMILY.get(str(v.get("type") if isinstance(v, dict) else ""), "other") for k, v in props.items()}
    needed = required or list(props)
    return list(fam.values()), [fam[k] for k in needed]


def _coverage(needed: list[str], offered: list[str]) -> float:
    """Share of `needed` parameters that find a distinct partner of the same type family in `offered`."""
    if not needed:
        return 1.0
    left = Counter(offered)
    hit = 0
    for family in needed:
        if left[family] > 0:
            left[family] -= 1
            hit += 1
    return hit / len(needed)


def signature_overlap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far each tool's required parameters can be filled from the other's (the smaller direction)."""
    all_a, need_a = _params(a)
    all_b, need_b = _params(b)
    if not all_a and not all_b:
        return 1.0
    return min(_coverage(need_a, all_b), _coverage(need_b, all_a))


def name_similarity(a: dict[str, Any], b: dict[str, Any]) -> float:
    wa, wb = name_words(a), name_words(b)
    return len(wa & wb) / len(wa | wb) if wa and wb else 0.0


def twin_flags(candidates: list[dict[str, Any]], originals: list[dict[str, Any]], embedder: Embedder,
               rule: Twin = Twin()) -> list[bool]:
    """For each candidate: does it do the same job as one of the originals?"""
    import numpy as np

    if not candidates or not originals:
        return [False] * len(candidates)
    overlap = np.array([[signature_overlap(c, o) for o in originals] for c in candidates])
    names = np.array([[name_similarity(c, o) for o in originals] for c in candidates])
    flags = (overlap >= rule.overlap) & (names >= rule.name)
    todo = [i for i in range(len(candidates)) if not flags[i].any() and (overlap[i] >= rule.overlap).any()]
    if todo:  # only candidates whose signatures overlap need their job embedded
        jobs = job_similarity([candidates[i] for i in todo], originals, embedder)
        for row, i in enumerate(todo):
            flags[i] |= (overlap[i] >= rule.overlap) & (jobs[row] >= rule.job)
    return [bool(f.any()) for f in flags]
