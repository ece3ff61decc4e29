"""Traces read back from a real Arize Phoenix (`make phoenix`: Phoenix in a virtual environment of its own).

`phoenix serve` runs as a child of this test (it dies with it); the proxy exports to its OTLP/HTTP endpoint.
An openai-SDK agent loop (the fake upstream's scripted agent: call a tool, then another after its result, then
answer) runs through the proxy under a profile that adds a tool the model calls first (the proxy answers that
call itself) with live scoring of a case of our own, on both APIs, streamed and not, each run under a trace id
of the test's. Read back through Phoenix's REST API: every span of the run is in the client's trace; each
request the client sent is one request span, a child of the client's span, with the `gen_ai.*` and
`toolquake.*` attributes the test computes from what the client got; the upstream call, the proxy's follow-up
and its execute_tool are child spans, and the backend got the context of the span that called it; the verdict
of the case is on the first request's span. A shadow profile's twins are child spans with their consistency
on the request span. No prompt or answer content unless `[tracing] contents = true` (then redacted), and never
the client's API key.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support import Proc, recorded, start_proxy, wait_for
from tests.support.ports import listening_ports
from toolquake.proxy.backend.local import die_with_parent_preexec

pytestmark = [pytest.mark.slow, pytest.mark.phoenix]  # Phoenix takes 20-60 s to start on 2 cores

CACHE = Path(os.environ.get("TOOLQUAKE_CACHE") or Path.home() / ".cache" / "toolquake")
PHOENIX = Path(os.environ.get("TOOLQUAKE_PHOENIX") or CACHE / "phoenix" / "venv" / "bin" / "phoenix")
PROJECT = "toolquake-tests"
API_KEY = "sk-tracing-test-0123456789abcdef0123456789abcdef"
QUESTION = "Weather and time in Oslo?"
PLAN = "zz_lookup_archive,get_weather,get_time"  # the model calls the tool the proxy added first, at every turn
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n[4:]} in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for n in ("get_weather", "get_time")]
TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
CASE = {"id": "trace-weather", "category": "tracing", "messages": [{"role": "user", "content": QUESTION}],
        "tools": CHAT_TOOLS, "expected": [{"name": "get_weather", "arguments": {"city": ["example"]}}]}
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions", "input.value")


def config(endpoint: str, contents: bool = False) -> str:
    return f"""
[server]
plugins = ["tests.plugins.adds_tool"]

[scoring]
semantic = false

[tracing]
enabled = true
contents = {str(contents).lower()}
OTEL_EXPORTER_OTLP_ENDPOINT = "{endpoint}"
OTEL_BSP_SCHEDULE_DELAY = "100"
OTEL_RESOURCE_ATTRIBUTES = "openinference.project.name={PROJECT}"

[profiles.invented]
perturbers = [{{ name = "test_adds_tool" }}]

[profiles.shadowed]
mode = "shadow"
sample_rate = 1.0
noise_rate = 1.0
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
"""


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory) -> Iterator[str]:
    if not PHOENIX.exists():
        pytest.skip(f"no Arize Phoenix at {PHOENIX} (`make phoenix` installs it in a virtual environment of its own)")
    work = tmp_path_factory.mktemp("phoenix")
    # port 0 for both servers (HTTP and gRPC): the kernel picks free ones, so no port is picked here and taken by
    # someone else before Phoenix binds it; Phoenix does not say which it got (its banner says :0), so they are
    # read from /proc (the sockets its process listens on) and the HTTP one is the one that answers /healthz
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(work), "PHOENIX_PORT": "0", "PHOENIX_GRPC_PORT": "0",
           "PHOENIX_HOST": "127.0.0.1", "PHOENIX_TELEMETRY_ENABLED": "false"}
    log = (work / "phoenix.log").open("wb")
    proc = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda parent=os.getpid(): die_with_parent_preexec(parent))

    def healthy() -> str | None:
        if proc.poll() is not None:
            pytest.fail(f"phoenix serve exited with {proc.returncode}:\n{(work / 'phoenix.log').read_text()}")
        for port in listening_ports(proc.pid):
            url = f"http://127.0.0.1:{port}"
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        return None

    try:
        try:
            url = wait_for(healthy, 180, "phoenix serve to answer /healthz", interval=0.5)
        except AssertionError as exc:
            pytest.fail(f"{exc}:\n{(work / 'phoenix.log').read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _proxy(fake_upstream: Proc, phoenix: str, contents: bool, tmp: Path) -> Proc:
    cases = tmp / "cases.jsonl"
    cases.write_text(json.dumps(CASE) + "\n")
    return start_proxy(fake_upstream.url, config(phoenix, contents), None, "--cases", str(cases),
                       "--results-db", str(tmp / "results.sqlite"))


@pytest.fixture(scope="module")
def tq(fake_upstream, phoenix, tmp_path_factory) -> Iterator[Proc]:
    proc = _proxy(fake_upstream, phoenix, False, tmp_path_factory.mktemp("tq"))
    yield proc
    proc.stop()


def traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent, f"00-{trace_id}-{parent}-01"


def run_tool(name: str, arguments: str) -> str:
    city = json.loads(arguments or "{}").get("city", "?")
    return f"rain in {city}" if name == "get_weather" else f"noon in {city}"


def chat_turn(client: Any, messages: list[dict], stream: bool) -> dict[str, Any]:
    """One request of the loop: what the client got (id, model, finish reasons, usage, calls)."""
    kw = dict(model="fake-model", messages=messages, tools=CHAT_TOOLS)
    if not stream:
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        usage = (r.usage.prompt_tokens, r.usage.completion_tokens) if r.usage else None
        return dict(id=r.id, model=r.model, finish=[c.finish_reason for c in r.choices], usage=usage, calls=calls)
    got: dict[str, Any] = dict(id=None, model=None, finish=[], usage=None)
    parts: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        got["id"], got["model"] = chunk.id, chunk.model
        if chunk.usage:
            got["usage"] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        for choice in chunk.choices:
            if choice.finish_reason:
                got["finish"].append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                part = parts.setdefault(d.index, [None, "", ""])
                part[0] = d.id or part[0]
                part[1] += (d.function.name or "") if d.function else ""
                part[2] += (d.function.arguments or "") if d.function else ""
    got["calls"] = [tuple(p) for _, p in sorted(parts.items())]
    return got


def responses_turn(client: Any, items: list[dict], stream: bool) -> dict[str, Any]:
    kw = dict(model="fake-model", input=items, tools=TOOLS)
    r = list(client.responses.create(stream=True, **kw))[-1].response if stream else client.responses.create(**kw)
    calls = [(o.call_id, o.name, o.arguments) for o in r.output if o.type == "function_call"]
    usage = (r.usage.input_tokens, r.usage.output_tokens) if r.usage else None
    # a Responses answer has no finish reason: toolquake's chat form says tool_calls or stop (docs/tracing.md)
    return dict(id=r.id, model=r.model, finish=["tool_calls" if calls else "stop"], usage=usage, calls=calls)


def agent_run(url: str, profile: str, api: str, stream: bool, tag: str, tp: str, **headers: str) -> list[dict]:
    """The agent's loop to its final answer; what the client got at each request."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/p/{profile}/v1", api_key=API_KEY, max_retries=0, default_headers={
        "traceparent": tp, "x-test-tag": tag, "x-fake-agent": PLAN, "x-toolquake-case": CASE["id"], **headers})
    got: list[dict] = []
    convo: list[dict] = [{"role": "user", "content": QUESTION}]
    for _ in range(6):
        turn = chat_turn(client, convo, stream) if api == "chat" else responses_turn(client, convo, stream)
        got.append(turn)
        if not turn["calls"]:
            return got
        if api == "chat":
            convo.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in turn["calls"]]})
            convo += [{"role": "tool", "tool_call_id": i, "content": run_tool(n, a)} for i, n, a in turn["calls"]]
        else:
            convo += [{"type": "function_call", "call_id": i, "name": n, "arguments": a} for i, n, a in turn["calls"]]
            convo += [{"type": "function_call_output", "call_id": i, "output": run_tool(n, a)}
                      for i, n, a in turn["calls"]]
    raise AssertionError(f"the agent loop did not end: {got}")


def value(v: dict) -> Any:
    for key in ("string_value", "int_value", "double_value", "bool_value"):
        if v.get(key) is not None:
            return v[key]
    if v.get("array_value"):
        return [value(x) for x in v["array_value"].get("values") or []]
    return None


def spans_of(phoenix: str, trace_id: str, at_least: int, settle_s: float = 1.5) -> list[dict]:
    """The trace's spans as Phoenix has them, once at least `at_least` arrived and no more came for a while.
    (Neither the proxy nor Phoenix says when the last span of a trace is stored; `at_least` is the count the test
    expects, each test then checks the exact spans, and the pause only gives a wrong extra span its chance to show
    up: a test never passes because of it.)"""
    deadline, seen, stable_since = time.monotonic() + 60, -1, time.monotonic()
    while True:
        got = httpx.get(f"{phoenix}/v1/projects/{PROJECT}/spans/otlpv1",
                        params={"trace_id": trace_id, "limit": 1000}, timeout=10)
        data = got.json().get("data", []) if got.status_code == 200 else []
        if len(data) != seen:
            seen, stable_since = len(data), time.monotonic()
        if len(data) >= at_least and time.monotonic() - stable_since >= settle_s:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(data)} spans of trace {trace_id} in Phoenix, expected at least {at_least}")
        time.sleep(0.3)
    for span in data:
        span["attrs"] = {a["key"]: value(a["value"]) for a in span.get("attributes") or []}
    return data


def named_span(phoenix: str, name: str, trace_spans: int) -> tuple[dict, list[dict]]:
    """The one span of this name in Phoenix and the spans of its trace (at least `trace_spans` of them), waited
    for: Phoenix stores what it received a moment later (a process that exported its spans and exited may be
    ahead of Phoenix's own writes). The name is looked up again once the whole trace is stored (what the process
    sent with the span, stored by then): still one span of that name."""
    def look() -> list[dict]:
        got = httpx.get(f"{phoenix}/v1/projects/{PROJECT}/spans/otlpv1", params={"name": name, "limit": 100},
                        timeout=10)
        return got.json().get("data", []) if got.status_code == 200 else []

    found = wait_for(look, 60, f"a span named {name!r} in Phoenix", interval=0.3)[0]
    spans = spans_of(phoenix, found["trace_id"], at_least=trace_spans)
    data = look()
    assert len(data) == 1, data
    return found, spans


def upstream_requests(fake: Proc, tag: str) -> list[dict]:
    return [r for r in recorded(fake, tag) if r["path"].startswith("/v1/")]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_agent_run_is_one_trace_with_the_proxy_spans_phoenix_shows(tq, fake_upstream, phoenix, api, stream):
    tag = secrets.token_hex(6)
    trace_id, client_span, tp = traceparent()
    got = agent_run(tq.url, "invented", api, stream, tag, tp)
    n = len(got)  # requests the client sent: each one request span, its upstream call, a follow-up, an execute_tool
    spans = spans_of(phoenix, trace_id, at_least=4 * n + 1)
    by_id = {s["span_id"]: s for s in spans}
    assert {s["trace_id"] for s in spans} == {trace_id}
    requests = sorted((s for s in spans if s["parent_span_id"] == client_span), key=lambda s: s["start_time_unix_nano"])
    assert len(requests) == n, [s["name"] for s in spans]
    path = "/v1/chat/completions" if api == "chat" else "/v1/responses"
    for i, (span, turn) in enumerate(zip(requests, got)):
        a = span["attrs"]
        assert span["name"] == "chat fake-model"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "fake-model"
        assert a["gen_ai.response.model"] == turn["model"] and a["gen_ai.response.id"] == turn["id"]
        assert a["gen_ai.response.finish_reasons"] == turn["finish"]
        if turn["usage"] is not None:
            assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == turn["usage"]
        assert a["gen_ai.request.stream"] is stream and a["server.address"] == "127.0.0.1"
        assert a["server.port"] == int(fake_upstream.url.rsplit(":", 1)[1])
        assert a["toolquake.profile"] == "invented" and a["toolquake.mode"] == "perturb"
        assert a["toolquake.route"] == ("chat_completions" if api == "chat" else "responses")
        assert a["toolquake.perturbers"] == ["test_adds_tool"]
        assert a["toolquake.perturber.test_adds_tool.tools_added"] == ["zz_lookup_archive"]
        assert a["toolquake.injected_calls"] == ["zz_lookup_archive"]
        assert a["toolquake.answer.tool_calls"] == [c[1] for c in turn["calls"]]
        assert a["toolquake.conformance.checked"] is True and a["http.response.status_code"] == 200
        children = [s for s in spans if s["parent_span_id"] == span["span_id"]]
        names = sorted(s["name"] for s in children)
        expected = sorted([f"POST {path}", f"POST {path}", "execute_tool zz_lookup_archive"] +
                          (["score live"] if i == 0 else []))
        assert names == expected
        followup = next(s for s in children if s["attrs"].get("toolquake.followup.round") == 1)
        assert followup["attrs"]["http.response.status_code"] == 200
        tool = next(s for s in children if s["name"].startswith("execute_tool"))
        assert tool["attrs"]["gen_ai.operation.name"] == "execute_tool"
        assert tool["attrs"]["gen_ai.tool.name"] == "zz_lookup_archive"
    # the case's verdict: the first request is the case's own turn (the later ones are its follow-ups)
    first = requests[0]["attrs"]
    assert first["toolquake.case_id"] == CASE["id"] and first["toolquake.verdict.case_id"] == CASE["id"]
    final_call = got[0]["calls"][0]
    assert first["toolquake.verdict.valid"] is (final_call[1] == "get_weather" and
                                                json.loads(final_call[2]) == {"city": "example"})
    assert all("toolquake.verdict.valid" not in s["attrs"] for s in requests[1:])
    # every request the backend got carried the context of the proxy span that sent it
    sent = upstream_requests(fake_upstream, tag)
    assert len(sent) == 2 * n
    for body in sent:
        version, tid, parent, flags = body["headers"]["traceparent"].split("-")
        assert tid == trace_id and by_id[parent]["name"] == f"POST {path}"
        assert by_id[by_id[parent]["parent_span_id"]]["parent_span_id"] == client_span
    dump = json.dumps(spans)
    assert API_KEY not in dump and API_KEY[3:] not in dump and "Bearer" not in dump
    assert QUESTION not in dump and "rain in" not in dump and "noon in" not in dump
    assert not any(k in s["attrs"] for s in spans for k in CONTENT_KEYS)


def test_shadow_twins_are_child_spans_with_their_consistency(tq, fake_upstream, phoenix):
    tag = secrets.token_hex(6)
    trace_id, client_span, tp = traceparent()
    table = {"get_weather": {"calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
             "get_time": {"calls": [{"name": "get_time", "arguments": {"city": "Oslo"}}]}}
    import openai

    client = openai.OpenAI(base_url=f"{tq.url}/p/shadowed/v1", api_key=API_KEY, max_retries=0, default_headers={
        "traceparent": tp, "x-test-tag": tag, "x-fake-answer-by-first-tool": json.dumps(table),
        "x-toolquake-case": CASE["id"]})
    answer = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": QUESTION}],
                                            tools=CHAT_TOOLS)
    spans = spans_of(phoenix, trace_id, at_least=4)
    (request,) = [s for s in spans if s["parent_span_id"] == client_span]
    children = {s["name"]: s for s in spans if s["parent_span_id"] == request["span_id"]}
    assert {"shadow twin", "shadow noise", "POST /v1/chat/completions"} <= set(children)
    # the twin's tools are reversed: its first tool is the client's last, whose answer the table gives
    original = answer.choices[0].message.tool_calls[0].function.name
    twin_first = CHAT_TOOLS[-1]["function"]["name"]
    a = request["attrs"]
    assert a["toolquake.mode"] == "shadow"
    assert a["toolquake.shadow.agree"] is (table[twin_first]["calls"][0]["name"] == original)
    assert a["toolquake.noise.agree"] is True
    twin = children["shadow twin"]["attrs"]
    assert twin["toolquake.shadow.kind"] == "twin" and twin["toolquake.perturbers"] == ["tool_order"]
    assert twin["toolquake.answer.tool_calls"] == [twin_first]
    assert children["shadow noise"]["attrs"]["toolquake.shadow.kind"] == "noise"
    parents = {b["headers"]["traceparent"].split("-")[2] for b in upstream_requests(fake_upstream, tag)}
    assert parents == {children["shadow twin"]["span_id"], children["shadow noise"]["span_id"],
                       children["POST /v1/chat/completions"]["span_id"]}
    assert API_KEY not in json.dumps(spans)


def test_contents_only_when_enabled_and_redacted(fake_upstream, phoenix, tmp_path):
    proc = _proxy(fake_upstream, phoenix, True, tmp_path)
    try:
        secret = "sk-proj-" + secrets.token_hex(24)
        tag = secrets.token_hex(6)
        trace_id, client_span, tp = traceparent()
        import openai

        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=API_KEY, max_retries=0,
                               default_headers={"traceparent": tp, "x-test-tag": tag})
        prompt = f"My key is {secret}; what is the weather in Oslo?"
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": prompt}],
                                       tools=CHAT_TOOLS)
        spans = spans_of(phoenix, trace_id, at_least=2)
    finally:
        proc.stop()
    (request,) = [s for s in spans if s["parent_span_id"] == client_span]
    a = request["attrs"]
    messages = json.loads(a["gen_ai.input.messages"])
    assert messages[0]["role"] == "user" and "what is the weather in Oslo?" in messages[0]["parts"][0]["content"]
    assert [p["name"] for m in json.loads(a["gen_ai.output.messages"]) for p in m["parts"]
            if p["type"] == "tool_call"] == ["get_weather"]
    assert "get_time" in a["gen_ai.tool.definitions"]
    dump = json.dumps(spans)
    assert secret not in dump and "[redacted]" in a["gen_ai.input.messages"] and API_KEY not in dump


def test_the_trace_in_phoenix_ui_screenshot(tq, fake_upstream, phoenix, tmp_path):
    """Phoenix's UI shows the trace (headless Chromium; the picture is kept under TOOLQUAKE_SCREENSHOT_DIR)."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install -y chromium; `make tools`)")
    tag = secrets.token_hex(6)
    trace_id, _, tp = traceparent()
    got = agent_run(tq.url, "invented", "chat", False, tag, tp)
    spans_of(phoenix, trace_id, at_least=4 * len(got) + 1)
    project = httpx.get(f"{phoenix}/v1/projects/{PROJECT}").json()["data"]["id"]
    out = Path(os.environ.get("TOOLQUAKE_SCREENSHOT_DIR") or tmp_path) / "phoenix-trace.png"
    profile = tempfile.mkdtemp(prefix="chromium-")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                    "--window-size=1600,1000", "--virtual-time-budget=15000", f"--screenshot={out}",
                    f"{phoenix}/projects/{project}/traces/{trace_id}"], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(profile, ignore_errors=True)
    assert out.exists() and out.stat().st_size > 20_000  # a rendered page, not a blank one


def test_replay_is_one_trace_per_case_with_a_span_per_arm(fake_upstream, phoenix, tmp_path):
    from tests.support.replay import replay, rows

    second = {**CASE, "id": "trace-time", "messages": [{"role": "user", "content": "Time in Oslo?"}],
              "expected": [{"name": "get_time", "arguments": {"city": ["example"]}}]}
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(CASE) + "\n" + json.dumps(second) + "\n")
    cfg = tmp_path / "replay.toml"
    cfg.write_text(config(phoenix) + '\n[profiles.shuffled]\nperturbers = [{ name = "tool_order", params = '
                   '{ mode = "reverse" } }]\n')
    out = tmp_path / "run"
    r = replay("--backend", f"{fake_upstream.url}/v1", "--profiles", "off,shuffled", "--config", str(cfg),
               "--cases", str(cases), "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = {(x["case_id"], x["profile"]): x for x in rows(out)}
    for case in (CASE, second):
        # the case, two arms, each a request and its call
        found, spans = named_span(phoenix, f"replay case {case['id']}", trace_spans=7)
        arms = {s["name"]: s for s in spans if s["parent_span_id"] == found["span_id"]}
        assert set(arms) == {"replay off", "replay shuffled"}
        for profile in ("off", "shuffled"):
            arm = arms[f"replay {profile}"]
            row = got[(case["id"], profile)]
            assert arm["attrs"]["toolquake.verdict.valid"] is bool(row["valid"])
            assert arm["attrs"]["toolquake.request_id"] == row["request_id"]
            (request,) = [s for s in spans if s["parent_span_id"] == arm["span_id"]]
            assert request["attrs"]["toolquake.profile"] == profile
            assert request["attrs"]["toolquake.request_id"] == row["request_id"]


@pytest.mark.needs_embeddings  # the tools axis pads with catalog_padding, which draws tools by embeddings
def test_sweep_is_one_trace_per_case_with_a_span_per_point_asked(phoenix, tmp_path):
    """`toolquake sweep` traced: one trace per case, its span ending with the breaking point the results file
    holds, and one child span per request the sweep recorded (a point asked), each with its verdict."""
    from tests.support import start_fake_upstream
    from tests.support.sweep import breaking_file as _breaking_file
    from tests.support.sweep import cases_file as _cases_file
    from tests.support.sweep import first_wrong as _first_wrong
    from tests.support.sweep import stored, sweep

    hidden = {"t-5": [[6, None]], "t-never": []}
    fake = start_fake_upstream("--breaking", str(_breaking_file(hidden, "tools")))
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(config(phoenix))
    out = tmp_path / "sweep"
    try:
        r = sweep("--backend", f"{fake.url}/v1", "--config", str(cfg), "--cases", str(_cases_file(list(hidden))),
                  "--axis", "tools", "--min", "1", "--max", "20", "--out", str(out))
    finally:
        fake.stop()
    assert r.returncode == 0, r.stderr
    found = stored(out)
    for cid in hidden:
        points = {x: rows[0][1] for x, rows in found[cid].items()}
        # the case, and per point asked: the sweep's request span, the proxy's and its upstream call
        named, spans = named_span(phoenix, f"sweep case {cid}", trace_spans=1 + 3 * len(points))
        (case_span,) = [s for s in spans if s["span_id"] == named["span_id"]]
        attrs = case_span["attrs"]
        assert attrs["toolquake.sweep.axis"] == "tools" and attrs["toolquake.sweep.finished"] is True
        first_wrong = _first_wrong(points)
        assert attrs.get("toolquake.sweep.first_wrong") == first_wrong
        assert attrs.get("toolquake.sweep.last_right") == max(x for x, ok in points.items()
                                                              if first_wrong is None or x < first_wrong)
        asked = {s["name"]: s for s in spans if s["parent_span_id"] == case_span["span_id"]}
        assert len(asked) == len(points)
        for x, ok in points.items():
            span = asked[f"sweep sweep-tools-{x:g}"]
            assert span["attrs"]["toolquake.verdict.valid"] is ok
            (request,) = [s for s in spans if s["parent_span_id"] == span["span_id"]]
            assert request["attrs"]["toolquake.profile"] == f"sweep-tools-{x:g}"
