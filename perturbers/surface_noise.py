"""surface_noise: typos, whitespace, punctuation and casing slips in the last user message, never in values."""

from __future__ import annotations

import re
from typing import Any, Callable, ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber
from toolquake.perturbers.helpers.protected import protected_spans

_ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")
# neighbours on a QWERTY keyboard (same row, and the keys above and below)
NEIGHBOURS: dict[str, str] = {}
for _r, _row in enumerate(_ROWS):
    for _c, _key in enumerate(_row):
        near = {_row[j] for j in (_c - 1, _c + 1) if 0 <= j < len(_row)}
        for _other in (_r - 1, _r + 1):
            if 0 <= _other < len(_ROWS):
                near |= {_ROWS[_other][j] for j in (_c - 1, _c, _c + 1) if 0 <= j < len(_ROWS[_other])}
        NEIGHBOURS[_key] = "".join(sorted(near))
_WORD = re.compile(r"[A-Za-z]{2,}")
_PUNCT = re.compile(r"[,;:!?.](?=\s|$)")
#: characters of a message that get slips: a longer message keeps the rest as it is, from the last line break or
#: space before this point on (finding the protected spans is linear, but runs on the event loop)
MAX_NOISY_CHARS = 64 * 1024
#: a longer text is noised a slice at a time (cut at a line break, else a space, else after a word), so that no
#: single scan holds the interpreter long: the event loop runs in between. Normal messages are one slice.
NOISY_SLICE = 4 * 1024
_AFTER_WORD = re.compile(r"\W")


def _neighbour_key(w: str, rng: Any) -> str:
    i = rng.randrange(len(w))
    c = w[i]
    near = NEIGHBOURS.get(c.lower())
    if not near:
        return w
    sub = rng.choice(near)
    return w[:i] + (sub.upper() if c.isupper() else sub) + w[i + 1:]


def _swap(w: str, rng: Any) -> str:
    i = rng.randrange(len(w) - 1)
    return w[:i] + w[i + 1] + w[i] + w[i + 2:]


def _double(w: str, rng: Any) -> str:
    i = rng.randrange(len(w))
    return w[:i + 1] + w[i] + w[i + 1:]


def _drop(w: str, rng: Any) -> str:
    if len(w) < 3:
        return w
    i = rng.randrange(len(w))
    return w[:i] + w[i + 1:]


def _case(w: str, rng: Any) -> str:
    return w.lower() if w[0].isupper() else (w.capitalize() if rng.random() < 0.7 else w.upper())


# the word-level slips, with how often each one is chosen
WORD_EDITS: tuple[tuple[str, Callable[[str, Any], str], int], ...] = (
    ("neighbour_key", _neighbour_key, 3), ("swap", _swap, 3), ("double", _double, 2), ("drop", _drop, 2),
    ("case", _case, 1),
)


@register
class SurfaceNoise(Perturber):
    """Each free word of the last user message gets one slip with probability `rate`; so does each gap and
    punctuation mark."""

    name = "surface_noise"
    #: in a worker thread: a long message's scans run there, not on the event loop (each C-level scan of its
    #: first `MAX_NOISY_CHARS` is short, so the loop gets the interpreter back in between)
    blocking: ClassVar[bool] = True
    rate: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("rate must be between 0 and 1")

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        index = request.last_user_index()
        content = request.messages[index].get("content") if index is not None else None
        if not isinstance(content, str) or not content.strip():
            ctx.report.update(edits=0, reason="no text in the last user message")
            return request
        noisy, edits = noisify(content, self.rate, ctx.rng)
        counter = ctx.services.token_counter
        ctx.report.update(edits=sum(edits.values()), kinds=edits)
        if counter is not None:
            ctx.report["tokens_added"] = counter.count_text(noisy) - counter.count_text(content)
        if noisy == content:
            return request
        messages = list(request.messages)
        messages[index] = {**messages[index], "content": noisy}
        return request.replace(messages=messages)


def noisify(text: str, rate: float, rng: Any) -> tuple[str, dict[str, int]]:
    """`text` with slips outside its protected spans (in its first `MAX_NOISY_CHARS` characters); also the count of
    each kind of slip."""
    if len(text) > MAX_NOISY_CHARS:
        cut = max(text.rfind("\n", 0, MAX_NOISY_CHARS), text.rfind(" ", 0, MAX_NOISY_CHARS)) + 1 or MAX_NOISY_CHARS
        head, edits = noisify(text[:cut], rate, rng)
        return head + text[cut:], edits
    edits: dict[str, int] = {}
    out: list[str] = []
    start = 0
    while len(text) - start > NOISY_SLICE:
        cut = text.rfind("\n", start, start + NOISY_SLICE) + 1 or text.rfind(" ", start, start + NOISY_SLICE) + 1
        if cut <= start:
            after = _AFTER_WORD.search(text, start + NOISY_SLICE)
            cut = after.end() if after else len(text)
        out.append(_noisify_slice(text[start:cut], rate, rng, edits))
        start = cut
    out.append(_noisify_slice(text[start:], rate, rng, edits))
    return "".join(out), edits


def _noisify_slice(text: str, rate: float, rng: Any, edits: dict[str, int]) -> str:
    out: list[str] = []
    pos = 0
    for start, end in protected_spans(text) + [(len(text), len(text))]:
        out.append(_noisy_free(text[pos:start], rate, rng, edits))
        out.append(text[start:end])
        pos = end
    return "".join(out)


def _noisy_free(chunk: str, rate: float, rng: Any, edits: dict[str, int]) -> str:
    if not chunk or rate <= 0:
        return chunk
    kinds, weights = [k for k, _, _ in WORD_EDITS], [w for _, _, w in WORD_EDITS]
    funcs = {k: f for k, f, _ in WORD_EDITS}
    pieces: list[str] = []
    last = 0
    for m in _WORD.finditer(chunk):
        pieces.append(_noisy_gap(chunk[last : m.start()], rate, rng, edits))
        word = m.group()
        if rng.random() < rate:
            kind = rng.choices(kinds, weights)[0]
            changed = funcs[kind](word, rng)
            if changed != word:
                edits[kind] = edits.get(kind, 0) + 1
                word = changed
        pieces.append(word)
        last = m.end()
    pieces.append(_noisy_gap(chunk[last:], rate, rng, edits))
    return "".join(pieces)


def _noisy_gap(gap: str, rate: float, rng: Any, edits: dict[str, int]) -> str:
    """Whitespace and punctuation between words: a doubled space, a dropped or doubled mark."""
    if not gap:
        return gap
    if gap.isspace() and rng.random() < rate / 2:
        edits["whitespace"] = edits.get("whitespace", 0) + 1
        return gap + " "
    m = _PUNCT.search(gap)
    if m and rng.random() < rate:
        edits["punctuation"] = edits.get("punctuation", 0) + 1
        mark = m.group()
        replacement = "" if rng.random() < 0.6 else mark * 2
        return gap[: m.start()] + replacement + gap[m.end() :]
    return gap
