"""JSON values in model text, found in linear time: the one JSON-in-text scanner.

Format rewriting (`perturbers/helpers/callformat_parse.py`: JSON calls anywhere in an answer) and the conformance
check of calls left in an answer's text (`proxy/server/conformance/content.py`) find JSON values here.
`json_values(text)` yields each outermost array or object with its position; `nested_spans(value_text)` says
where each value nested in one opens and ends; `JsonSpans` is the scanner under both.

Finding the JSON values a model left in its text by calling `json.JSONDecoder.raw_decode` at every `{`/`[` is
quadratic (each failure builds an error whose line number counts from the text's start, and a value nested in a
broken one is scanned again from each of its openings). `JsonSpans` answers "where does the value that opens
here end" with a scanner that follows `json`'s grammar (strict strings, NaN/Infinity, ASCII numbers) and
remembers every container it has scanned: a container's extent does not depend on what surrounds it, so each
character is scanned about once however many openings are asked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator

_J_WS = re.compile(r"[ \t\n\r]*+")
#: an opening bracket that can start a value (what follows it may come next): the others fail at once
_J_OPENERS = re.compile(r'\{(?=[ \t\n\r]*+["}])|\[(?=[ \t\n\r]*+[-"\[\]{0-9tfnNI])')
#: one token after optional whitespace (its group): 1 an opening bracket, 2 a string, 3 a number or literal,
#: 4 a closing bracket, 5 a comma, 6 a colon
_J_TOKEN = re.compile(r'[ \t\n\r]*+(?:([\[{])|("(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+")|'
                      r"(-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][-+]?[0-9]++)?|true|false|null|NaN|Infinity|"
                      r"-Infinity)|([\]}])|(,)|(:))")
_J_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+')
#: containers nested deeper than this inside one value are not decoded (json's own limit is about 1,000)
JSON_MAX_DEPTH = 200
_FIRST, _VALUE, _KEY, _COLON, _NEXT = range(5)  # what the scanner expects next
_CLOSER = {"[": "]", "{": "}"}


class JsonSpans:
    """`end(start)`: the index just past the JSON array or object that opens at `text[start]`, as
    `json.JSONDecoder().raw_decode(text, start)` would decode it, or -1 where it would fail (or where the
    value nests deeper than JSON_MAX_DEPTH). `fail_at(start)`: where the scan of a failed value stopped."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._end: dict[int, int] = {}
        self._fail: dict[int, int] = {}

    def openers(self, pos: int = 0) -> Any:
        """The positions from `pos` of the `[` and `{` that may open a value, in order (`end` of the others
        is -1)."""
        return (m.start() for m in _J_OPENERS.finditer(self.text, pos))

    def scanned(self) -> list[int]:
        """The starts of the values scanned so far that end, in order (after `end(0)` on a fresh instance whose
        text is one value: that value and every value nested in it, not the brackets inside its strings)."""
        return sorted(k for k, v in self._end.items() if v >= 0)

    def fail_at(self, start: int) -> int:
        """Where the scan of the failed value at `start` stopped (json's error position, near enough)."""
        return self._fail.get(start, start)

    def end(self, start: int) -> int:
        known = self._end.get(start)
        if known is None:
            self._scan(start)
            known = self._end.get(start, -1)
        return known

    def _scan(self, start: int) -> None:
        text, ends, token = self.text, self._end, _J_TOKEN.match
        stack = [start]  # the open containers' starts
        i, state = start + 1, _FIRST
        while True:
            m = token(text, i)
            if m is None:  # a broken string or no token: where json would stop is found below
                break
            kind = m.lastindex
            top = text[stack[-1]]
            if kind == 4:  # a closing bracket: after a value, or right after the opening
                if state not in (_FIRST, _NEXT) or text[m.end() - 1] != _CLOSER[top]:
                    break
                ends[stack.pop()] = i = m.end()
                if not stack:
                    return
                state = _NEXT
            elif state == _NEXT:  # "," then a value (or a key)
                if kind != 5:
                    break
                i, state = m.end(), _KEY if top == "{" else _VALUE
            elif state == _COLON:
                if kind != 6:
                    break
                i, state = m.end(), _VALUE
            elif state == _KEY or (state == _FIRST and top == "{"):
                if kind != 2:
                    break
                i, state = m.end(), _COLON
            elif kind == 1:  # a value that is a container
                at = m.end() - 1
                known = ends.get(at)
                if known is not None and known >= 0:
                    i, state = known, _NEXT
                elif known is not None or len(stack) >= JSON_MAX_DEPTH:
                    i = at
                    break
                else:
                    stack.append(at)
                    i, state = at + 1, _FIRST
            elif kind in (2, 3):
                i, state = m.end(), _NEXT
            else:
                break
        i = _J_WS.match(text, i).end()  # type: ignore[union-attr]
        if m is None and state not in (_NEXT, _COLON) and text.startswith('"', i):
            # a broken string: json names its bad character, or its quote when it is never closed
            bad = _J_STRING_BODY.match(text, i + 1).end()  # type: ignore[union-attr]
            i = bad if bad < len(text) - text.startswith("\\", bad) else i
        for open_at in stack:  # each open value, scanned alone, stops at the same place
            ends[open_at] = -1
            self._fail[open_at] = i


def json_values(text: str, skip_broken: bool = False,
                object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None
                ) -> Iterator[tuple[int, int, Any]]:
    """(start, end, value) of each JSON array or object in `text` that is not inside one yielded before, left to
    right, decoded by `json.loads` (with `object_pairs_hook`). A value that does not decode is not yielded and the
    search goes on at the next opening after its own, one nested in it included; with `skip_broken`, a value that
    breaks off is skipped up to where its scan stopped (json's error position)."""
    spans = JsonSpans(text)
    i = 0
    for start in spans.openers():
        if start < i:
            continue
        end = spans.end(start)
        if end < 0:
            if skip_broken:
                i = max(spans.fail_at(start), start + 1)
            continue
        try:
            value = json.loads(text[start:end], object_pairs_hook=object_pairs_hook)
        except (ValueError, RecursionError):
            continue
        yield start, end, value
        i = end


def nested_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the JSON array or object `text` is and of each one nested in it, in the order they open
    (the brackets inside its strings are not counted); empty when `text` is not one JSON value."""
    spans = JsonSpans(text)
    if spans.end(0) < 0:
        return []
    return [(at, spans.end(at)) for at in spans.scanned()]
