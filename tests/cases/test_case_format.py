"""The user-case format: `toolquake cases validate` names every bad line, the shipped JSON Schema agrees
with the loader, and the BFCL checker grades user cases with BFCL's possible-answer rules."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.support.cases import TIME, WEATHER, toolquake


def case(**fields):
    base = {"id": "c", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME],
            "expected": [{"name": "get_weather", "arguments": {"city": ["Paris"], "unit": ["celsius", ""]}}]}
    return {**base, **fields}


GOOD = [
    case(id="one-call"),
    case(id="no-call", expected="no call", category="smalltalk", tags=["chat"]),
    case(id="parallel", expected=[{"name": "get_time", "arguments": {"tz": ["UTC"]}},
                                  {"name": "get_weather", "arguments": {"city": ["Oslo"]}}]),
    case(id="ordered", order="fixed", expected=[{"name": "get_time", "arguments": {"tz": ["UTC"]}},
                                                {"name": "get_weather", "arguments": {"city": ["Oslo"]}}]),
    # Responses-shaped: input and instructions, tools with a top-level name
    {"id": "responses", "instructions": "Be brief.", "input": [{"role": "user", "content": "Time in Tokyo?"}],
     "tools": [{"type": "function", "name": "get_time", "parameters": TIME["function"]["parameters"]}],
     "expected": [{"name": "get_time", "arguments": {"tz": ["Asia/Tokyo"]}}]},
]
#: (line, the words the reason must contain); each is bad for one reason
BAD = [
    ("{not json", "not JSON"),
    (json.dumps(case(id="c-no-user", messages=[{"role": "system", "content": "x"}])), "no user message"),
    (json.dumps(case(id="c-unknown-tool", expected=[{"name": "book_flight", "arguments": {}}])),
     "'book_flight' is not one of the case's tools"),
    (json.dumps(case(id="c-scalar", expected=[{"name": "get_weather", "arguments": {"city": "Paris"}}])),
     "'city' must be a non-empty list"),
    (json.dumps(case(id="c-required", expected=[{"name": "get_weather", "arguments": {"unit": ["celsius"]}}])),
     "required parameter 'city'"),
    (json.dumps(case(id="c-param", expected=[{"name": "get_weather", "arguments": {"town": ["Paris"]}}])),
     "'town' is not a parameter of get_weather"),
    (json.dumps(case(id="c-empty", expected=[])), "must be \"no call\" or a non-empty list"),
    (json.dumps(case(id="c-order", order="sorted")), "'order' must be one of free, fixed"),
    (json.dumps(case(id="c-bfcl-cat", category="multiple")), "is a BFCL category"),
    (json.dumps(case(id="c-typo", expectd="no call")), "unknown key(s) expectd"),
    (json.dumps({k: v for k, v in case(id="c-no-expected").items() if k != "expected"}), "missing 'expected'"),
    (json.dumps(case(id="one-call")), "duplicate id 'one-call'"),
]


@pytest.fixture
def mixed_file(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """Good and bad lines interleaved; returns the file and {line number: expected reason}."""
    lines, bad_at = [], {}
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            lines.append(json.dumps(GOOD[i]))
        if i < len(BAD):
            lines.append(BAD[i][0])
            bad_at[len(lines)] = BAD[i][1]
        lines.append("")  # blank lines are allowed and keep their numbers
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, bad_at


@pytest.mark.processes
def test_validate_names_every_bad_line_with_its_reason_and_exits_non_zero(mixed_file):
    path, bad_at = mixed_file
    r = toolquake("cases", "validate", str(path))
    assert r.returncode == 1, r.stderr
    reported = {}
    for line in r.stdout.splitlines():
        where, _, reason = line.partition(": ")
        reported[int(where.rsplit(":", 1)[1])] = reason
    assert set(reported) == set(bad_at), r.stdout
    for n, words in bad_at.items():
        assert words in reported[n], (n, reported[n])
    assert f"{len(GOOD)} good case(s), {len(BAD)} bad line(s)" in r.stderr


@pytest.mark.processes
def test_a_good_file_validates_and_a_missing_one_is_an_error(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(c) + "\n" for c in GOOD))
    r = toolquake("cases", "validate", str(good))
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = toolquake("cases", "validate", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "cannot read" in r.stdout


def test_bad_lines_never_stop_the_good_ones(mixed_file):
    from toolquake.proxy.live.usercases import load_file

    path, bad_at = mixed_file
    loaded = load_file(path)
    assert [c.id for c in loaded.cases] == [c["id"] for c in GOOD]
    assert sorted(p.line for p in loaded.problems) == sorted(bad_at)
    by_id = {c.id: c for c in loaded.cases}
    assert by_id["one-call"].category == "mine"  # the file's stem
    assert by_id["no-call"].category == "smalltalk" and by_id["no-call"].extra["tags"] == ["chat"]
    # the Responses-shaped case was converted by the proxy's own conversion
    assert by_id["responses"].extra["request"]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time in Tokyo?"}]
    assert by_id["responses"].extra["request"]["tools"][0]["function"]["name"] == "get_time"


def test_the_shipped_schema_agrees_with_the_loader_on_structure():
    from toolquake.proxy.live.usercases import SCHEMA_PATH, schema

    assert SCHEMA_PATH.is_file() and SCHEMA_PATH.parent.name == "proxy"
    validator = jsonschema.Draft202012Validator(schema())
    validator.check_schema(schema())
    for good in GOOD:
        assert not list(validator.iter_errors(good)), good["id"]
    # what a schema can see (shapes, keys, enums); cross-field rules (tools named, required params) are the loader's
    for line, _ in BAD:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry["id"] in ("c-scalar", "c-empty", "c-order", "c-typo", "c-no-expected"):
            assert list(validator.iter_errors(entry)), entry["id"]


def _graded(entry, calls):
    from toolquake.proxy.live.usercases import parse_line
    from toolquake.scorers.ast_checker import check

    return check(parse_line(entry, "t"), calls)


def test_user_cases_are_graded_with_bfcls_possible_answer_rules():
    one = case(expected=[{"name": "get_weather", "arguments": {
        "city": ["Paris", "Paris, France"], "unit": ["celsius", ""], "days": [3, ""],
        "options": [{"alerts": True}, ""]}}])
    # optional arguments may be left out; strings compare as BFCL normalises them; ints stand for floats
    assert _graded(one, [{"name": "get_weather", "arguments": {"city": "paris"}}]).valid
    assert _graded(one, [{"name": "get_weather", "arguments": {"city": "Paris, France", "days": 3.0,
                                                               "options": {"alerts": True}}}]).valid
    v = _graded(one, [{"name": "get_weather", "arguments": {"city": "Lyon"}}])
    assert not v.valid and v.taxonomy == "wrong_param_value"
    v = _graded(one, [{"name": "get_time", "arguments": {"tz": "CET"}}])
    assert not v.valid and v.taxonomy == "wrong_function"
    v = _graded(one, [{"name": "get_weather", "arguments": {"unit": "celsius"}}])
    assert not v.valid and v.taxonomy == "missing_param"
    v = _graded(one, [{"name": "get_weather", "arguments": {"city": "Paris", "lang": "fr"}}])
    assert not v.valid and v.taxonomy == "unexpected_param"
    from toolquake.bfcl.decode import DecodeFailure
    v = _graded(one, DecodeFailure("the model answered in text, with no tool call"))
    assert not v.valid

    none = case(expected="no call")
    assert _graded(none, []).valid
    v = _graded(none, [{"name": "get_time", "arguments": {"tz": "UTC"}}])
    assert not v.valid and v.taxonomy == "irrelevance_violation"

    calls = [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    expected = [{"name": c["name"], "arguments": {k: [v] for k, v in c["arguments"].items()}} for c in calls]
    free, fixed = case(expected=expected), case(expected=expected, order="fixed")
    assert _graded(free, calls).valid and _graded(free, calls[::-1]).valid
    assert _graded(fixed, calls).valid
    v = _graded(fixed, calls[::-1])
    assert not v.valid and v.taxonomy == "wrong_function"
    v = _graded(fixed, calls[:1])
    assert not v.valid and v.taxonomy == "wrong_count"
