"""Scanners over model output in linear time (#28): adversarial answers neither raise nor stall.

A model's answer is attacker-influenced (a prompt can make it echo anything). Every finder of calls left
in text, the conformance check of a whole answer, the call-format decoders, BFCL's decoder and the SSE
reader get adversarial strings at 64 KiB (and the proxy's own checks at their 20 KB cap): none raises, and
each stays under a per-KiB time bound wide enough for a loaded machine. The old scanners were quadratic
(`{` repeated 64 KiB: seconds in the JSON finder; `<TOOLCALL>` repeated: 5 s in BFCL's decoder).
"""

from __future__ import annotations

import json
import random
import time

import pytest

from toolquake.bfcl.decode import decode_python
from toolquake.perturbers.helpers import callformat_parse as cp
from toolquake.perturbers.helpers.callformats import RETURN_FORMATS
from toolquake.proxy.server.conformance import Offered, check, content, repair_answer
from toolquake.proxy.server.streaming import SSEParser, assemble_sse

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "a": {}}
OFFERED = Offered(TOOLS)
#: repeated, each of these made one scanner or another quadratic (or raise RecursionError)
PIECES = ["<tool_call>", "<tool_call>{", "[a(", "[get_weather(", "[a(x=1), ", "{", "[", "[{", '{"', '["', '{"a":',
          "[1,", "```", '"', "<a ", '<a b="', " ", "\n", "<TOOLCALL>", "<functions>", "<function>", "}]", "\\",
          "\u202e\x00", "\x01", "(", "get_weather(", "</think>", '"""', "[get_weather(city='x')", "1,000"]
KIB = 1024
#: ms per KiB of input: the linear scanners take 0.1-10 here (10: parse_live decoding 7,000 real calls); the
#: quadratic ones took 30-90 at 64 KiB, and grow with the size
MS_PER_KIB = 20.0


def _text(piece: str, size: int, tail: str = "") -> str:
    return (piece * (size // len(piece) + 1))[:size - len(tail)] + tail


def _ms_per_kib(fn, text: str) -> float:
    t0 = time.process_time()
    fn(text)
    return (time.process_time() - t0) * 1000 / (len(text) / KIB)


def _chat(text: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def _responses(text: str) -> dict:
    return {"output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def _sse(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


ENTRY_POINTS = {
    "hermes": lambda s: content.hermes(s, TOOLS),
    "pythonic": lambda s: content.pythonic(s, TOOLS),
    "json_objects": lambda s: content.json_objects(s, TOOLS),
    "decode_python": decode_python,
    "decode_python_tagged": lambda s: decode_python(s, True),
    "sse_reader": lambda s: assemble_sse(s.encode("utf-8", "surrogatepass")),
    "sse_reader_chunked": lambda s: [SSEParser().feed(c) for c in [s.encode()[i:i + 512]
                                                                   for i in range(0, len(s.encode()), 512)]],
}
for _fmt in RETURN_FORMATS:
    for _tag in (False, True):
        ENTRY_POINTS[f"parse_strict_{_fmt}_{_tag}"] = lambda s, f=_fmt, t=_tag: cp.parse_strict(s, f, t)
        ENTRY_POINTS[f"parse_lenient_{_fmt}_{_tag}"] = lambda s, f=_fmt, t=_tag: cp.parse_lenient(s, f, t)
        ENTRY_POINTS[f"parse_live_{_fmt}_{_tag}"] = lambda s, f=_fmt, t=_tag: cp.parse_live(
            s, f, t, {"get_weather": "get_weather", "a": "a"}, {"get_weather": {"city": {"type": "string"}}})
#: the proxy's checks on a whole answer (the text finders search up to content.MAX_TEXT characters)
CHECKS = {
    "check_chat": lambda s: check("chat_completions", False, _chat(s), OFFERED),
    "check_chat_stream": lambda s: check("chat_completions", True, _sse(s), OFFERED),
    "check_responses": lambda s: check("responses", False, _responses(s), OFFERED),
    "repair": lambda s: repair_answer(_chat(s), OFFERED),
    "find_calls": lambda s: content.find_calls(s, TOOLS),
}


#: what may follow the hostile run (closers that make a finder try to match back to an opener)
TAILS = ("", "x", "]", "}", "</TOOLCALL>", "</tool_call>")


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("piece", PIECES)
def test_model_output_scanners_are_linear_and_never_raise(name: str, piece: str) -> None:
    """Two tails per entry point and piece, drawn by a generator seeded with both (it was hypothesis with
    max_examples=2: over ~1,200 parametrized items its settings look-ups hit the recursion limit in a full run)."""
    fn = ENTRY_POINTS[name]
    for tail in random.Random(f"{name}|{piece}").sample(TAILS, 2):
        text = _text(piece, 64 * KIB, tail)
        fn(text[:4 * KIB])  # warm: imports, compiled patterns
        cost = _ms_per_kib(fn, text)
        assert cost < MS_PER_KIB, f"{name} on {piece!r}*n+{tail!r}: {cost:.1f} ms/KiB at 64 KiB"


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.parametrize("piece", PIECES)
def test_proxy_checks_on_a_hostile_answer_stay_fast(name: str, piece: str) -> None:
    """At the finders' cap (20 KB), the whole check of one answer: no exception, and well under a second."""
    text = _text(piece, content.MAX_TEXT)
    cost = _ms_per_kib(CHECKS[name], text)
    assert cost < MS_PER_KIB, f"{name} on {piece!r}*n: {cost:.1f} ms/KiB"


@pytest.mark.parametrize("opener", ["[", "{", '{"a":', "[1,"])
def test_deep_nesting_is_no_call_and_raises_nothing(opener: str) -> None:
    """Nesting past json's and msgspec's recursion limits (an answer, a call's arguments, a stream chunk)."""
    deep = opener * 5000
    args = {"choices": [{"message": {"tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": deep}}]}, "finish_reason": "tool_calls"}]}
    rules = {v.rule for v in check("chat_completions", False, args, OFFERED)}
    assert "arguments_invalid_json" in rules
    assert check("chat_completions", False, _chat(deep[:content.MAX_TEXT]), OFFERED) == []
    stream = b"data: " + deep.encode() + b"\n\ndata: [DONE]\n\n"
    assert {v.rule for v in check("chat_completions", True, stream, OFFERED)} >= {"chunk_invalid_json"}
    assert content.json_objects(deep, TOOLS) is None


def test_a_call_after_hostile_text_is_still_found() -> None:
    """Linear scanning keeps the answers it found: a real call behind 16 KB of openings."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for junk in ("{" * 16000, "[" * 16000, '{"' * 8000, "[a(" * 5000):
        found = content.find_calls(junk + " " + call, TOOLS)
        assert found is not None and found.calls == [("get_weather", {"city": "Paris"})], junk[:4]
    nested = '[{"x": ' + call + "}]"
    found = content.json_objects("see " + nested, TOOLS)
    assert found is not None and ("see " + nested)[found.start:found.end] == call


XML_ENTRY_POINTS = sorted(n for n in ENTRY_POINTS if n.startswith("parse_") and "xml" in n)


@pytest.mark.parametrize("name", XML_ENTRY_POINTS)
@pytest.mark.parametrize("space", ["\t", "\x0b", "\u3000"], ids=["tab", "vtab", "ideographic"])
@pytest.mark.parametrize("shape", ["one_tag", "many_tags"])
def test_xml_tag_finder_on_an_open_tag_and_long_whitespace(name: str, space: str, shape: str) -> None:
    """`<a` and a long whitespace run with no `>`: the tag regex of the XML repair (lenient/live parsing) tried
    every split of the run (16 KiB of tabs: 8-16 s); the scanner reads it once. Spaces and newlines are stripped
    before XML parsing, other whitespace is not."""
    fn = ENTRY_POINTS[name]
    size = 32 * KIB
    text = "<functions>" + ("<a" + space * size if shape == "one_tag" else ("<a" + space * 500) * (size // 500))
    fn(text[:2 * KIB])
    cost = _ms_per_kib(fn, text)
    assert cost < MS_PER_KIB, f"{name} on <a + {space!r}*n ({shape}): {cost:.1f} ms/KiB at 32 KiB"


def test_xml_repair_still_closes_what_a_model_left_open() -> None:
    """The tag scanner keeps the repair's answers: attributes after whitespace of other kinds, spaces around `=`,
    self-closing tags, an unclosed `<params>`/`<function>`/`<functions>`; an element that is not one of those
    left open is still an error."""
    text = ('<functions><function\tname="get_weather"><params>\u3000<param name="city"\tvalue="Paris" '
            'type="string"/><param name = "days" value="3" type="integer"/>')
    found = cp.parse_lenient(text, "verbose_xml", False)
    assert found.ok and found.calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    assert found.leniencies == ("unclosed_tag",)
    fired: list[str] = []
    repaired = cp._close_tags('<functions><function name="f"><params><x\t/></params>', fired)
    assert repaired == '<functions><function name="f"><params><x\t/></params></function></functions>'
    assert fired == ["unclosed_tag"]
    with pytest.raises(cp.DecodeError, match="<value> is never closed"):
        cp._close_tags("<functions><value a='>'>1</functions>", [])
