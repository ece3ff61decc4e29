"""A fake OpenAI-compatible upstream, run as its own process: `python -m tests.fake_upstream --port N` (0: any free
port; the first line of its output says `listening on http://HOST:PORT`).

Raw ASGI on uvicorn (httptools + uvloop) so benchmarks measure the proxy, not this server.

What it answers with, per request (headers are end-to-end, so they pass through the proxy):
- `X-Fake-Answer: {"calls": [{"name": ..., "arguments": {...}}]}` or `{"text": "..."}`;
- `X-Fake-Call-Foreign: <the client's tool names, comma-separated>`: a call to the first tool the client
  did not send (one the proxy added), or, right after a tool result, to the client's first own tool;
- `X-Fake-Agent: a,b`: an agent loop — a call to `a`, after its result a call to `b`, then a final text
  that quotes the tool results;
- `X-Fake-Answer-By-First-Tool: {"<tool name>": <answer>, ...}`: the answer for the name of the
  request's first tool (so a perturbation that reorders tools changes the answer);
- else a script entry (`--script FILE`, JSON lines `{"match": "<substring of the last user
  message>", "answer": {...same shape...}}`; first match wins);
- else a call to the tool named by `tool_choice`, or the first tool, with arguments made from its
  schema's required parameters; else a short text.

Breaking points (`--breaking FILE`, for `toolquake sweep`): JSON lines `{"match": "<substring of the last user
message>", "answer": {...same shape...}, "measure": "tools" | "response_tokens" | "request_tokens", "wrong":
[[low, high], ...]}`; a request that matches gets `answer` unless its measure — the number of tools in the request,
the estimate counter's tokens of the content of its last tool message, or its tokens of the whole request (messages
and tools, as `conversation_tokens` counts them) — lies in one of the `wrong` intervals (inclusive; `high` null: no
end), then a text with no call (`BROKEN_TEXT`). `[[T + 1, null]]` is a model right exactly up to T;
several intervals make it non-monotone. Checked before every other source but `X-Fake-Answer`. For multi-turn
cases an entry may match on `"first_user"` instead (a user message of the request, exactly: the conversation's
first, wherever filler turns put it) and leave out `answer`: unbroken, the next source answers (`--trajectories`).

Remedies (issue #49), each checked right after `--breaking`: `--hidden-tools FILE`, JSON lines `{"match": "<substring
of the last user message>", "answer": {...}, "max_tools": N}`: a request that matches gets `answer` only while it
holds at most N tools and offers every tool `answer` calls, else a text with no call (`LOST_TEXT`) — a model that
finds the right tool in a small toolkit and loses it in a large one; `--needle FILE`, JSON lines `{"match": ...,
"answer": {...}, "needle": "<text>", "within_tokens": N}`: `answer` only when `needle` occurs in the content of the
request's last tool message and ends within its first N tokens (the estimate counter's), else `LOST_TEXT` — a model
that reads only the start of a long tool response.

Multi-turn agents (`--trajectories FILE`, JSON lines `{"first_user": "<first user message>", "turns":
[[<answer>, ...] per turn], "users": [<user message of each turn>, ...]}`): a request whose first user message
is `first_user` (or, after filler turns a perturbation put first, whose first such user message is) gets the
answer of its turn (user messages so far - 1; with `users`, only those count, so filler turns a perturbation
inserted do not) and step (assistant messages since the last user message); past the end of a turn's list, a short
text (the turn ends).

The Responses API (`POST /v1/responses`) answers from the same sources: its request is read as the
chat request it stands for (`instructions` and `input` items as messages, function tools, tool
choice), and the answer is a Responses object (`output` with `message` / `function_call` items), or
its event stream (`response.created` … `response.completed`) when `stream` is true.

Nondeterminism (`X-Fake-Flaky: P`): whatever the answer above, it is replaced with probability P by a
text with no call (`FLAKY_TEXT`) — decided from the request's `seed` and last user message when the
body has a `seed` (the same request gives the same answer), else at random (a twin of the same
request may disagree with it). `X-Fake-Flaky: 0`, or no header, is deterministic.

Faults (`X-Fake-Fault`): `status:CODE`, `delay:MS` (before answering), `hang` (never answers),
`invalid-json`, `deep-json:N` (200 with a JSON object whose `choices`/`output` is N lists deep, default
100,000: past any JSON decoder's recursion limit), `cut-stream` (stream stops halfway, connection closed),
`slow-bytes:MS` (body sent one byte at a time), `chunk-delay:MS` (between SSE frames), `empty-stream` (200
with an event-stream content type and no bytes), `no-done` (a stream that ends cleanly without `[DONE]` or its
final event), `drop` (the request is read and recorded, then the connection closed without a byte of answer),
`drop-reused` (the same, only when the request came on a connection that already carried one), `raw` (200 with
the `X-Fake-Body` header's value as its JSON body, as it is: an answer of any shape), `huge:N[:PIECE]` (a runaway
answer: N characters of text, `0` for no end, in deltas of PIECE characters, default 1,000; streamed as chat chunks
or Responses events when the request asks for a stream, else one chat completion or Responses object (by the
route) written PIECE characters at a time; sent only as fast as the client reads, and stopped when it hangs up).

Token counts (`--usage-varies`): a chat completion's `usage` differs from answer to answer (prompt tokens 50 to
8,049, completion tokens 1 to 300, from the answer's sequence number), as a real backend's do; else 10 and 5.
`--usage-counts`: a chat completion's prompt tokens are its request's (messages and tools) by the estimate counter.

A small context (`--max-tools N`): a chat request with more than N tools gets 400 with OpenAI's error code
`context_length_exceeded`, as from a backend whose context cannot hold the catalog.

A hosted API's request validation, checked before anything else (OpenAI's documented answers):
`--tools-array-max N`: a chat request with more than N tools gets 400 `array_above_max_length`, param `tools`
(OpenAI's API takes at most 128); `--refuse-temperature`: a request that sends `temperature` other than 1 gets
400 `unsupported_value`, param `temperature` (OpenAI's reasoning models).

Cookies (`X-Fake-Cookies: N`): the answer carries N `Set-Cookie` headers, each with an Expires date (which
holds a comma), as a load balancer's sticky-session cookies do.

Broken tool-call shapes (`X-Fake-Broken: a,b`, for the conformance checker; docs/conformance.md names the
rule each one breaks): `no-index` (stream deltas without `index`), `no-id`, `no-type`, `no-name` (the
first delta, or the call, lacks it; streamed, the name comes in the second delta), `repeat-id-name`
(every argument delta sends id and name again), `same-index` (parallel calls all at index 0),
`args-invalid` (arguments cut short), `args-object` (arguments as a JSON object), `empty-args` (arguments
""), `finish-stop` (calls with `finish_reason: "stop"`), `finish-tool-calls` (text with
`finish_reason: "tool_calls"`), `bad-chunk` (a data payload that is not JSON). Responses: `no-id` (no
`call_id`), `no-name`, `args-invalid`, `empty-args`, `bad-chunk`, `done-mismatch` (`arguments.done` and
the final response disagree with the deltas), `unknown-item` (argument deltas for an output_index and
item_id never opened). A call left in the text needs no knob: `X-Fake-Answer: {"text": "<tool_call>…"}`.

`X-Fake-Seq: N` makes the ids and timestamps of the answer N instead of a counter and the clock, so two
requests with the same headers get the same bytes (direct and through the proxy, to compare them).

HTTPS (`--tls CERT KEY`): served over TLS with that certificate, as an `https://` backend.

Introspection for tests: every request is recorded (last 2,000; with the client's address and port,
`peer`, to see connections reused; `raw_path`, the path as it arrived, escapes and all); `GET /_fake/requests` returns
them (`?tag=X` filters on the `X-Test-Tag` header); `DELETE /_fake/requests` clears.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import random
import socket
import time
from typing import Any

import msgspec

_enc = msgspec.json.encode
_dec = msgspec.json.decode
_ids = itertools.count(1)
RECORDED: collections.deque = collections.deque(maxlen=2000)
SCRIPT: list[dict[str, Any]] = []
BREAKING: list[dict[str, Any]] = []
BROKEN_TEXT = "Broken: no call past the breaking point."
HIDDEN_TOOLS: list[dict[str, Any]] = []
NEEDLES: list[dict[str, Any]] = []
LOST_TEXT = "Lost: the needed tool or record was not found."
TRAJECTORIES: dict[str, list[list[dict[str, Any]]]] = {}
#: first user message → the user messages of the conversation's own turns (`users` of a trajectory)
TRAJECTORY_USERS: dict[str, set[str]] = {}
MODEL = "fake-model"
#: `--max-tools N`: a chat request with more tools than this is refused as too long for the context (None: never)
MAX_TOOLS: int | None = None
USAGE_VARIES = False  # `--usage-varies`
USAGE_COUNTS = False  # `--usage-counts`
#: `--tools-array-max N`: a hosted API's cap on the tools array (OpenAI: 128), refused as the request's shape
TOOLS_ARRAY_MAX: int | None = None
#: `--refuse-temperature`: a model that takes only its default temperature (OpenAI's reasoning models)
REFUSE_TEMPERATURE = False
#: tokenizer endpoints served (`--tokenize`): vLLM's /tokenize and llama.cpp's /extras/tokenize/count
TOKENIZE_ROUTES = {"/tokenize", "/extras/tokenize/count"}
_TOKENIZE_CHOICES = {"both": TOKENIZE_ROUTES.copy(), "vllm": {"/tokenize"}, "llamacpp": {"/extras/tokenize/count"},
                     "none": set()}


def _example(schema: dict[str, Any]) -> Any:
    t = schema.get("type")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if t == "integer":
        return 1
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    if t == "array":
        return [_example(schema.get("items") or {"type": "string"})]
    if t == "object":
        props = schema.get("properties") or {}
        return {k: _example(v) for k, v in props.items() if k in (schema.get("required") or [])}
    return "example"


def _last_user(body: dict[str, Any]) -> str:
    for msg in reversed(body.get("messages") or []):
        if isinstance(msg, dict) and msg.get("role") == "user":
            c = msg.get("content")
            return c if isinstance(c, str) else _enc(c).decode()
    return ""


def _by_first_tool(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """The `X-Fake-Answer-By-First-Tool` entry for the request's first tool, as an X-Fake-Answer value."""
    table = headers.get("x-fake-answer-by-first-tool")
    tools = body.get("tools") or []
    if not table or not tools:
        return None
    answer = _dec(table).get((tools[0].get("function") or {}).get("name"))
    return None if answer is None else _enc(answer).decode()


def _trajectory_answer(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `--trajectories` answer for this point of a multi-turn conversation, if one is scripted."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    # the first user message that opens a scripted conversation (filler turns a perturbation put first are skipped)
    first = next((str(messages[i].get("content")) for i in users if str(messages[i].get("content")) in TRAJECTORIES),
                 None)
    if first is None:
        return None
    turns = TRAJECTORIES[first]
    own = TRAJECTORY_USERS.get(first)
    turn = len(users) - 1 if own is None else sum(1 for i in users if str(messages[i].get("content")) in own) - 1
    step = sum(1 for m in messages[users[-1]:] if m.get("role") == "assistant")
    steps = turns[turn] if turn < len(turns) else []
    return steps[step] if step < len(steps) else {"text": "Done."}


def _foreign(body: dict[str, Any], own: str) -> dict[str, Any] | None:
    """`X-Fake-Call-Foreign: a,b` (the client's own tool names): call the first tool of the request that is
    not the client's — a tool the proxy added — unless the last message is a tool result, then the first
    of the client's own tools (a model that recovers after hearing the tool is unavailable)."""
    names = [n.strip() for n in own.split(",") if n.strip()]
    tools = [(t.get("function") or {}).get("name") for t in body.get("tools") or []]
    messages = body.get("messages") or []
    after_result = bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "tool"
    pick = next((n for n in tools if (n in names) == after_result), None)
    return {"calls": [{"name": pick, "arguments": {}}]} if pick else None


def _agent_turn(body: dict[str, Any], plan: str) -> dict[str, Any]:
    """`X-Fake-Agent: a,b`: an agent loop's model — call `a`, then (after its result) `b`, then a final text."""
    names = [n.strip() for n in plan.split(",") if n.strip()]
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    if not body.get("tools"):  # tools described in the prompt (format rewriting): answer in BFCL's python format
        shown = [str(m.get("content")) for m in messages if m.get("role") == "user" and "'role': 'tool'" in
                 str(m.get("content"))]
        done = sum(text.count("'role': 'tool'") for text in shown)
        if done < len(names):
            return {"text": f"[{names[done]}(city='example')]"}
        return {"text": f"Final answer after {done} tool results: {' '.join(shown)}"}
    results = [m for m in messages if m.get("role") == "tool"]
    # the next step is the first planned tool without a result yet (a tool the proxy added and answered
    # itself appears only in the proxy's follow-ups, so each turn of the client's loop plans it again)
    called = {str(c.get("id")): str((c.get("function") or {}).get("name")) for m in messages
              if m.get("role") == "assistant" for c in m.get("tool_calls") or [] if isinstance(c, dict)}
    answered = {called.get(str(m.get("tool_call_id")), "") for m in results}
    wanted = next((n for n in names if n not in answered), None)
    if wanted is not None:
        tool = next((t.get("function") or {} for t in body.get("tools") or []
                     if (t.get("function") or {}).get("name") == wanted), {"name": wanted})
        arguments = _example({"type": "object", **(tool.get("parameters") or {})})
        return {"calls": [{"name": wanted, "arguments": arguments}]}
    said = "; ".join(str(m.get("content")) for m in results)
    return {"text": f"Final answer after {len(results)} tool results: {said}"}


FLAKY_TEXT = "Flaky: no call this time."


def flaky_hit(seed: Any, text: str, p: float) -> bool:
    """Whether `X-Fake-Flaky: p` replaces the answer: fixed by (seed, text) when the request has a seed."""
    rng = random.Random(f"{seed}\0{text}") if seed is not None else random
    return rng.random() < p


def flaky(answer: dict[str, Any], body: dict[str, Any], header: str | None) -> dict[str, Any]:
    if not header:
        return answer
    return {"text": FLAKY_TEXT} if flaky_hit(body.get("seed"), _last_user(body), float(header)) else answer


def measure(body: dict[str, Any], what: str) -> int:
    """What a `--breaking` entry is judged on: the request's tool count, its last tool message's tokens, or the
    whole request's tokens."""
    if what == "tools":
        return len(body.get("tools") or [])
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    if what == "request_tokens":
        return EstimateCounter().count_request(body)
    return EstimateCounter().count_text(_last_tool_text(body))


def _breaking_answer(body: dict[str, Any]) -> dict[str, Any] | None:
    text = _last_user(body)
    users = {str(m.get("content")) for m in body.get("messages") or []
             if isinstance(m, dict) and m.get("role") == "user"}
    for entry in BREAKING:
        if ("match" in entry and entry["match"] in text) or ("first_user" in entry and entry["first_user"] in users):
            x = measure(body, entry.get("measure", "tools"))
            broken = any(lo <= x and (hi is None or x <= hi) for lo, hi in entry.get("wrong") or [])
            return {"text": BROKEN_TEXT} if broken else entry.get("answer")
    return None


def _last_tool_text(body: dict[str, Any]) -> str:
    tools = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "tool"]
    content = tools[-1].get("content") if tools else ""
    return content if isinstance(content, str) else _enc(content).decode()


def _remedy_answer(body: dict[str, Any]) -> dict[str, Any] | None:
    """The answer of the first `--hidden-tools` or `--needle` entry matching the last user message, or None."""
    text = _last_user(body)
    offered = {str((t.get("function") or {}).get("name")) for t in body.get("tools") or [] if isinstance(t, dict)}
    for entry in HIDDEN_TOOLS:
        if entry["match"] in text:
            answer = entry["answer"]
            needed = {c["name"] for c in answer.get("calls") or []}
            found = len(body.get("tools") or []) <= entry["max_tools"] and needed <= offered
            return answer if found else {"text": LOST_TEXT}
    for entry in NEEDLES:
        if entry["match"] in text:
            from toolquake.perturbers.helpers.tokens import EstimateCounter

            content = _last_tool_text(body)
            at = content.find(entry["needle"])
            end = at + len(entry["needle"])
            found = at >= 0 and EstimateCounter().count_text(content[:end]) <= entry["within_tokens"]
            return entry["answer"] if found else {"text": LOST_TEXT}
    return None


def choose_answer(
    body: dict[str, Any], header: str | None, foreign: str | None = None, agent: str | None = None
) -> dict[str, Any]:
    if header:
        return _dec(header)
    if BREAKING:
        answer = _breaking_answer(body)
        if answer is not None:
            return answer
    if HIDDEN_TOOLS or NEEDLES:
        answer = _remedy_answer(body)
        if answer is not None:
            return answer
    if agent:
        return _agent_turn(body, agent)
    if foreign:
        answer = _foreign(body, foreign)
        if answer is not None:
            return answer
    if TRAJECTORIES:
        answer = _trajectory_answer(body)
        if answer is not None:
            return answer
    if SCRIPT:
        text = _last_user(body)
        for entry in SCRIPT:
            if entry["match"] in text:
                return entry["answer"]
    tools = body.get("tools") or []
    if tools:
        wanted = body.get("tool_choice")
        tool = tools[0]
        if isinstance(wanted, dict):
            name = (wanted.get("function") or {}).get("name")
            tool = next((t for t in tools if t.get("function", {}).get("name") == name), tool)
        fn = tool.get("function") or {}
        return {
            "calls": [
                {"name": fn.get("name", "f"), "arguments": _example({"type": "object", **(fn.get("parameters") or {})})}
            ]
        }
    return {"text": "Hello from the fake upstream."}


def completion(answer: dict[str, Any], model: str, seq: str | None = None) -> dict[str, Any]:
    n = int(seq) if seq else next(_ids)
    message: dict[str, Any] = {"role": "assistant", "content": answer.get("text")}
    finish = "stop"
    if answer.get("calls"):
        message["tool_calls"] = [
            {
                "id": f"call_{n}_{i}",
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": c["arguments"] if isinstance(c["arguments"], str) else _enc(c["arguments"]).decode(),
                },
            }
            for i, c in enumerate(answer["calls"])
        ]
        finish = "tool_calls"
    return {
        "id": f"chatcmpl-fake-{n}",
        "object": "chat.completion",
        "created": n if seq else int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": _usage(n),
    }


def counted_usage(body: dict[str, Any]) -> dict[str, int]:
    """`--usage-counts`: usage whose prompt tokens are the request's (messages and tools) by the estimate counter,
    as a backend counts what it was sent: a remedy that cuts the request shows in it."""
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    prompt = EstimateCounter().count_request(body)
    return {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}


def _usage(n: int) -> dict[str, int]:
    """A chat completion's token counts (`--usage-varies`: from its sequence number `n`)."""
    if not USAGE_VARIES:
        return {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    prompt, completion = 50 + n * 7919 % 8000, 1 + n * 104729 % 300
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stream_frames(resp: dict[str, Any], piece: int = 8) -> list[bytes]:
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    msg = resp["choices"][0]["message"]

    def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + _enc({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

    out = [frame({"role": "assistant", "content": ""})]
    text = msg.get("content") or ""
    for i in range(0, len(text), piece):
        out.append(frame({"content": text[i : i + piece]}))
    for n, tc in enumerate(msg.get("tool_calls") or []):
        out.append(
            frame(
                {
                    "tool_calls": [
                        {
                            "index": n,
                            "id": tc["id"],
                            "type": "function",
                            "function": {"name": tc["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )
        args = tc["function"]["arguments"]
        for i in range(0, len(args), piece):
            out.append(frame({"tool_calls": [{"index": n, "function": {"arguments": args[i : i + piece]}}]}))
    out.append(frame({}, resp["choices"][0]["finish_reason"]))
    out.append(b"data: [DONE]\n\n")
    return out


def break_completion(resp: dict[str, Any], shapes: set[str], stream: bool) -> dict[str, Any]:
    """The answer with the broken shapes a complete chat answer can have (`X-Fake-Broken`); a stream's late
    name is `broken_stream_frames`' work."""
    choice = resp["choices"][0]
    for tc in choice["message"].get("tool_calls") or []:
        if "no-id" in shapes:
            tc.pop("id")
        if "no-type" in shapes:
            tc.pop("type")
        if "no-name" in shapes and not stream:
            tc["function"].pop("name")
        if "args-invalid" in shapes:
            tc["function"]["arguments"] = tc["function"]["arguments"][:-1]
        if "empty-args" in shapes:
            tc["function"]["arguments"] = ""
        if "args-object" in shapes:
            tc["function"]["arguments"] = _dec(tc["function"]["arguments"] or "{}")
    if "finish-stop" in shapes:
        choice["finish_reason"] = "stop"
    if "finish-tool-calls" in shapes:
        choice["finish_reason"] = "tool_calls"
    return resp


def broken_stream_frames(resp: dict[str, Any], shapes: set[str], piece: int = 8) -> list[bytes]:
    """`stream_frames` with the broken shapes of `X-Fake-Broken` (the answer already broken by break_completion,
    except the stream-only shapes)."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    msg = resp["choices"][0]["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    text = msg.get("content") or ""
    deltas += [{"content": text[i : i + piece]} for i in range(0, len(text), piece)]
    for n, tc in enumerate(msg.get("tool_calls") or []):
        index = 0 if "same-index" in shapes else n
        fn = tc["function"]
        first = {"index": index, "id": tc.get("id"), "type": tc.get("type"),
                 "function": {"name": fn["name"], "arguments": ""}}
        for key in ("id", "type"):
            if first[key] is None:
                first.pop(key)
        later: list[dict[str, Any]] = []
        if "no-name" in shapes:  # the name comes late, in the second delta
            first["function"].pop("name")
            later.append({"index": index, "function": {"name": fn["name"]}})
        args = fn.get("arguments")
        if isinstance(args, str):
            for i in range(0, len(args), piece):
                later.append({"index": index, "function": {"arguments": args[i : i + piece]}})
        else:
            first["function"]["arguments"] = args
        if "repeat-id-name" in shapes:
            for d in later:
                d["id"] = tc.get("id")
                d["function"]["name"] = fn.get("name")
        deltas += [{"tool_calls": [d]} for d in [first, *later]]
    if "no-index" in shapes:
        for d in deltas:
            for tc in d.get("tool_calls") or []:
                tc.pop("index", None)

    def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + _enc({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

    out = [frame(d) for d in deltas]
    if "bad-chunk" in shapes:
        out.insert(1, b"data: {not json\n\n")
    out.append(frame({}, resp["choices"][0]["finish_reason"]))
    out.append(b"data: [DONE]\n\n")
    return out


def break_response(resp: dict[str, Any], shapes: set[str]) -> dict[str, Any]:
    """A Responses object with the broken shapes of `X-Fake-Broken` (its calls)."""
    for item in resp["output"]:
        if item["type"] != "function_call":
            continue
        if "no-id" in shapes:
            item.pop("call_id")
        if "no-name" in shapes:
            item.pop("name")
        if "args-invalid" in shapes:
            item["arguments"] = item["arguments"][:-1]
        if "empty-args" in shapes:
            item["arguments"] = ""
    return resp


def broken_response_events(resp: dict[str, Any], shapes: set[str]) -> list[bytes]:
    """`response_events` with the stream-only broken shapes of `X-Fake-Broken`."""
    frames = response_events(resp)
    out = []
    for f in frames:
        head, _, data = f.partition(b"data: ")
        event = _dec(data)
        kind = event["type"]
        if "unknown-item" in shapes and kind.startswith("response.function_call_arguments."):
            event.update(output_index=99, item_id="fc_never_opened")
        if "done-mismatch" in shapes and kind == "response.function_call_arguments.done":
            event["arguments"] = event["arguments"] + " "
        if "done-mismatch" in shapes and kind == "response.completed":
            for item in event["response"]["output"]:
                if item.get("type") == "function_call":
                    item["arguments"] = " " + item["arguments"]
        out.append(head + b"data: " + _enc(event) + b"\n\n")
    if "bad-chunk" in shapes:
        out.insert(1, b"event: response.in_progress\ndata: {not json\n\n")
    return out


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def _send(send, status: int, body: bytes, ctype: bytes = b"application/json", extra=()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *extra],
        }
    )
    await send({"type": "http.response.body", "body": body})


def fake_cookies(n: int) -> list[str]:
    return [f"sticky{i}=v{i}; Expires=Tue, 01 Dec 2026 10:0{i}:00 GMT; Path=/; HttpOnly" for i in range(n)]


def _with_cookies(send, n: int):
    async def send_with_cookies(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                               *((b"set-cookie", c.encode()) for c in fake_cookies(n))]}
        await send(message)

    return send_with_cookies


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    path, method = scope["path"], scope["method"]
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if headers.get("x-fake-cookies"):
        send = _with_cookies(send, int(headers["x-fake-cookies"]))
    raw = await _read_body(receive)
    if path == "/_fake/requests":
        if method == "DELETE":
            RECORDED.clear()
            return await _send(send, 204, b"")
        tag = None
        for part in scope.get("query_string", b"").decode().split("&"):
            if part.startswith("tag="):
                tag = part[4:]
        items = [r for r in RECORDED if tag is None or r["headers"].get("x-test-tag") == tag]
        return await _send(send, 200, _enc(items))
    RECORDED.append(
        {
            "method": method,
            "path": path,
            "raw_path": (scope.get("raw_path") or b"").decode("latin-1"),  # as it arrived, escapes and all
            "query": scope.get("query_string", b"").decode(),
            "peer": list(scope.get("client") or ()),  # the connection it came on (keep-alive tests)
            "headers": headers,
            "body": raw.decode("utf-8", "replace"),
        }
    )
    fault = headers.get("x-fake-fault", "")
    kind, _, arg = fault.partition(":")
    if kind == "drop" or (kind == "drop-reused" and scope.get("fake.reused")):
        scope["fake.transport"].close()  # set by _Protocol: no answer at all, the connection just ends
        await asyncio.sleep(0.05)  # until uvicorn saw the connection go (else it would try to answer 500)
        return
    if kind == "huge":
        return await _huge(path, raw, arg, send, receive)
    if kind == "delay":
        await asyncio.sleep(float(arg) / 1000)
    elif kind == "hang":
        await asyncio.sleep(3600)
    elif kind == "status":
        return await _send(
            send, int(arg), _enc({"error": {"message": f"injected {arg}", "type": "server_error", "code": "injected"}})
        )
    elif kind == "raw":
        return await _send(send, 200, headers.get("x-fake-body", "").encode())
    if path.endswith("/chat/completions") and method == "POST":
        return await _chat(raw, headers, kind, arg, send, receive)
    if path.endswith("/responses") and method == "POST":
        return await _responses(raw, headers, kind, arg, send, receive)
    if path.endswith("/models"):
        return await _send(send, 200, _enc({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
    if path.endswith("/completions") and method == "POST":
        return await _send(
            send,
            200,
            _enc(
                {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": "fake", "finish_reason": "stop"}],
                }
            ),
        )
    if path.endswith("/embeddings") and method == "POST":
        return await _send(
            send,
            200,
            _enc(
                {
                    "object": "list",
                    "model": MODEL,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                }
            ),
        )
    if path in TOKENIZE_ROUTES:
        try:
            body = _dec(raw) if raw else {}
        except msgspec.DecodeError:
            return await _send(send, 400, b'{"error":{"message":"bad json","type":"invalid_request_error"}}')
        text = _enc([body.get("messages") or body.get("prompt") or body.get("input") or "", body.get("tools") or []])
        count = max(1, len(text) // 4)
        payload = (
            {"count": count} if path.startswith("/extras") else {"count": count, "max_model_len": 131072, "tokens": []}
        )
        return await _send(send, 200, _enc(payload))
    return await _send(send, 404, _enc({"error": {"message": f"no route {path}", "type": "invalid_request_error"}}))


def validation_error(body: dict[str, Any]) -> bytes | None:
    """A hosted API's answer to a request it refuses for its shape (`--tools-array-max`, `--refuse-temperature`),
    worded as OpenAI's; None when the request passes."""
    tools = body.get("tools") or []
    if TOOLS_ARRAY_MAX is not None and len(tools) > TOOLS_ARRAY_MAX:
        return _enc({"error": {"message": f"Invalid 'tools': array too long. Expected an array with maximum length "
                                          f"{TOOLS_ARRAY_MAX}, but got an array with length {len(tools)} instead.",
                               "type": "invalid_request_error", "param": "tools", "code": "array_above_max_length"}})
    if REFUSE_TEMPERATURE and "temperature" in body and body["temperature"] != 1:
        return _enc({"error": {"message": f"Unsupported value: 'temperature' does not support {body['temperature']} "
                                          "with this model. Only the default (1) value is supported.",
                               "type": "invalid_request_error", "param": "temperature", "code": "unsupported_value"}})
    return None


async def _huge(path: str, raw: bytes, arg: str, send, receive) -> None:
    """`huge:N[:PIECE]`: N characters of text (0: without end) in pieces of PIECE; see the module docstring."""
    total, _, piece = arg.partition(":")
    size, piece_n = int(total or 0), int(piece or 1000)
    try:
        stream = bool(_dec(raw).get("stream")) if raw else False
    except (msgspec.DecodeError, AttributeError):
        stream = False
    responses = path.endswith("/responses")
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch())
    text = "x" * piece_n
    if stream and responses:
        ev = lambda kind, **f: b"event: " + kind.encode() + b"\ndata: " + _enc({"type": kind, **f}) + b"\n\n"  # noqa: E731
        base = {"id": "resp_huge", "object": "response", "model": MODEL, "status": "in_progress", "output": []}
        head = ev("response.created", response=base) + ev(
            "response.output_item.added", output_index=0,
            item={"type": "message", "id": "msg_huge", "role": "assistant", "status": "in_progress", "content": []})
        frame = ev("response.output_text.delta", item_id="msg_huge", output_index=0, content_index=0, delta=text)
        done = {**base, "status": "completed", "output": [{"type": "message", "id": "msg_huge", "role": "assistant",
                "status": "completed", "content": [{"type": "output_text", "text": "x" * size, "annotations": []}]}]}
        tail = ev("response.completed", response=done)
        ctype = b"text/event-stream"
    elif stream:
        base = {"id": "chatcmpl-huge", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
        chunk = lambda delta, finish=None: b"data: " + _enc(  # noqa: E731
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
        head, frame = chunk({"role": "assistant", "content": ""}), chunk({"content": text})
        tail = chunk({}, "stop") + b"data: [DONE]\n\n"
        ctype = b"text/event-stream"
    else:
        if responses:
            head = (b'{"id":"resp_huge","object":"response","model":"' + MODEL.encode() + b'","status":"completed",'
                    b'"output":[{"type":"message","id":"msg_huge","role":"assistant","status":"completed",'
                    b'"content":[{"type":"output_text","annotations":[],"text":"')
            tail = b'"}]}]}'
        else:
            head = (b'{"id":"chatcmpl-huge","object":"chat.completion","created":0,"model":"' + MODEL.encode() +
                    b'","choices":[{"index":0,"message":{"role":"assistant","content":"')
            tail = b'"},"finish_reason":"stop"}]}'
        frame, ctype = text.encode(), b"application/json"
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": head, "more_body": True})
        sent = 0
        while (not size or sent < size) and not gone.is_set():
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            sent += piece_n
            await asyncio.sleep(0)  # lets the watcher see a hang-up
        if not gone.is_set():
            await send({"type": "http.response.body", "body": tail})
    finally:
        watcher.cancel()


def context_length_exceeded(tools: int) -> bytes:
    """OpenAI's answer to a request longer than the model's context (`--max-tools`)."""
    return _enc({"error": {"message": f"This model's maximum context length is exceeded: the request has {tools} "
                                      f"tools, more than the {MAX_TOOLS} that fit. Please reduce the length of the "
                                      "messages or functions.", "type": "invalid_request_error", "param": "messages",
                           "code": "context_length_exceeded"}})


def _deep(ident: bytes, key: bytes, depth: str) -> bytes:
    """`deep-json:N`: valid JSON, an object whose `key` holds N nested lists."""
    n = int(depth) if depth else 100_000
    return b'{"id": "' + ident + b'", "' + key + b'": ' + b"[" * n + b"]" * n + b"}"


async def _chat(raw: bytes, headers: dict[str, str], kind: str, arg: str, send, receive) -> None:
    try:
        body = _dec(raw)
    except msgspec.DecodeError:
        return await _send(send, 400, _enc({"error": {"message": "invalid JSON", "type": "invalid_request_error"}}))
    refused = validation_error(body)
    if refused is not None:
        return await _send(send, 400, refused)
    if MAX_TOOLS is not None and len(body.get("tools") or []) > MAX_TOOLS:
        return await _send(send, 400, context_length_exceeded(len(body["tools"])))
    resp = completion(
        flaky(choose_answer(
            body,
            headers.get("x-fake-answer") or _by_first_tool(body, headers),
            headers.get("x-fake-call-foreign"),
            headers.get("x-fake-agent"),
        ), body, headers.get("x-fake-flaky")),
        body.get("model") or MODEL,
        headers.get("x-fake-seq"),
    )
    if kind == "invalid-json":
        return await _send(send, 200, b'{"id": "chatcmpl-broken", "choices": [')
    if kind == "deep-json":
        return await _send(send, 200, _deep(b"chatcmpl-deep", b"choices", arg))
    if USAGE_COUNTS:  # `--usage-counts`: the prompt tokens the request holds, by the estimate counter
        resp["usage"] = counted_usage(body)
    shapes = {x.strip() for x in headers.get("x-fake-broken", "").split(",") if x.strip()}
    if shapes:
        resp = break_completion(resp, shapes, bool(body.get("stream")))
    if not body.get("stream"):
        data = _enc(resp)
        if kind == "cut-stream":  # the body stops halfway and the connection drops
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            raise ConnectionAbortedError("fake upstream cut the body on purpose")
        if kind == "slow-bytes":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
                }
            )
            for i in range(len(data)):
                await send({"type": "http.response.body", "body": data[i : i + 1], "more_body": True})
                await asyncio.sleep(float(arg) / 1000)
            return await send({"type": "http.response.body", "body": b""})
        return await _send(send, 200, data)
    frames = broken_stream_frames(resp, shapes) if shapes else stream_frames(resp)
    if kind == "no-done":
        frames = frames[:-1]
    elif kind == "empty-stream":
        frames = []
    state = {"complete": False}
    watcher = asyncio.ensure_future(_watch_disconnect(receive, headers, state))
    try:
        await _stream(send, frames, kind, arg, state)
    finally:
        watcher.cancel()


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request stands for (enough to choose an answer)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items or []:
        kind = item.get("type")
        if kind in (None, "message"):
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            messages.append(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": item.get("call_id"),
                            "type": "function",
                            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                        }
                    ],
                }
            )
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
    tools = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in body.get("tools") or []
        if tool.get("type") == "function"
    ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("name"):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return {"messages": messages, "tools": tools, "tool_choice": choice}


def response_object(answer: dict[str, Any], model: str, seq: str | None = None) -> dict[str, Any]:
    n = int(seq) if seq else next(_ids)
    output: list[dict[str, Any]] = []
    if answer.get("text"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{n}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": answer["text"], "annotations": []}],
            }
        )
    for i, c in enumerate(answer.get("calls") or []):
        args = c["arguments"] if isinstance(c["arguments"], str) else _enc(c["arguments"]).decode()
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{n}_{i}",
                "call_id": f"call_{n}_{i}",
                "status": "completed",
                "name": c["name"],
                "arguments": args,
            }
        )
    return {
        "id": f"resp_fake_{n}",
        "object": "response",
        "created_at": n if seq else int(time.time()),
        "model": model,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
    }


def response_events(resp: dict[str, Any], piece: int = 8, final: bool = True) -> list[bytes]:
    seq = itertools.count()

    def ev(kind: str, **fields: Any) -> bytes:
        return (
            b"event: "
            + kind.encode()
            + b"\ndata: "
            + _enc({"type": kind, "sequence_number": next(seq), **fields})
            + b"\n\n"
        )

    out = [ev("response.created", response={**resp, "status": "in_progress", "output": []})]
    for i, item in enumerate(resp["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(ev("response.output_item.added", output_index=i, item={**item, "content": []}))
            for j in range(0, len(text), piece):
                out.append(
                    ev(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=i,
                        content_index=0,
                        delta=text[j : j + piece],
                    )
                )
        else:
            out.append(ev("response.output_item.added", output_index=i, item={**item, "arguments": ""}))
            args = item["arguments"]
            for j in range(0, len(args), piece):
                out.append(
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=i,
                        delta=args[j : j + piece],
                    )
                )
            out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=args))
        out.append(ev("response.output_item.done", output_index=i, item=item))
    if final:
        out.append(ev("response.completed", response=resp))
    return out


async def _responses(raw: bytes, headers: dict[str, str], kind: str, arg: str, send, receive) -> None:
    try:
        body = _dec(raw)
    except msgspec.DecodeError:
        return await _send(send, 400, _enc({"error": {"message": "invalid JSON", "type": "invalid_request_error"}}))
    chat = responses_as_chat(body)
    resp = response_object(
        flaky(choose_answer(
            chat,
            headers.get("x-fake-answer") or _by_first_tool(chat, headers),
            headers.get("x-fake-call-foreign"),
            headers.get("x-fake-agent"),
        ), chat, headers.get("x-fake-flaky")),
        body.get("model") or MODEL,
        headers.get("x-fake-seq"),
    )
    if kind == "invalid-json":
        return await _send(send, 200, b'{"id": "resp_broken", "output": [')
    if kind == "deep-json":
        return await _send(send, 200, _deep(b"resp_deep", b"output", arg))
    shapes = {x.strip() for x in headers.get("x-fake-broken", "").split(",") if x.strip()}
    if shapes:
        resp = break_response(resp, shapes)
    if not body.get("stream"):
        return await _send(send, 200, _enc(resp))
    frames = broken_response_events(resp, shapes) if shapes else response_events(resp, final=kind != "no-done")
    state = {"complete": False}
    watcher = asyncio.ensure_future(_watch_disconnect(receive, headers, state))
    try:
        await _stream(send, [] if kind == "empty-stream" else frames, kind, arg, state)
    finally:
        watcher.cancel()


async def _watch_disconnect(receive, headers: dict[str, str], state: dict[str, bool]) -> None:
    """Record the moment the client (the proxy) closes a stream's connection early."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if state["complete"]:
                return
            RECORDED.append({"method": "EVENT", "path": "disconnect", "query": "", "headers": headers, "body": ""})
            return


async def _stream(send, frames: list[bytes], kind: str, arg: str, state: dict[str, bool]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )
    if kind == "cut-stream":
        for f in frames[: max(1, len(frames) // 2)]:
            await send({"type": "http.response.body", "body": f, "more_body": True})
        raise ConnectionAbortedError("fake upstream cut the stream on purpose")
    delay = float(arg) / 1000 if kind in ("chunk-delay", "slow-bytes") else 0.0
    for f in frames:
        if kind == "slow-bytes":
            for i in range(len(f)):
                await send({"type": "http.response.body", "body": f[i : i + 1], "more_body": True})
                await asyncio.sleep(delay)
            continue
        await send({"type": "http.response.body", "body": f, "more_body": True})
        if delay:
            await asyncio.sleep(delay)
    state["complete"] = True
    await send({"type": "http.response.body", "body": b""})


def _protocol() -> type:
    """uvicorn's httptools protocol, handing the app its connection's transport (the `drop` faults close it) and
    whether the connection carried a request before (`drop-reused`): counted per connection, as a client address
    and port can come back on a later connection once the kernel hands the port out again."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _Protocol(HttpToolsProtocol):
        _fake_requests = 0

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            self._fake_requests += 1
            cycle.scope["fake.transport"] = self.transport
            cycle.scope["fake.reused"] = self._fake_requests > 1
            super()._start_asgi_task(cycle, app)

    return _Protocol


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible upstream for tests and benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (said on the first output line)")
    parser.add_argument("--script", help="JSON lines of {match, answer} (see module docstring)")
    parser.add_argument(
        "--tokenize",
        choices=tuple(_TOKENIZE_CHOICES),
        default="both",
        help="tokenizer endpoints to serve: vLLM's /tokenize, llama.cpp's /extras/tokenize/count, "
        "both (default) or none",
    )
    parser.add_argument("--keep-alive", type=float, default=5.0,
                        help="seconds an idle client connection is kept open (uvicorn's default 5)")
    parser.add_argument("--breaking", help="JSON lines of {match, answer, measure, wrong} (see module docstring)")
    parser.add_argument("--hidden-tools", help="JSON lines of {match, answer, max_tools} (see module docstring)")
    parser.add_argument("--needle", help="JSON lines of {match, answer, needle, within_tokens} (see module docstring)")
    parser.add_argument(
        "--trajectories", help="JSON lines of {first_user, turns} for multi-turn agents (see module docstring)"
    )
    parser.add_argument("--max-tools", type=int, default=None, metavar="N",
                        help="refuse a chat request with more than N tools with 400 context_length_exceeded, as a "
                             "backend whose context is too small for the catalog does")
    parser.add_argument("--usage-counts", action="store_true",
                        help="usage.prompt_tokens: the request's tokens by the estimate counter (remedies' tests)")
    parser.add_argument("--usage-varies", action="store_true",
                        help="token counts that differ from answer to answer, as a real backend's do (else 10 and 5)")
    parser.add_argument("--tools-array-max", type=int, default=None, metavar="N",
                        help="refuse a chat request with more than N tools with 400 array_above_max_length (param "
                             "tools), as OpenAI's API does past 128")
    parser.add_argument("--refuse-temperature", action="store_true",
                        help="refuse a request sending a temperature other than 1 with 400 unsupported_value (param "
                             "temperature), as OpenAI's reasoning models do")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"),
                        help="serve HTTPS with this certificate and key (PEM files), as an https:// backend does")
    args = parser.parse_args(argv)
    global MAX_TOOLS, USAGE_VARIES, USAGE_COUNTS, TOOLS_ARRAY_MAX, REFUSE_TEMPERATURE
    MAX_TOOLS, USAGE_VARIES, USAGE_COUNTS = args.max_tools, args.usage_varies, args.usage_counts
    TOOLS_ARRAY_MAX, REFUSE_TEMPERATURE = args.tools_array_max, args.refuse_temperature
    if args.trajectories:
        with open(args.trajectories) as f:
            for line in f:
                if line.strip():
                    entry = _dec(line)
                    TRAJECTORIES[entry["first_user"]] = entry["turns"]
                    if entry.get("users"):
                        TRAJECTORY_USERS[entry["first_user"]] = {str(u) for u in entry["users"]}
    TOKENIZE_ROUTES.clear()
    TOKENIZE_ROUTES.update(_TOKENIZE_CHOICES[args.tokenize])
    if args.breaking:
        with open(args.breaking) as f:
            BREAKING.extend(_dec(line) for line in f if line.strip())
    for path, entries in ((args.hidden_tools, HIDDEN_TOOLS), (args.needle, NEEDLES)):
        if path:
            with open(path) as f:
                entries.extend(_dec(line) for line in f if line.strip())
    if args.script:
        with open(args.script) as f:
            SCRIPT.extend(_dec(line) for line in f if line.strip())
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # --port 0: the kernel picks a free one, said on the line below
    sock.listen(2048)
    scheme = "https" if args.tls else "http"
    print(f"listening on {scheme}://{args.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(
        app,
        loop="uvloop",
        http=_protocol(),
        log_level="error",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=args.keep_alive,
        # a `hang` or a slow stream still open at SIGTERM is cut after a second (else the stop waited 10 s, then killed)
        timeout_graceful_shutdown=1,
        **({"ssl_certfile": args.tls[0], "ssl_keyfile": args.tls[1]} if args.tls else {}),
    )).run(sockets=[sock])


if __name__ == "__main__":
    main()
