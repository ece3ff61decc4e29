"""Unit tests for the request hot path: SSE parsing/assembly, the perturbation pipeline, header hygiene."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.server import LOADED_MACHINE, Tagger
from toolquake.perturbers import ChatRequest, PerturbContext, Perturber, Services, register
from toolquake.proxy.server.config import PerturberSpec, ProfileSpec
from toolquake.proxy.server.pipeline import PerturbationFailed, perturbation_seed_for, restore, run_profile
from toolquake.proxy.server.profiles import build_profile
from toolquake.proxy.server.streaming import SSEParser, assemble_sse, emit_stream
from toolquake.proxy.server.upstream.base import request_headers, response_headers

# --- stream assembly ---------------------------------------------------------------------------------

CONTENT_PARTS = ["Let me ", "check ", "that."]
CALLS = {0: ("call_a", "get_weather"), 1: ("call_b", "get_time")}
# (tool index, fragment) in arrival order: the two parallel calls' argument fragments interleave
ARG_FRAGMENTS = [(0, '{"ci'), (1, '{"tz": '), (0, 'ty": "Par'), (1, '"UTC"}'), (0, 'is"}')]
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _chunks() -> list[dict]:
    out = [_chunk({"role": "assistant", "content": ""})]
    out += [_chunk({"content": part}) for part in CONTENT_PARTS]
    out += [_chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
            for i, (cid, name) in CALLS.items()]
    out += [_chunk({"tool_calls": [{"index": i, "function": {"arguments": frag}}]}) for i, frag in ARG_FRAGMENTS]
    out.append(_chunk({}, "tool_calls"))
    out.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})
    return out


STREAM = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in _chunks()) + b"data: [DONE]\n\n"


def _payloads(pieces: list[bytes]) -> list[object]:
    parser = SSEParser()
    raw = [p for piece in pieces for p in parser.feed(piece)] + parser.flush()
    return [p if p.strip() == b"[DONE]" else msgspec.json.decode(p) for p in raw]


def test_whole_stream_parses_to_one_payload_per_event():
    assert _payloads([STREAM]) == [*_chunks(), b"[DONE]"]


def test_every_single_split_position_gives_the_same_payloads():
    whole = _payloads([STREAM])
    for i in range(len(STREAM) + 1):
        assert _payloads([STREAM[:i], STREAM[i:]]) == whole, f"split at byte {i}"


@LOADED_MACHINE
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_arbitrary_multi_way_splits_give_the_same_payloads(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    assert _payloads([STREAM[a:b] for a, b in zip(bounds, bounds[1:])]) == _payloads([STREAM])


def test_crlf_line_endings_parse_like_lf():
    assert _payloads([STREAM.replace(b"\n", b"\r\n")]) == _payloads([STREAM])


def test_crlf_stream_split_between_cr_and_lf_gives_the_same_payloads():
    crlf = STREAM.replace(b"\n", b"\r\n")
    whole = _payloads([STREAM])
    for i in range(len(crlf) + 1):
        assert _payloads([crlf[:i], crlf[i:]]) == whole, f"split at byte {i}"


def test_flush_returns_the_last_event_of_a_stream_without_a_final_blank_line():
    parser = SSEParser()
    assert parser.feed(b'data: {"a": 1}\n\ndata: [DONE]') == [b'{"a": 1}']
    assert parser.flush() == [b"[DONE]"] and parser.flush() == []
    assert assemble_sse(STREAM[: STREAM.rindex(b"data: [DONE]")].rstrip(b"\n"))["usage"] == USAGE


def test_interleaved_deltas_assemble_into_one_completion():
    result = assemble_sse(STREAM)
    assert result["object"] == "chat.completion" and result["id"] == "chatcmpl-1" and result["model"] == "m"
    assert result["usage"] == USAGE
    [choice] = result["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] == "".join(CONTENT_PARTS)
    expected_args = {i: "".join(f for j, f in ARG_FRAGMENTS if j == i) for i in CALLS}
    assert [(tc["id"], tc["type"], tc["function"]["name"], tc["function"]["arguments"])
            for tc in message["tool_calls"]] == [(cid, "function", name, expected_args[i])
                                                 for i, (cid, name) in CALLS.items()]


@pytest.mark.parametrize("content", ["Sure, calling both tools now.", None])
def test_emit_then_assemble_round_trips_the_message(content):
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "search", "arguments": json.dumps({"query": "x" * 40, "limit": 5})}},
             {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    response = {"id": "chatcmpl-rt", "object": "chat.completion", "created": 5, "model": "m",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": content, "tool_calls": calls}}],
                "usage": USAGE}
    frames = list(emit_stream(response, args_chunk=8))
    first_args = [tc for f in frames[:-1] for c in msgspec.json.decode(f[6:])["choices"]
                  for tc in c["delta"].get("tool_calls", []) if tc["index"] == 0 and tc["function"].get("arguments")]
    assert len(first_args) == -(-len(calls[0]["function"]["arguments"]) // 8)  # the arguments really were split
    back = assemble_sse(b"".join(frames))
    assert (back["id"], back["model"], back["usage"]) == (response["id"], response["model"], USAGE)
    [choice] = back["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == content
    assert choice["message"]["tool_calls"] == calls


# --- run_profile / restore / perturbation_seed_for ---------------------------------------------------------------

@register
class _Raises(Perturber):
    name = "test_hot_path_raises"

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        raise RuntimeError("boom")


@register
class _AsyncMark(Perturber):
    name = "test_hot_path_async"

    async def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request.replace(async_mark=ctx.rng.random())


@register
class _BlockingThread(Perturber):
    name = "test_hot_path_blocking"
    blocking = True

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request.replace(thread=threading.current_thread().name)


@register
class _BadRestore(Tagger):
    name = "test_hot_path_bad_restore"

    def restore(self, response: dict, ctx: PerturbContext) -> dict:
        raise ValueError("cannot restore")


TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}} for i in range(8)]
REQUEST = ChatRequest({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})


def _profile(*steps: tuple[str, dict, float], strict: bool = False):
    specs = [PerturberSpec(name=n, params=p, probability=pr) for n, p, pr in steps]
    return build_profile("t", ProfileSpec(perturbers=specs, strict=strict))


def _names(request: ChatRequest) -> list[str]:
    return [t["function"]["name"] for t in request.tools]


def test_seed_header_wins_over_body_hash():
    body = REQUEST.encode()
    assert perturbation_seed_for("12345", body) == 12345
    assert perturbation_seed_for("12345", body) != perturbation_seed_for(None, body)


def test_non_integer_seed_header_falls_back_to_a_stable_body_hash():
    body = REQUEST.encode()
    assert (perturbation_seed_for("not-a-number", body) == perturbation_seed_for(None, body)
            == perturbation_seed_for("", body))
    assert perturbation_seed_for(None, body) != perturbation_seed_for(None, body + b" ")


async def test_same_seed_same_perturbation_and_seeds_vary_it():
    profile = _profile(("tool_order", {"mode": "shuffle"}, 1.0))
    first = await run_profile(profile, REQUEST, 7, Services())
    again = await run_profile(profile, REQUEST, 7, Services())
    assert first.changed and _names(first.request) != _names(REQUEST)
    assert _names(first.request) == _names(again.request)
    assert sorted(_names(first.request)) == sorted(_names(REQUEST))
    orders = {tuple(_names((await run_profile(profile, REQUEST, s, Services())).request)) for s in range(10)}
    assert len(orders) > 1
    assert first.applied[0].perturber is profile.steps[0].perturber
    assert first.applied[0].report["order"] == _names(first.request)


async def test_step_with_probability_zero_is_skipped():
    outcome = await run_profile(_profile(("tool_order", {"mode": "reverse"}, 0.0)), REQUEST, 1, Services())
    assert outcome.skipped == ["tool_order"] and outcome.applied == []
    assert outcome.request is REQUEST and not outcome.changed


async def test_failing_perturber_is_skipped_and_later_steps_still_apply():
    profile = _profile(("test_hot_path_raises", {}, 1.0), ("tool_order", {"mode": "reverse"}, 1.0))
    outcome = await run_profile(profile, REQUEST, 1, Services())
    assert outcome.failed == ["test_hot_path_raises"]
    assert [a.name for a in outcome.applied] == ["tool_order"]
    assert outcome.applied[0].perturber is profile.steps[1].perturber
    assert _names(outcome.request) == _names(REQUEST)[::-1] and outcome.changed


async def test_strict_profile_raises_perturbation_failed_naming_the_perturber():
    profile = _profile(("tool_order", {"mode": "reverse"}, 1.0), ("test_hot_path_raises", {}, 1.0), strict=True)
    with pytest.raises(PerturbationFailed) as info:
        await run_profile(profile, REQUEST, 1, Services())
    assert info.value.perturber == "test_hot_path_raises"
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_adding_a_step_does_not_change_what_earlier_steps_do():
    shuffle = ("tool_order", {"mode": "shuffle"}, 1.0)
    alone = await run_profile(_profile(shuffle), REQUEST, 99, Services())
    longer = await run_profile(_profile(shuffle, ("tool_order", {"mode": "reverse"}, 1.0)), REQUEST, 99, Services())
    assert longer.applied[0].report == alone.applied[0].report
    assert _names(longer.request) == _names(alone.request)[::-1]


async def test_a_step_draws_the_same_whatever_earlier_steps_drew():
    shuffle = ("tool_order", {"mode": "shuffle"}, 1.0)
    after_draw = await run_profile(_profile(("test_hot_path_async", {}, 1.0), shuffle), REQUEST, 5, Services())
    after_none = await run_profile(_profile(("test_hot_path_tagger", {}, 1.0), shuffle), REQUEST, 5, Services())
    assert after_draw.applied[1].report["order"] == after_none.applied[1].report["order"]


async def test_async_and_blocking_perturbers_both_apply():
    profile = _profile(("test_hot_path_async", {}, 1.0), ("test_hot_path_blocking", {}, 1.0))
    outcome = await run_profile(profile, REQUEST, 3, Services())
    assert [a.name for a in outcome.applied] == ["test_hot_path_async", "test_hot_path_blocking"]
    assert isinstance(outcome.request.body["async_mark"], float)
    assert outcome.request.body["thread"] != threading.current_thread().name
    assert outcome.request.body["messages"] == REQUEST.body["messages"]


async def test_restore_runs_last_first_and_a_failing_restorer_leaves_the_answer():
    profile = _profile(("test_hot_path_tagger", {"tag": "a"}, 1.0), ("test_hot_path_bad_restore", {}, 1.0),
                       ("test_hot_path_tagger", {"tag": "c"}, 1.0))
    outcome = await run_profile(profile, REQUEST, 1, Services())
    assert outcome.rewrites_response and len(outcome.restorers) == 3
    answer = {"choices": [], "trail": ["upstream"]}
    restored, failed = restore(outcome, answer)
    assert restored["trail"] == ["upstream", "c", "a"]
    assert failed == ["test_hot_path_bad_restore"]
    assert answer == {"choices": [], "trail": ["upstream"]}


# --- header filtering --------------------------------------------------------------------------------

def test_request_headers_keep_only_end_to_end_headers_in_order():
    kept = [("Authorization", "Bearer sk-1"), ("Content-Type", "application/json"), ("OpenAI-Organization", "o"),
            ("X-Custom", "1"), ("X-Custom", "2")]
    dropped = [("Host", "proxy"), ("X-Toolquake-Seed", "1"), ("x-toolquake-profile", "p"), ("X-TOOLQUAKE-CASE", "c"),
               ("Connection", "keep-alive, X-Hop-Only"), ("X-Hop-Only", "v"), ("Keep-Alive", "timeout=5"),
               ("Accept-Encoding", "gzip"), ("Transfer-Encoding", "chunked"), ("TE", "trailers"),
               ("Upgrade", "h2c"), ("Content-Length", "10"), ("Proxy-Authorization", "Basic x")]
    assert request_headers(dropped[:7] + kept[:3] + dropped[7:] + kept[3:]) == kept


@LOADED_MACHINE
@given(st.text(alphabet="abcxyz-", min_size=1, max_size=10), st.lists(st.booleans(), min_size=12, max_size=12))
def test_any_case_of_x_toolquake_prefix_is_dropped(suffix, upper):
    name = "".join(c.upper() if u else c for c, u in zip("x-toolquake-", upper)) + suffix
    assert request_headers([(name, "v"), ("Authorization", "k")]) == [("Authorization", "k")]


def test_response_headers_drop_hop_by_hop_and_join_repeats():
    headers = [("Content-Type", "application/json"), ("Content-Length", "5"), ("Date", "today"),
               ("Server", "uvicorn"), ("Transfer-Encoding", "chunked"), ("Connection", "close"),
               ("Keep-Alive", "timeout=5"), ("Vary", "Origin"), ("vary", "Accept"), ("X-Request-Id", "r1")]
    assert response_headers(headers) == {"content-type": "application/json", "vary": "Origin, Accept",
                                         "x-request-id": "r1"}


# --- the native client's connection slots ------------------------------------------------------------

def test_native_client_slots_bound_order_and_pass_on_a_cancelled_waiters_slot():
    """At most n holders; waiters get a slot in arrival order; a waiter cancelled while waiting leaves the
    queue, and one cancelled just after it was handed a slot passes the slot on (none is lost)."""
    import asyncio

    from toolquake.proxy.server.upstream.native_client import _Slots

    async def main() -> None:
        slots = _Slots(2)
        held, order = 0, []
        most = 0

        async def user(i: int, hold: float) -> None:
            nonlocal held, most
            await slots.acquire()
            held += 1
            most = max(most, held)
            order.append(i)
            await asyncio.sleep(hold)
            held -= 1
            slots.release()

        await asyncio.gather(*(user(i, 0.01) for i in range(8)))
        assert most == 2 and order == list(range(8)) and slots.free == 2

        # cancelled while waiting: out of the queue, the slot count unchanged
        await slots.acquire()
        await slots.acquire()
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert len(slots.waiters) == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not slots.waiters
        # cancelled after release() handed it the slot, before it ran: the slot goes to the next waiter
        first = asyncio.ensure_future(slots.acquire())
        second = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        slots.release()  # hands the slot to `first`
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1)  # got the slot `first` passed on
        assert slots.free == 0 and not slots.waiters
        slots.release()
        slots.release()
        assert slots.free == 2

    asyncio.run(main())


# --- the request log line ----------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["file", "stringio"])
def test_request_line_written_directly_matches_the_structlog_chain(tmp_path, target):
    """`logs.info` renders the request line itself (bytes straight to a line-buffered file's descriptor, or
    through a text stream): the same keys in the same order, the same values, an ISO timestamp in UTC, secrets
    redacted, and lines in the order they were written, interleaved with the structlog chain's own."""
    import io
    import re

    import structlog

    from toolquake.proxy.server import logs

    fields = {"request_id": "00ab", "route": "chat_completions", "profile": "off", "stream": False, "status": 200,
              "perturbers": [], "total_ms": 1.5, "upstream_ms": 1.0}
    path = tmp_path / "log.txt"
    f = open(path, "w", buffering=1) if target == "file" else io.StringIO()
    try:
        logs.configure("info", f)
        assert (logs._direct["fd"] is not None) == (target == "file")
        log = structlog.get_logger("t")
        logs.info(log, "request", dict(fields))
        log.info("request", **fields)
        logs.info(log, "request", {**fields, "authorization": "Bearer sk-never"})
        text = path.read_text() if target == "file" else f.getvalue()
    finally:
        f.close()
        logs.configure("info")  # back to stderr for whatever runs next in this process
    direct, chain, redacted = [json.loads(x) for x in text.splitlines()]
    assert list(direct) == list(chain)
    assert {k: v for k, v in direct.items() if k != "timestamp"} == {k: v for k, v in chain.items() if k != "timestamp"}
    for line in (direct, chain, redacted):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line["timestamp"]), line["timestamp"]
    assert redacted["authorization"] == "[redacted]" and "sk-never" not in text


def test_repeated_set_cookie_headers_stay_apart_others_are_joined():
    from toolquake.proxy.server.upstream.base import split_joined

    upstream = [("Set-Cookie", "a=1; Expires=Tue, 01 Dec 2026 10:00:00 GMT"), ("Vary", "Accept"),
                ("set-cookie", "b=2; Path=/"), ("Vary", "Origin"), ("Date", "x"), ("Content-Length", "3")]
    h = response_headers(upstream)
    assert h["vary"] == "Accept, Origin" and "date" not in h and "content-length" not in h
    out = split_joined([(k.encode(), v.encode()) for k, v in h.items()])
    assert [v for k, v in out if k == b"set-cookie"] == [b"a=1; Expires=Tue, 01 Dec 2026 10:00:00 GMT", b"b=2; Path=/"]
    assert [v for k, v in out if k == b"vary"] == [b"Accept, Origin"]
    plain = [(b"content-type", b"application/json")]
    assert split_joined(plain) is plain  # nothing to split: the same list, no copy
