"""The checker's shortcut for complete answers (`conformance.nothing_to_check`): it may skip the decode only
where the full check finds nothing. Every broken shape the fake upstream can give a complete answer, with
tools offered and without, with calls and without: a skipped answer is one `check` passes."""

from __future__ import annotations

import copy
import itertools

import msgspec
import pytest

from tests.fake_upstream import break_completion, break_response, completion, response_object
from toolquake.proxy.server import conformance

CHAT_SHAPES = ["no-id", "no-type", "no-name", "args-invalid", "empty-args", "args-object", "finish-stop",
               "finish-tool-calls"]
RESPONSES_SHAPES = ["no-id", "no-name", "args-invalid", "empty-args"]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
ANSWERS = [{"text": "Hello."}, {"text": '<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>'},
           {"text": "[lookup(q='x')]"}, {"calls": [{"name": "lookup", "arguments": {"q": "x"}}]},
           {"calls": [{"name": "other", "arguments": {}}]}, {"text": "caf\u00e9 \\u0074ool_calls"}]
REQUESTS = [{"model": "m", "messages": []}, {"model": "m", "messages": [], "tools": [TOOL]},
            {"model": "m", "messages": [], "tools": [TOOL], "tool_choice": "none"},
            {"model": "m", "input": "hi", "tools": [{"type": "function", **TOOL["function"]}]}]


def _cases():
    for answer, request in itertools.product(ANSWERS, REQUESTS):
        for shapes in [set(), *({s} for s in CHAT_SHAPES)]:
            yield "chat_completions", break_completion(completion(copy.deepcopy(answer), "m", "1"), shapes, False), \
                request
        for shapes in [set(), *({s} for s in RESPONSES_SHAPES)]:
            yield "responses", break_response(response_object(copy.deepcopy(answer), "m", "1"), shapes), request


CASES = list(_cases())


@pytest.mark.parametrize("encoder", ["compact", "ascii"])
def test_a_skipped_answer_is_one_the_full_check_passes(encoder):
    skipped = flagged = 0
    for route, answer, request in CASES:
        raw = msgspec.json.encode(answer)
        if encoder == "ascii":  # every non-ASCII character escaped: keys and values spelled with \\u
            import json

            raw = json.dumps(answer, ensure_ascii=True).encode()
        offered = conformance.Offered.from_raw(msgspec.json.encode(request))
        assert offered.tools == conformance.Offered.from_request(request).tools
        full = conformance.check(route, False, msgspec.json.decode(raw), offered)
        if conformance.nothing_to_check(route, raw, offered):
            assert full == [], (route, answer, request)
            skipped += 1
        flagged += bool(full)
    assert skipped and flagged  # both sides of the shortcut were exercised


def test_offered_from_raw_agrees_with_the_decoded_request_on_odd_bodies():
    for raw in [b"[1, 2]", b"{not json", b'{"tools": [1, {"type": "x"}], "tool_choice": "none"}',
                b'{"tools": [{"function": {"name": "f", "parameters": 4}}]}', b'"text"', b"\xff\xfe",
                b'{"tools": 3}', b'{"tools": null, "tool_choice": "auto"}', b'{"tools": {"a": 1}}', b"{}",
                b'{"tools": [{"type": "function", "function": {"name": "g"}}], "tool_choice": "required"}']:
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
            body = None
        a, b = conformance.Offered.from_raw(raw), conformance.Offered.from_request(body)
        assert (a.tools, a.tool_choice) == (b.tools, b.tool_choice), raw


def test_offered_tools_cached_by_their_bytes_stay_each_requests_own():
    """The same tools' bytes in two requests give equal tools (the cache), different tools their own, and a
    request's tool_choice is its own even when its tools came from the cache."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    seen = []
    for tools, choice in [([tool], "auto"), ([tool], "none"), ([other], None), ([tool, other], "required"),
                          ([tool], None)]:
        raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                   **({"tool_choice": choice} if choice else {})})
        got = conformance.Offered.from_raw(raw)
        want = conformance.Offered.from_request(msgspec.json.decode(raw))
        assert (got.tools, got.tool_choice) == (want.tools, want.tool_choice)
        seen.append(sorted(got.tools))
    assert seen == [["f"], ["f"], ["g"], ["f", "g"], ["f"]]
