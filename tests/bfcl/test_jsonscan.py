"""The one JSON-in-text scanner (`toolquake.bfcl.jsonscan`, #30): positions and values of the JSON a model left in
its text, as `json.JSONDecoder.raw_decode` would find them at each opening, in linear time."""

from __future__ import annotations

import json
import random
import time

from toolquake.bfcl.jsonscan import JSON_MAX_DEPTH, json_values, nested_spans

TEXT = ('see [1, {"a": "]}["}] and {"b": [2, {"c": 3}]} then {"broken": [1, {"x": 2} oops {"y": 1} '
        '{"big": 1' + "0" * 5000 + "} [NaN, -Infinity]")


def _raw_decode_values(text: str, skip_broken: bool) -> list[tuple[int, int, object]]:
    """What trying `raw_decode` at every opening gives (the quadratic way the scanner replaces)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    for start, ch in enumerate(text):
        if ch not in "[{" or start < i:
            continue
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            if skip_broken:
                i = max(exc.pos, start + 1)
            continue
        except ValueError:  # an integer with more digits than int() takes
            continue
        out.append((start, end, value))
        i = end
    return out


def test_values_and_positions_are_those_raw_decode_finds() -> None:
    for skip_broken in (False, True):
        found = list(json_values(TEXT, skip_broken=skip_broken))
        assert repr(found) == repr(_raw_decode_values(TEXT, skip_broken))
        for start, end, value in found:
            assert json.loads(TEXT[start:end]) == value or value != value
    assert [v for _, _, v in json_values(TEXT)][:4] == [[1, {"a": "]}["}], {"b": [2, {"c": 3}]}, {"x": 2}, {"y": 1}]
    assert {"x": 2} not in [v for _, _, v in json_values(TEXT, skip_broken=True)]  # inside the broken value


def test_random_texts_agree_with_raw_decode() -> None:
    rng = random.Random(7)
    pieces = ["{", "}", "[", "]", '"a"', ":", ",", "1", " ", '"', "\\", "x", "null", '{"k": ', "[1, "]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(30)))
        for skip_broken in (False, True):
            assert repr(list(json_values(text, skip_broken=skip_broken))) == repr(
                _raw_decode_values(text, skip_broken)), text


def test_nested_spans_in_the_order_they_open_not_counting_brackets_in_strings() -> None:
    value = '{"b": [2, {"c": 3}], "s": "[{", "d": []}'
    spans = nested_spans(value)
    assert [value[a:b] for a, b in spans] == [value, '[2, {"c": 3}]', '{"c": 3}', "[]"]
    assert nested_spans('[1, {"a": 2}') == [] and nested_spans("text") == []


def test_hostile_openings_stay_linear_and_depth_is_bounded() -> None:
    for piece in ("{", "[", '{"a": [', '["', "[1,"):
        text = piece * (64 * 1024 // len(piece))
        t0 = time.process_time()
        assert list(json_values(text, skip_broken=True)) == [] and list(json_values(text)) == []
        assert time.process_time() - t0 < 2.0, piece
    deep = "[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1)
    found = list(json_values(deep))  # the outermost value nests too deep: it is not decoded, a value inside it is
    assert found and all(start > 0 for start, _, _ in found)
