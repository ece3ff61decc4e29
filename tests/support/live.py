"""Live scoring's test setup, shared by tests/live/: a config with a results store and a few profiles, answers built
from a BFCL case's ground truth (right, a wrong value, a wrong function), a request sent with the `openai` SDK and
the message the client got back, the verdict the scorer gives that message (computed in the test), and a process's
resident memory."""

from __future__ import annotations

import json
from pathlib import Path

import openai

MODEL = "fake-model"


def live_config(db, *, semantic: bool = True, workers: int = 2, queue_size: int = 1024) -> str:
    return f"""
[server]
model_allowlist = ["{MODEL}"]

[profiles.reversed]
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]

[profiles.removed]
perturbers = [{{ name = "tool_removal", params = {{ which = "expected" }} }}]

[profiles.python-text]
perturbers = [{{ name = "format_rewrite", params = {{ return_format = "python", parse = "lenient" }} }}]

[profiles.shadow-reversed]
mode = "shadow"
max_concurrent = 100
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]

[scoring]
store = "{db}"
workers = {workers}
queue_size = {queue_size}
semantic = {str(semantic).lower()}
"""


# --- answers, built from the ground truth -----------------------------------------------------


def gt_calls(case) -> list[dict]:
    """The ground truth as a model would answer it: OpenAI names, the first acceptable value of each parameter."""
    from toolquake.bfcl.convert import openai_name

    calls = []
    for entry in case.ground_truth:
        (name, params), = entry.items()
        args = {}
        for p, alternatives in params.items():
            value = alternatives[0]
            if value == "":  # "" first means the parameter may be left out
                continue
            args[p] = value
        calls.append({"name": openai_name(name), "arguments": args})
    return calls


def wrong_value(calls: list[dict]) -> list[dict]:
    out = json.loads(json.dumps(calls))
    first = out[0]["arguments"]
    key = next(iter(first))
    first[key] = "definitely-not-this" if isinstance(first[key], str) else 987654
    return out


def wrong_function(case, calls: list[dict]) -> list[dict]:
    from toolquake.bfcl.convert import to_openai_tools

    tools, _ = to_openai_tools(case.functions)
    other = next(t["function"]["name"] for t in tools if t["function"]["name"] != calls[0]["name"])
    return [{"name": other, "arguments": calls[0]["arguments"]}]


# --- what the client got ----------------------------------------------------------------------


def message_of(completion) -> dict:
    return completion.choices[0].message.model_dump(exclude_none=True)


def message_of_stream(chunks) -> dict:
    """The assistant message a streaming client reassembles from its deltas."""
    content, calls = "", {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"type": "function", "function": {"name": "", "arguments": ""}})
            if tc.function.name:
                slot["function"]["name"] += tc.function.name
            if tc.function.arguments:
                slot["function"]["arguments"] += tc.function.arguments
    msg: dict = {"role": "assistant"}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    else:
        msg["content"] = content
    return msg


def message_of_response(response) -> dict:
    """The chat message a Responses answer stands for (what the scorer reads)."""
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if item.type == "function_call"]
    return {"role": "assistant", "tool_calls": calls} if calls else {"role": "assistant", "content": ""}


def send(proxy, profile: str, body: dict, *, answer: dict | None, case_header: str | None, stream: bool,
         fault: str | None = None):
    """Send one request with the SDK; returns (request id, the message the client got)."""
    client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-live", max_retries=0)
    headers = {"X-Fake-Fault": fault} if fault else {}
    if answer is not None:
        headers["X-Fake-Answer"] = json.dumps(answer)
    if case_header:
        headers["X-Toolquake-Case"] = case_header
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=body["messages"], tools=body["tools"], stream=stream, extra_headers=headers)
    rid = raw.headers["x-toolquake-request-id"]
    parsed = raw.parse()
    return rid, (message_of_stream(list(parsed)) if stream else message_of(parsed))


def expected_verdict(case, message: dict, *, irrelevance: bool = False):
    """What the scorer says about `message` for `case` (BFCL mode), computed here from the same answer."""
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.bfcl.decode import calls_from_message
    from toolquake.scorers.ast_checker import check

    calls = calls_from_message(message, to_openai_tools(case.functions)[1])
    if irrelevance:  # a removed expected tool: the right answer is no call at all
        from toolquake.scorers.taxonomy import IRRELEVANCE_VIOLATION

        return ("invalid", IRRELEVANCE_VIOLATION) if message.get("tool_calls") else ("valid", None)
    v = check(case, calls, mode="bfcl")
    return ("valid" if v.valid else "invalid"), (None if v.valid else (v.taxonomy or v.error_type))


# --- the proxy's memory -----------------------------------------------------------------------


def rss(pid: int) -> int:
    """Resident bytes of `pid` and its children (a server with one worker may fork it)."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total
