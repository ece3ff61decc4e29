"""One parser of Python call syntax (`toolquake.bfcl.pycall`) behind every reader (#30): over every ground truth of
the BFCL corpus, written as a model writes it, BFCL's decoder, format rewriting (strict, one call per line without
brackets, calls inside prose) and the conformance check of calls left in an answer's text each give back the
ground truth's calls, values and their types included."""

from __future__ import annotations

import re

import pytest

from tests.support.callformats import all_ground_truths, python_can_write
from toolquake.bfcl.decode import decode_python
from toolquake.perturbers.helpers.callformat_parse import parse_lenient, parse_live, parse_strict
from toolquake.perturbers.helpers.callformat_render import python_call
from toolquake.proxy.server.conformance import content

pytestmark = pytest.mark.needs_corpus

#: a name the conformance finder looks for after `[` (a Python dotted name)
_DOTTED = re.compile(r"[A-Za-z_][\w.]*")


def _literal_only(calls: list[dict]) -> bool:
    """Values `ast.literal_eval` reads back as written (`nan` and `inf` are names in call syntax)."""
    return all(not (isinstance(v, float) and v != v or v in (float("inf"), float("-inf"))) for v in _leaves(calls))


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_every_reader_of_call_syntax_gives_back_every_ground_truth() -> None:
    seen = {"decode": 0, "statements": 0, "prose": 0, "conformance": 0}
    for case, calls in all_ground_truths():
        if not python_can_write(calls):
            continue
        want = repr(calls)
        written = [python_call(c) for c in calls]
        bracketed = "[" + ", ".join(written) + "]"
        where = f"{case.id}: {bracketed[:300]}"
        assert repr(decode_python(bracketed)) == want, where
        strict = parse_strict(f"<TOOLCALL>{bracketed}</TOOLCALL>", "python", True)
        assert strict.ok and repr(strict.calls) == want, where
        seen["decode"] += 1
        if len(calls) > 1:
            lines = parse_lenient("\n".join(written), "python")
            assert repr(lines.calls) == want and "python_no_brackets" in lines.leniencies, where
            seen["statements"] += 1
        offered = {c["name"]: c["name"] for c in calls}
        prose = parse_live("Let me look.\n" + " and then ".join(written) + "\nDone.", "python", False, offered)
        assert repr(prose.calls) == want, where
        seen["prose"] += 1
        if all(_DOTTED.fullmatch(c["name"]) for c in calls) and bracketed.count("]") <= 64 and _literal_only(calls):
            found = content.pythonic(f"Sure: {bracketed} is what I would call.", offered)
            assert found is not None and repr(found.calls) == repr([(c["name"], c["arguments"]) for c in calls]), where
            seen["conformance"] += 1
    assert seen["decode"] > 5000 and seen["statements"] > 1000 and seen["conformance"] > 5000, seen
