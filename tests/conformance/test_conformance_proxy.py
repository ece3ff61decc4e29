"""The conformance checker on the relay path: the fake upstream (its own process) breaks the tool-call format
on request (`X-Fake-Broken`), the proxy relays it to the client byte for byte, and counts and stores the
rule each shape breaks — and nothing on well-formed answers."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest

from tests.support import Proc, metric_samples, metrics_text, scraped, wait_for
from tests.support import tracing as tracing_support
from tests.support.tracing import sink_spans

MODEL = "conf-model"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
NESTED = {"type": "object", "properties": {
    "event": {"type": "object", "properties": {"title": {"type": "string"},
                                               "attendees": {"type": "array", "items": {"type": "string"}}},
              "required": ["title"]}}, "required": ["event"]}
TOOLS = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {}}, "create_event": NESTED}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
RESP_TOOLS = [{"type": "function", "name": n, "parameters": p} for n, p in TOOLS.items()]
TWO_CALLS = json.dumps({"calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                  {"name": "create_event", "arguments": {"event": {"title": "x",
                                                                                   "attendees": ["a"]}}}]})
PING = json.dumps({"calls": [{"name": "ping", "arguments": {}}]})
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def text(t: str) -> str:
    return json.dumps({"text": t})


def config(db: Path, *, contents: bool = False) -> str:
    return f"""
[server]
model_allowlist = ["{MODEL}"]

[profiles.fixed]
mode = "off"
repair = true

[scoring]
store = "{db}"
store_contents = {str(contents).lower()}
match_content = false
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conformance") / "results.sqlite"


@pytest.fixture(scope="module")
def checked(fake_upstream: Proc, db: Path):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, config(db))
    yield proc
    proc.stop()


def body(route: str, stream: bool) -> dict:
    if route == "responses":
        return {"model": MODEL, "input": "weather in Paris?", "tools": RESP_TOOLS, "stream": stream}
    return {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": CHAT_TOOLS,
            "stream": stream}


def send(base: str, route: str, stream: bool, headers: dict[str, str], prefix: str = "") -> httpx.Response:
    path = "/v1/responses" if route == "responses" else "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        return client.post(base + prefix + path, json=body(route, stream), headers=headers)


def violations(text: str, route: str, stream: bool) -> dict[str, float]:
    """toolquake_conformance_violations_total of the test model on one route and stream, by rule (`text`: a
    /metrics exposition)."""
    out = {}
    for (name, labels), value in metric_samples(text).items():
        got = dict(labels)
        if name == "toolquake_conformance_violations_total" and \
                (got["model"], got["route"], got["stream"]) == (MODEL, route, str(stream).lower()):
            out[got["rule"]] = value
    return out


def checks(proxy: Proc, route: str, stream: bool) -> float:
    """toolquake_conformance_checks_total of the test model on one route and stream."""
    return scraped(proxy, "toolquake_conformance_checks_total", model=MODEL, route=route, stream=str(stream).lower())


def wait_checks(proxy: Proc, route: str, stream: bool, n: float) -> float:
    """Wait until `n` answers were checked (the check runs after the client's last byte)."""
    wait_for(lambda: checks(proxy, route, stream) >= n, 30, f"{n:g} answers checked")
    return checks(proxy, route, stream)


def stored(db: Path, request_id: str, want: int) -> list[dict]:
    """The conformance rows of one request (written off the event loop: wait for them)."""
    from toolquake.proxy.live.results import read_violations

    def rows() -> list[dict]:
        return [r for r in read_violations(db) if r["request_id"] == request_id] if db.exists() else []

    wait_for(lambda: len(rows()) >= want, 30, f"{want} conformance row(s) of request {request_id}")
    return rows()


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def counted(proxy: Proc, route: str, stream: bool, before: dict[str, float], want: set[str]) -> dict[str, float]:
    """The rules counted since `before` (the count is taken after the client's last byte: wait for it)."""
    def now() -> dict[str, float]:
        return diff(before, violations(metrics_text(proxy), route, stream))

    wait_for(lambda: set(now()) >= want, 30, f"the rules {sorted(want)} counted")
    return now()


# (route, stream, X-Fake-Broken, X-Fake-Answer, the rules that must fire — and no other)
BROKEN = [
    ("chat_completions", True, "no-index", None, {"delta_missing_index"}),
    ("chat_completions", True, "no-id", None, {"call_missing_id"}),
    ("chat_completions", True, "no-type", None, {"call_missing_type"}),
    ("chat_completions", True, "no-name", None, {"call_missing_name"}),
    ("chat_completions", True, "repeat-id-name", None, {"delta_not_append"}),
    ("chat_completions", True, "same-index", TWO_CALLS, {"delta_not_append", "arguments_invalid_json"}),
    ("chat_completions", True, "args-invalid", None, {"arguments_invalid_json"}),
    ("chat_completions", True, "args-object", None, {"arguments_not_string"}),
    ("chat_completions", True, "empty-args", PING, {"arguments_empty"}),
    ("chat_completions", True, "finish-stop", None, {"finish_reason_not_tool_calls"}),
    ("chat_completions", True, "finish-tool-calls", text("Sunny."), {"finish_reason_without_calls"}),
    ("chat_completions", True, "bad-chunk", None, {"chunk_invalid_json"}),
    ("chat_completions", True, None, json.dumps({"calls": [{"name": "get_weather", "arguments": {"days": "2"}}]}),
     {"arguments_schema"}),
    ("chat_completions", True, None, json.dumps({"calls": [{"name": "get_wether", "arguments": {"city": "x"}}]}),
     {"call_unknown_tool"}),
    ("chat_completions", True, None, text(HERMES), {"call_in_content_hermes"}),
    ("chat_completions", True, None, text('[get_weather(city="Paris")]'), {"call_in_content_pythonic"}),
    ("chat_completions", True, None, text('I will call {"name": "get_weather", "arguments": {"city": "Paris"}}'),
     {"call_in_content_json"}),
    ("chat_completions", False, "no-id", None, {"call_missing_id"}),
    ("chat_completions", False, "no-type", None, {"call_missing_type"}),
    ("chat_completions", False, "no-name", None, {"call_missing_name"}),
    ("chat_completions", False, "args-invalid", None, {"arguments_invalid_json"}),
    ("chat_completions", False, "args-object", None, {"arguments_not_string"}),
    ("chat_completions", False, "empty-args", PING, {"arguments_empty"}),
    ("chat_completions", False, "finish-stop", None, {"finish_reason_not_tool_calls"}),
    ("chat_completions", False, None, json.dumps({"calls": [{"name": "create_event", "arguments": {
        "event": {"title": "x", "attendees": [1]}}}]}), {"arguments_schema"}),
    ("chat_completions", False, None, text(HERMES), {"call_in_content_hermes"}),
    ("responses", True, "no-id", None, {"call_missing_id"}),
    ("responses", True, "no-name", None, {"call_missing_name"}),
    ("responses", True, "unknown-item", None, {"delta_missing_index", "done_mismatch"}),
    ("responses", True, "done-mismatch", None, {"done_mismatch"}),
    ("responses", True, "args-invalid", None, {"arguments_invalid_json"}),
    ("responses", True, "empty-args", PING, {"arguments_empty"}),
    ("responses", True, "bad-chunk", None, {"chunk_invalid_json"}),
    ("responses", True, None, text('[get_weather(city="Paris")]'), {"call_in_content_pythonic"}),
    ("responses", False, "no-id", None, {"call_missing_id"}),
    ("responses", False, "no-name", None, {"call_missing_name"}),
    ("responses", False, "args-invalid", None, {"arguments_invalid_json"}),
    ("responses", False, "empty-args", PING, {"arguments_empty"}),
    ("responses", False, None, json.dumps({"calls": [{"name": "get_weather", "arguments": {}}]}),
     {"arguments_schema"}),
    ("responses", False, None, text(HERMES), {"call_in_content_hermes"}),
]


def test_every_rule_has_a_broken_shape_here() -> None:
    from toolquake.proxy.server.conformance import RULES

    assert {r for *_, rules in BROKEN for r in rules} == set(RULES)


@pytest.mark.parametrize("route,stream,broken,answer,rules", BROKEN,
                         ids=[f"{r}-{'stream' if s else 'plain'}-{b or 'answer'}-{'+'.join(sorted(w))}"
                              for r, s, b, _, w in BROKEN])
def test_each_broken_shape_fires_its_rule_and_reaches_the_client_untouched(checked, fake_upstream, db, route, stream,
                                                                          broken, answer, rules):
    headers = {"X-Fake-Seq": "7"}
    if broken:
        headers["X-Fake-Broken"] = broken
    if answer:
        headers["X-Fake-Answer"] = answer
    before = violations(metrics_text(checked), route, stream)
    direct = send(fake_upstream.url, route, stream, headers)
    proxied = send(checked.url, route, stream, headers)
    assert proxied.status_code == direct.status_code == 200
    assert proxied.content == direct.content  # the checker reads; it never alters
    assert set(counted(checked, route, stream, before, rules)) == rules
    # the request was finished too (a stream the relay could not assemble once left it in flight)
    assert scraped(checked, "toolquake_in_flight_requests") == 0
    rows = stored(db, proxied.headers["x-toolquake-request-id"], len(rules))
    assert {r["rule"] for r in rows} >= rules
    for r in rows:
        assert r["model"] == MODEL and r["route"] == route and r["stream"] == int(stream)
        assert r["detail"] and r["excerpt"] is None  # no contents without store_contents


WELL_FORMED = [None, TWO_CALLS, PING, text("Sunny, 21 degrees."),
               text("Use get_weather when you need it; arrays look like [1, 2] and objects like {\"a\": 1}.")]


@pytest.mark.parametrize("route", ["chat_completions", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_well_formed_answers_break_no_rule(checked, route, stream):
    before = violations(metrics_text(checked), route, stream)
    checked_before = checks(checked, route, stream)
    for answer in WELL_FORMED:
        headers = {"X-Fake-Answer": answer} if answer else {}
        assert send(checked.url, route, stream, headers).status_code == 200
    assert wait_checks(checked, route, stream, checked_before + len(WELL_FORMED)) == checked_before + len(WELL_FORMED)
    assert diff(before, violations(metrics_text(checked), route, stream)) == {}


@pytest.fixture(scope="module")
def kept(fake_upstream: Proc, tmp_path_factory):
    """A proxy that stores contents (`store_contents = true`), into a results store of its own."""
    from tests.support import start_proxy

    db = tmp_path_factory.mktemp("kept") / "c.sqlite"
    proc = start_proxy(fake_upstream.url, config(db, contents=True))
    proc.db = db
    yield proc
    proc.stop()


def test_excerpts_are_stored_only_with_store_contents(kept):
    db = kept.db
    r = send(kept.url, "chat_completions", False, {"X-Fake-Answer": text(HERMES)})
    rows = stored(db, r.headers["x-toolquake-request-id"], 1)
    assert [row["rule"] for row in rows] == ["call_in_content_hermes"]
    assert "<tool_call>" in rows[0]["excerpt"] and "Paris" in rows[0]["excerpt"]
    assert "Paris" not in rows[0]["detail"]


sink = tracing_support.sink  # an OTLP collector of the test's own (a fixture)


def test_conformance_off_counts_nothing(proxy_factory, sink, tmp_path):
    """With the check off, broken answers are relayed and nothing is checked or counted. Looked at once each
    request's span reached the collector: the span waits for every step after the last byte (the check's place
    among them), so whatever a check would have counted was counted by then."""
    proxy = proxy_factory(config(tmp_path / "o.sqlite").replace("[server]", "[server]\nconformance = false"),
                          {"TOOLQUAKE_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                           "OTEL_BSP_SCHEDULE_DELAY": "100"})
    traces = set()
    for stream in (True, False):
        trace_id = secrets.token_hex(16)
        traces.add(trace_id)
        headers = {"X-Fake-Broken": "no-id", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        assert send(proxy.url, "chat_completions", stream, headers).status_code == 200
    spans = [s for s in sink_spans(sink, traces, 2 * len(traces)) if s["kind"] == 2]  # the request spans
    assert len(spans) == 2 and not any("toolquake.conformance.checked" in s["values"] for s in spans)
    metrics = metrics_text(proxy)
    assert not violations(metrics, "chat_completions", True) and not violations(metrics, "chat_completions", False)
    assert checks(proxy, "chat_completions", True) == checks(proxy, "chat_completions", False) == 0


def repairs(proxy: Proc) -> dict[tuple[str, str, str], float]:
    return {(got["route"], got["stream"], got["rule"]): value for (name, labels), value in
            metric_samples(metrics_text(proxy)).items() if name == "toolquake_conformance_repairs_total"
            for got in [dict(labels)]}


@pytest.mark.parametrize("answer,rule", [(HERMES, "call_in_content_hermes"),
                                         ('[get_weather(city="Paris")]', "call_in_content_pythonic"),
                                         ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                          "call_in_content_json")])
def test_repair_turns_a_call_left_in_the_text_into_tool_calls_for_the_sdk(checked, answer, rule):
    from openai import OpenAI

    client = OpenAI(base_url=checked.url + "/p/fixed/v1", api_key="none", max_retries=0,
                    default_headers={"X-Fake-Answer": text(answer)})
    before = repairs(checked)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, tools=CHAT_TOOLS)
    assert plain.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in plain.choices[0].message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    with client.chat.completions.stream(model=MODEL, messages=msgs, tools=CHAT_TOOLS) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    resp = client.responses.create(model=MODEL, input="weather in Paris?", tools=RESP_TOOLS)
    assert [(i.type, i.name, i.arguments) for i in resp.output] == [("function_call", "get_weather",
                                                                       '{"city": "Paris"}')]
    with client.responses.stream(model=MODEL, input="weather in Paris?", tools=RESP_TOOLS) as s:
        streamed = s.get_final_response()
    assert [(i.type, i.name) for i in streamed.output] == [("function_call", "get_weather")]
    after = repairs(checked)
    for key in [("chat_completions", "false", rule), ("chat_completions", "true", rule),
                ("responses", "false", rule), ("responses", "true", rule)]:
        assert after.get(key, 0) - before.get(key, 0) == 1, key


@pytest.mark.parametrize("route", ["chat_completions", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_repair_leaves_answers_without_a_call_in_the_text_byte_for_byte(checked, fake_upstream, route, stream):
    for answer in (text("Sunny, 21 degrees."), TWO_CALLS):
        headers = {"X-Fake-Seq": "9", "X-Fake-Answer": answer}
        direct = send(fake_upstream.url, route, stream, headers)
        repaired = send(checked.url, route, stream, headers, prefix="/p/fixed")
        assert repaired.status_code == 200 and repaired.content == direct.content
    headers = {"X-Fake-Seq": "9", "X-Fake-Answer": text(HERMES)}
    assert send(checked.url, route, stream, headers, prefix="/p/fixed").content != \
        send(fake_upstream.url, route, stream, headers).content


def test_a_checker_that_raises_is_counted_and_the_client_still_gets_the_backend_bytes(proxy_factory, fake_upstream,
                                                                                       tmp_path):
    cfg = config(tmp_path / "r.sqlite").replace("[server]", '[server]\nplugins = ["tests.plugins.raising_checker"]')
    proxy = proxy_factory(cfg)
    for stream in (False, True):
        headers = {"X-Fake-Seq": "5", "X-Fake-Broken": "no-id"}
        direct = send(fake_upstream.url, "chat_completions", stream, headers)
        proxied = send(proxy.url, "chat_completions", stream, headers)
        assert proxied.status_code == 200 and proxied.content == direct.content
    wait_for(lambda: scraped(proxy, "toolquake_conformance_check_failures_total", route="chat_completions") >= 2,
             30, "two failed checks counted")
    metrics = metrics_text(proxy)
    assert scraped(proxy, "toolquake_conformance_check_failures_total", route="chat_completions") == 2
    assert not violations(metrics, "chat_completions", False) and not violations(metrics, "chat_completions", True)
    # the Responses checker is another module: it still counts
    assert send(proxy.url, "responses", False, {"X-Fake-Broken": "no-id"}).status_code == 200
    assert counted(proxy, "responses", False, {}, {"call_missing_id"}) == {"call_missing_id": 1.0}


def test_report_db_lists_the_violations_by_model_and_rule(kept):
    """The report of a store (the module's proxy that keeps contents: its other requests break no rule counted
    here) counts each rule per model."""
    import subprocess
    import sys

    from tests.support import ROOT

    db, proxy = kept.db, kept
    ids = [send(proxy.url, "chat_completions", stream, {"X-Fake-Broken": "no-id,finish-stop"})
           .headers["x-toolquake-request-id"] for stream in (False, True)]
    for rid in ids:
        assert {r["rule"] for r in stored(db, rid, 2)} == {"call_missing_id", "finish_reason_not_tool_calls"}
    out = subprocess.run([sys.executable, "-m", "toolquake", "report", "--db", str(db)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "## Backend conformance" in out.stdout
    assert f"| {MODEL} | call_missing_id | 2 |" in out.stdout
    assert f"| {MODEL} | finish_reason_not_tool_calls | 2 |" in out.stdout


def test_the_lean_path_checks_and_repairs_too(proxy_factory, fake_upstream, tmp_path):
    """Without live scoring, requests nothing perturbs take the lean path (proxy/server/lean.py): same checks."""
    proxy = proxy_factory(config(tmp_path / "lean.sqlite").replace("[scoring]", "[scoring]\nenabled = false"))
    for route, stream, broken, rule in (("chat_completions", True, "no-id", "call_missing_id"),
                                        ("responses", False, "no-name", "call_missing_name")):
        headers = {"X-Fake-Seq": "3", "X-Fake-Broken": broken}
        before = violations(metrics_text(proxy), route, stream)
        direct = send(fake_upstream.url, route, stream, headers)
        proxied = send(proxy.url, route, stream, headers)
        assert proxied.status_code == 200 and proxied.content == direct.content
        assert counted(proxy, route, stream, before, {rule}) == {rule: 1.0}
    repaired = send(proxy.url, "chat_completions", True, {"X-Fake-Answer": text(HERMES)}, prefix="/p/fixed")
    assert b'"tool_calls":[{' in repaired.content and b'"finish_reason":"tool_calls"' in repaired.content
