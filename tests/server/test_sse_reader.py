"""The one SSE reader every stream the proxy reads goes through (proxy/server/streaming.py): the JSON objects of a
stream, whatever way its bytes were split, with data that is not an object left out."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tests.support.server import LOADED_MACHINE
from toolquake.proxy.server.responses import assemble_events
from toolquake.proxy.server.streaming import SSEParser, decode_event, read_events

EVENTS = [{"type": "response.created", "response": {"id": "r1", "output": []}},
          {"type": "response.output_text.delta", "delta": "Hel"},
          {"type": "response.output_text.delta", "delta": "lo"},
          {"type": "response.completed", "response": {"id": "r1", "output": [], "status": "completed"}}]


def _body(crlf: bool = False) -> bytes:
    frames = [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in EVENTS]
    frames.insert(2, "data: not json\n\n")
    frames.insert(3, "data: [1, 2]\n\n")
    frames.insert(1, ": a comment\n\n")
    text = "".join(frames)
    return (text.replace("\n", "\r\n") if crlf else text).encode()


def test_a_whole_body_reads_as_its_json_objects_in_order():
    assert list(read_events(_body())) == EVENTS
    assert list(read_events(_body(crlf=True))) == EVENTS


@LOADED_MACHINE
@given(st.lists(st.integers(min_value=0, max_value=len(_body(crlf=True))), max_size=12), st.booleans())
def test_the_same_objects_come_out_however_the_bytes_are_split(cuts, crlf):
    body = _body(crlf)
    bounds = [0, *sorted(cuts), len(body)]
    parser, got = SSEParser(), []
    pieces = [body[a:b] for a, b in zip(bounds, bounds[1:])]
    for n, piece in enumerate(pieces):
        got += parser.events(piece, end=n == len(pieces) - 1)
    assert got == EVENTS


def test_an_event_without_its_blank_line_is_read_when_the_stream_ends():
    body = _body()[:-2]  # the final event's blank line cut off
    parser = SSEParser()
    assert list(parser.events(body)) == EVENTS[:-1]
    assert list(parser.events(b"", end=True)) == EVENTS[-1:]


def test_data_that_is_not_an_object_is_none():
    assert decode_event(b'{"a": 1}') == {"a": 1}
    for payload in (b"[DONE]", b"[1]", b'"x"', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
        assert decode_event(payload) is None


def test_the_responses_assembler_reads_through_it():
    assert assemble_events(_body()) == EVENTS[-1]["response"]
