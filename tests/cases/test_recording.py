"""`toolquake serve --record`: a real `openai` SDK agent loop through the proxy against the fake upstream.
The recording holds exactly the exchanges made (chat and Responses, streamed and not), no secret, nothing
torn after a SIGKILL; `toolquake cases from-recording` turns it into cases that replay as right answers."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from openai import OpenAI

from tests.support import metric_samples, metrics_text, scraped, start_proxy, wait_for
from tests.support.cases import RECORD_TOOLS, read_records, toolquake
from tests.support.replay import replay, rows

API_KEY = "sk-test-SECRETKEY0123456789abcdef"
SEED_SECRET = "seed-secret-5f2a91"
MARKED = "TOKEN-4711-ZQX"  # a value the [record] redact pattern removes from message contents
PLAN = "get_weather,get_time"
TOOLS = RECORD_TOOLS
CONFIG = """
[record]
redact = ["TOKEN-[0-9]+-[A-Z]+"]

[profiles.reversed]
perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]
"""


def client(proxy_url: str) -> OpenAI:
    return OpenAI(base_url=f"{proxy_url}/v1", api_key=API_KEY, max_retries=0,
                  default_headers={"X-Fake-Agent": PLAN, "X-Toolquake-Seed": SEED_SECRET,
                                   "X-Toolquake-Conversation": SEED_SECRET})


def _streamed(stream) -> tuple[str | None, list[dict]]:
    content, calls = None, {}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.id or slot["id"]
            if tc.function and tc.function.name:
                slot["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["function"]["arguments"] += tc.function.arguments
    return content, [calls[i] for i in sorted(calls)]


def chat_agent(sdk: OpenAI, question: str, stream: bool, exchanges: list) -> None:
    """The agent loop: ask, run the tools the model calls, ask again, until a text answer."""
    messages = [{"role": "system", "content": "You are a travel agent."}, {"role": "user", "content": question}]
    for _ in range(5):
        sent = json.loads(json.dumps(messages))
        if stream:
            content, calls = _streamed(sdk.chat.completions.create(model="fake-model", messages=messages,
                                                                   tools=TOOLS, stream=True))
        else:
            msg = sdk.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS).choices[0].message
            content = msg.content
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                    "arguments": c.function.arguments}}
                     for c in msg.tool_calls or []]
        exchanges.append({"api": "chat_completions", "stream": stream, "messages": sent, "step": len(sent),
                          "question": question, "content": content,
                          "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]})
        if not calls:
            return
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['function']['name']}"})


def responses_agent(sdk: OpenAI, question: str, stream: bool, exchanges: list) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list = [{"role": "user", "content": question}]
    for _ in range(5):
        if stream:
            events = sdk.responses.create(model="fake-model", input=items, tools=tools, stream=True)
            resp = next(e.response for e in events if e.type == "response.completed")
        else:
            resp = sdk.responses.create(model="fake-model", input=items, tools=tools)
        calls = [o for o in resp.output if o.type == "function_call"]
        exchanges.append({"api": "responses", "stream": stream, "question": question, "step": len(items),
                          "content": resp.output_text or None,
                          "calls": [(c.name, json.loads(c.arguments)) for c in calls]})
        if not calls:
            return
        for c in calls:
            items.append({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments})
            items.append({"type": "function_call_output", "call_id": c.call_id, "output": f"result of {c.name}"})


def test_an_agent_loop_is_recorded_exactly_and_becomes_cases_that_replay(fake_upstream, tmp_path):
    recording = tmp_path / "staging.jsonl"
    proxy = start_proxy(fake_upstream.url, CONFIG, None, "--record", str(recording))
    exchanges: list[dict] = []
    try:
        sdk = client(proxy.url)
        chat_agent(sdk, "Weather and time in Paris?", False, exchanges)
        chat_agent(sdk, "Weather and time in Rome?", True, exchanges)
        chat_agent(sdk, "Weather and time in Paris?", False, exchanges)  # the same conversation again
        chat_agent(sdk, f"My booking code is {MARKED}, key {API_KEY}: weather in Oslo?", False, exchanges)
        responses_agent(sdk, "Weather and time in Lima?", False, exchanges)
        responses_agent(sdk, "Weather and time in Quito?", True, exchanges)
        # a perturbed exchange is not recorded
        perturbed = client(proxy.url).with_options(base_url=f"{proxy.url}/p/reversed/v1")
        chat_agent(perturbed, "Weather in Bern, reversed?", False, [])
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total") >= len(exchanges), what="every exchange recorded")
        recorded_total = {dict(labels)["route"]: value for (name, labels), value
                          in metric_samples(metrics_text(proxy)).items() if name == "toolquake_recorded_total"}
    finally:
        proxy.stop()
    assert len(exchanges) == 6 * 3  # each loop: call, call, final text
    records = read_records(recording)
    assert len(records) == len(exchanges)
    assert recorded_total == {"chat_completions": 12.0, "responses": 6.0}
    # the workers of `serve` (one per CPU) append in the order they finish: match records by what they hold
    def user_text(rec: dict) -> str:
        return next(m["content"] for m in rec["request"]["messages"] if m["role"] == "user")

    def step(rec: dict) -> int:
        return len(rec["request"]["messages"]) - (1 if rec["route"] == "chat_completions" else 0)

    records = sorted(records, key=lambda r: (r["route"], user_text(r), step(r)))
    exchanges = sorted(exchanges, key=lambda e: (e["api"], e["question"], e["step"] - (e["api"] == "chat_completions")))
    for rec, ex in zip(records, exchanges):
        assert rec["route"] == ex["api"] and rec["stream"] == ex["stream"] and rec["profile"] == "off"
        message = rec["answer"]["message"]
        got_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in message.get("tool_calls") or []]
        assert got_calls == ex["calls"]
        assert (message.get("content") or None) == ex["content"]
        assert rec["request"]["tools"] == TOOLS
        if ex["api"] == "chat_completions" and MARKED not in json.dumps(ex["messages"]):
            assert rec["request"]["messages"] == ex["messages"]
        if ex["api"] == "responses":
            assert [m["role"] for m in rec["request"]["messages"]][0] == "user"
            assert rec["request"]["messages"][0]["content"] == ex["question"]
    text = recording.read_text()
    for secret in (API_KEY, SEED_SECRET, MARKED, "Bearer", "authorization", "x-toolquake", "fake-agent"):
        assert secret.lower() not in text.lower(), secret
    assert text.count("[redacted]") >= 2 * 3  # the booking code and the key, in each of that loop's requests

    cases = tmp_path / "cases.jsonl"
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases), "--category", "travel")
    assert r.returncode == 0, r.stderr
    made = [json.loads(line) for line in cases.read_text().splitlines()]
    assert len(made) == len(exchanges) - 3  # the repeated Paris loop adds nothing
    assert "3 duplicate(s)" in r.stderr
    assert sum(c["expected"] == "no call" for c in made) == 5
    for c in made:
        assert c["category"] == "travel"
        if c["expected"] != "no call":
            assert [e["name"] for e in c["expected"]] in (["get_weather"], ["get_time"])
            assert "call" in c["tags"] and f"tool:{c['expected'][0]['name']}" in c["tags"]
    assert toolquake("cases", "validate", str(cases)).returncode == 0
    only = tmp_path / "weather.jsonl"
    r = toolquake("cases", "from-recording", str(recording), "--out", str(only), "--tools", "get_weather",
                  "--loosen-strings")
    assert r.returncode == 0, r.stderr
    weather = [json.loads(line) for line in only.read_text().splitlines()]
    assert len(weather) == 5 and all(c["expected"][0]["name"] == "get_weather" for c in weather)
    assert all("category" not in c for c in weather)  # no --category: the cases file's stem
    assert set(weather[0]["expected"][0]["arguments"]["city"]) == {"example", "EXAMPLE", "Example"}

    # the same agent (the same answers) replayed against its own cases: every answer is right
    out = tmp_path / "replay"
    r = replay("--backend", f"{fake_upstream.url}/v1", "--profiles", "off", "--cases", str(cases), "--out", str(out),
               "--header", f"X-Fake-Agent: {PLAN}")
    assert r.returncode == 0, r.stderr
    got = rows(out)
    assert len(got) == len(made) and all(x["status"] == "scored" and x["valid"] == 1 for x in got), got


def test_sigkill_mid_run_leaves_no_torn_record_and_the_cap_is_kept(fake_upstream, tmp_path):
    recording = tmp_path / "killed.jsonl"
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    big = "x" * 200_000  # large records: a kill is likely to land while one is being written
    stop = threading.Event()
    sent = [0]

    def hammer() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                try:
                    http.post(f"{proxy.url}/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": f"{sent[0]} {big}"}], "tools": TOOLS})
                    sent[0] += 1
                except httpx.HTTPError:
                    return

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: recording.exists() and recording.stat().st_size >= 3_000_000, timeout=60,
             what="3 MB recorded", interval=0.01)
    proxy.popen.send_signal(signal.SIGKILL)
    proxy.popen.wait(10)
    stop.set()
    for t in threads:
        t.join(15)
    from toolquake.proxy.live.recording import read_recording

    after_kill = read_recording(recording)
    assert after_kill.problems == [] and after_kill.torn <= 1
    assert 10 <= len(after_kill.records) <= sent[0] + 4
    assert all(len(r["request"]["messages"][0]["content"]) > 200_000 for r in after_kill.records)
    # a torn tail (as a kill during a write leaves it) is cut when the proxy opens the recording again
    whole = len(recording.read_bytes())
    with open(recording, "ab") as f:
        f.write(b'{"v":1,"ts":1.0,"request":{"messages":[{"role":"us')
    cap = whole + 3 * 1024
    proxy = start_proxy(fake_upstream.url, f'[record]\nmax_size = {cap}\n', None, "--record", str(recording))
    try:
        for i in range(40):
            httpx.post(f"{proxy.url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": f"small {i}"}], "tools": TOOLS}, timeout=10)
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total")
                 + scraped(proxy, "toolquake_record_dropped_total") >= 40, what="every exchange recorded or dropped")
        recorded = scraped(proxy, "toolquake_recorded_total")
        dropped = scraped(proxy, "toolquake_record_dropped_total", reason="size_cap")
    finally:
        proxy.stop()
    final = read_records(recording)  # no torn line left, nothing unreadable
    assert recording.stat().st_size <= cap
    assert recorded + dropped == 40 and dropped > 0 and recorded > 0
    assert len(final) == len(after_kill.records) + recorded


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to make every write fail")
def test_a_recording_that_cannot_be_written_never_breaks_a_request(fake_upstream):
    proxy = start_proxy(fake_upstream.url, None, None, "--record", "/dev/full")  # every write: ENOSPC
    try:
        sdk = client(proxy.url)
        for i in range(3):
            answer = sdk.chat.completions.create(model="fake-model", tools=TOOLS,
                                                 messages=[{"role": "user", "content": f"question {i}"}])
            assert answer.choices[0].message.tool_calls
        wait_for(lambda: scraped(proxy, "toolquake_record_dropped_total") >= 3, what="three drops")
        assert scraped(proxy, "toolquake_record_dropped_total") == 3
        assert scraped(proxy, "toolquake_record_dropped_total", reason="write_error") == 3
        assert scraped(proxy, "toolquake_recorded_total") == 0
    finally:
        proxy.stop()


def test_only_the_configured_profiles_are_recorded(fake_upstream, tmp_path):
    recording = tmp_path / "quiet.jsonl"
    config = '[profiles.quiet]\nmode = "off"\n\n[record]\nprofiles = ["qu*"]\n'
    proxy = start_proxy(fake_upstream.url, config, None, "--record", str(recording))
    try:
        for base in ("/v1", "/p/quiet/v1", "/v1", "/p/quiet/v1"):
            r = httpx.post(f"{proxy.url}{base}/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": f"via {base}"}], "tools": TOOLS})
            assert r.status_code == 200
        # the last request is one of a recorded profile: once it is written, every request before it was seen
        # (handed to the recorder in order, before its answer went out; written in that order)
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total") == 2, what="the quiet exchanges recorded")
    finally:  # stopping drains the recorder's queue: anything else it had taken would be in the file now
        proxy.stop()
    records = read_records(recording)
    assert [(r["profile"], r["request"]["messages"][0]["content"]) for r in records] == [
        ("quiet", "via /p/quiet/v1")] * 2


def test_a_sample_rate_of_zero_records_nothing_and_counts_every_exchange(fake_upstream, tmp_path):
    recording = tmp_path / "sampled.jsonl"
    proxy = start_proxy(fake_upstream.url, "[record]\nsample_rate = 0.0\n", None, "--record", str(recording))
    try:
        for i in range(5):
            r = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": f"sampled {i}"}], "tools": TOOLS})
            assert r.status_code == 200
        wait_for(lambda: scraped(proxy, "toolquake_record_dropped_total") >= 5, what="five exchanges counted")
        assert scraped(proxy, "toolquake_record_dropped_total") == 5
        assert scraped(proxy, "toolquake_record_dropped_total", reason="sampled_out") == 5
    finally:
        proxy.stop()
    assert read_records(recording) == []  # the header line alone
    assert list(map(json.loads, recording.read_text().splitlines()))[0]["toolquake_recording"] == 1
