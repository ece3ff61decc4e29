"""The proxy core, end to end: the real `openai` SDK → `toolquake serve` → the fake upstream, all real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, metric_value, recorded, scraped, start_proxy, wait_for
from tests.support.chat import MESSAGES, TOOLS, body, tag
from tests.support.ports import held_port
from tests.support.server import logged_requests
from toolquake.proxy.cli import main as toolquake_main

ADMIN_TOKEN = "adm-token-1"
#: the limits, the admin API, a plugin's raising perturber, scoring off and a default profile, in one proxy the
#: tests below share (each reads what its own requests moved: deltas of the counters, its own tags)
CUSTOM_CONFIG = """
[server]
read_timeout = 1.0
max_body_bytes = 2048
model_allowlist = ["fake-model"]
plugins = ["tests.plugins.raising"]

[scoring]
enabled = false

[profiles.broken]
perturbers = [{ name = "test_always_raises" }, { name = "tool_order", params = { mode = "reverse" } }]

[profiles.reversed]
mode = "perturb"
perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]
"""


@pytest.fixture(scope="module")
def custom(fake_upstream):
    proc = start_proxy(fake_upstream.url, CUSTOM_CONFIG, {"TOOLQUAKE_ADMIN_TOKEN": ADMIN_TOKEN,
                                                          "TOOLQUAKE_DEFAULT_PROFILE": "reversed"})
    yield proc
    proc.stop()


# --- same answers, same streams -------------------------------------------------------------------

def test_sdk_answer_through_proxy_equals_direct(proxy, fake_upstream):
    direct = openai.OpenAI(base_url=f"{fake_upstream.url}/v1", api_key="k")
    via = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    a = direct.chat.completions.create(**body())
    b = via.chat.completions.create(**body())
    ma, mb = a.choices[0].message, b.choices[0].message
    assert mb.tool_calls[0].function.name == ma.tool_calls[0].function.name == "get_weather"
    assert json.loads(mb.tool_calls[0].function.arguments) == json.loads(ma.tool_calls[0].function.arguments)
    assert b.choices[0].finish_reason == a.choices[0].finish_reason == "tool_calls"
    assert b.usage == a.usage


async def test_async_sdk_stream_through_proxy_reassembles_to_the_direct_answer(proxy, fake_upstream):
    async def collect(base: str) -> tuple[str, str, str]:
        client = openai.AsyncOpenAI(base_url=base, api_key="k")
        name, args, finish = "", "", ""
        async with await client.chat.completions.create(**body(), stream=True) as stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    for tc in choice.delta.tool_calls or []:
                        name += tc.function.name or ""
                        args += tc.function.arguments or ""
                    finish = choice.finish_reason or finish
        return name, args, finish

    direct = await collect(f"{fake_upstream.url}/v1")
    via = await collect(f"{proxy.url}/v1")
    assert via == direct
    assert via[0] == "get_weather" and via[2] == "tool_calls"


def test_an_unperturbed_stream_is_relayed_byte_for_byte(proxy, fake_upstream):
    payload = json.dumps(body(stream=True))

    def raw(base: str) -> bytes:
        with httpx.stream("POST", f"{base}/v1/chat/completions", content=payload,
                          headers={"content-type": "application/json"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            return b"".join(r.iter_raw())

    def normalise(data: bytes) -> bytes:
        # the fake numbers its responses and stamps the time: equalise those two fields only
        out = []
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                obj["id"], obj["created"] = "X", 0
                for ch in obj["choices"]:
                    for tc in ch.get("delta", {}).get("tool_calls") or []:
                        if "id" in tc:
                            tc["id"] = "X"
                line = b"data: " + json.dumps(obj).encode()
            out.append(line)
        return b"\n".join(out)

    direct, via = raw(fake_upstream.url), raw(proxy.url)
    assert via.endswith(b"data: [DONE]\n\n")
    assert normalise(via) == normalise(direct)
    assert via.count(b"data: ") == direct.count(b"data: ") > 4


def test_unknown_fields_reach_the_upstream_as_original_bytes(proxy, fake_upstream):
    t = tag()
    payload = json.dumps(body(parallel_tool_calls=False, response_format={"type": "json_object"},
                              vendor_extra={"nested": [1, 2, {"x": None}]}, top_k=7), separators=(",", ":"))
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=payload,
                   headers={"content-type": "application/json", "x-test-tag": t})
    assert r.status_code == 200
    (seen,) = recorded(fake_upstream, t)
    assert seen["body"] == payload


# --- headers ------------------------------------------------------------------------------------

def test_toolquake_headers_are_stripped_and_authorization_is_forwarded(proxy, fake_upstream):
    t = tag()
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={
        "authorization": "Bearer sk-secret-123", "x-test-tag": t, "X-Toolquake-Case": "simple_python_0",
        "X-Toolquake-Seed": "5", "x-toolquake-profile": "off", "X-Custom-End-To-End": "yes",
        "Connection": "keep-alive, X-Hop", "X-Hop": "drop-me"})
    assert r.status_code == 200
    (seen,) = recorded(fake_upstream, t)
    headers = seen["headers"]
    assert headers["authorization"] == "Bearer sk-secret-123"
    assert headers["x-custom-end-to-end"] == "yes"
    assert not [h for h in headers if h.startswith("x-toolquake-")]
    assert "x-hop" not in headers


def test_secrets_never_appear_in_logs_or_metrics(proxy):
    p = proxy
    secret = "sk-never-log-this-" + tag()
    logged = logged_requests(p)
    for stream in (False, True):
        httpx.post(f"{p.url}/v1/chat/completions", json=body(stream=stream),
                   headers={"authorization": f"Bearer {secret}", "x-api-key": secret})
    httpx.post(f"{p.url}/v1/chat/completions", content=b"{bad", headers={"authorization": f"Bearer {secret}"})
    metrics = httpx.get(f"{p.url}/metrics").text
    # the three requests' log lines were written (the stream's after its last byte): then nothing of them is secret
    wait_for(lambda: logged_requests(p) >= logged + 3, what="the three requests to be logged")
    assert secret not in p.output()
    assert secret not in metrics
    assert "Paris" not in p.output()  # message contents are not logged unless log_contents is on


# --- profiles -----------------------------------------------------------------------------------

def _tool_order_seen(fake, t: str) -> list[str]:
    (seen,) = recorded(fake, t)
    return [x["function"]["name"] for x in json.loads(seen["body"])["tools"]]


def test_profile_by_path_header_and_default(proxy, fake_upstream, custom):
    original = [t["function"]["name"] for t in TOOLS]
    t1, t2, t3 = tag(), tag(), tag()
    httpx.post(f"{proxy.url}/p/reversed/v1/chat/completions", json=body(), headers={"x-test-tag": t1})
    httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={"x-test-tag": t2,
                                                                          "x-toolquake-profile": "reversed"})
    httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={"x-test-tag": t3})
    assert _tool_order_seen(fake_upstream, t1) == original[::-1]
    assert _tool_order_seen(fake_upstream, t2) == original[::-1]
    assert _tool_order_seen(fake_upstream, t3) == original

    p = custom  # TOOLQUAKE_DEFAULT_PROFILE=reversed
    t4 = tag()
    httpx.post(f"{p.url}/v1/chat/completions", json=body(), headers={"x-test-tag": t4})
    assert _tool_order_seen(fake_upstream, t4) == original[::-1]


def test_path_profile_wins_over_header(proxy, fake_upstream):
    t = tag()
    httpx.post(f"{proxy.url}/p/off/v1/chat/completions", json=body(),
               headers={"x-test-tag": t, "x-toolquake-profile": "reversed"})
    assert _tool_order_seen(fake_upstream, t) == [x["function"]["name"] for x in TOOLS]


def test_unknown_profile_is_404_listing_known_profiles(proxy):
    client = openai.OpenAI(base_url=f"{proxy.url}/p/no-such-profile/v1", api_key="k")
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(**body())
    err = exc.value.body
    assert err["code"] == "unknown_profile"
    assert "off" in err["message"] and "shuffled" in err["message"]


def test_same_request_perturbs_the_same_way_and_seed_header_changes_it(proxy, fake_upstream):
    many = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object",
                                                                                  "properties": {}}}}
            for i in range(12)]
    orders = []
    for seed in (None, None, "1", "2"):
        t = tag()
        headers = {"x-test-tag": t}
        if seed:
            headers["x-toolquake-seed"] = seed
        httpx.post(f"{proxy.url}/p/shuffled/v1/chat/completions", json=body(tools=many), headers=headers)
        orders.append(_tool_order_seen(fake_upstream, t))
    assert orders[0] == orders[1]
    assert orders[0] != [t["function"]["name"] for t in many]
    assert orders[2] != orders[3]
    assert sorted(orders[2]) == sorted(orders[3]) == sorted(t["function"]["name"] for t in many)


# --- fail-open and faults -------------------------------------------------------------------------

def test_a_raising_perturber_fails_open_and_is_counted(custom, fake_upstream):
    p = custom  # [profiles.broken]: a raising step, then a reversing one
    failures = scraped(p, "toolquake_perturbation_failures_total", perturber="test_always_raises")
    applied = scraped(p, "toolquake_perturbations_total", perturber="tool_order")
    t = tag()
    client = openai.OpenAI(base_url=f"{p.url}/p/broken/v1", api_key="k",
                           default_headers={"x-test-tag": t})
    answer = client.chat.completions.create(**body())
    # served: the fake calls the first tool it was given, which the reverse step made the last one
    assert answer.choices[0].message.tool_calls[0].function.name == TOOLS[-1]["function"]["name"]
    # the failing step was skipped, the next one still ran
    assert _tool_order_seen(fake_upstream, t) == [x["function"]["name"] for x in TOOLS][::-1]
    metrics = httpx.get(f"{p.url}/metrics").text
    assert metric_value(metrics, "toolquake_perturbation_failures_total",
                        perturber="test_always_raises") == failures + 1
    assert metric_value(metrics, "toolquake_perturbations_total", perturber="tool_order") == applied + 1
    assert "this perturber always fails" in p.output()


def test_upstream_error_status_and_body_pass_through(proxy):
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={"x-fake-fault": "status:503"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "injected"
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                           default_headers={"x-fake-fault": "status:429"})
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**body())


def test_unreachable_upstream_is_502_openai_shaped(proxy_factory):
    with held_port("127.0.0.1") as port:
        p = proxy_factory(None, None, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            client.chat.completions.create(**body())
        assert exc.value.status_code == 502
        assert exc.value.body["code"] == "upstream_unreachable"
        assert httpx.get(f"{p.url}/readyz").status_code == 503
        assert httpx.get(f"{p.url}/healthz").status_code == 200


def test_upstream_timeout_is_504_and_next_request_is_fine(custom):
    p = custom  # read_timeout = 1.0
    r = httpx.post(f"{p.url}/v1/chat/completions", json=body(), headers={"x-fake-fault": "hang"}, timeout=10)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    assert httpx.post(f"{p.url}/v1/chat/completions", json=body()).status_code == 200


def test_bad_requests_are_rejected_openai_shaped(custom):
    p = custom  # max_body_bytes = 2048
    url = f"{p.url}/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, json={"messages": "not a list"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    r = httpx.post(url, json={"model": 5, "messages": []})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    r = httpx.post(url, json=body(padding="x" * 5000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.post(url, json=body()).status_code == 200


def test_invalid_json_from_upstream_is_an_openai_shaped_502_and_counted(proxy):
    before = metric_value(httpx.get(f"{proxy.url}/metrics").text, "toolquake_upstream_errors_total",
                          kind="invalid_response")
    r = httpx.post(f"{proxy.url}/v1/chat/completions", json=body(), headers={"x-fake-fault": "invalid-json"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_invalid_response" and "not JSON" in r.json()["error"]["message"]
    after = metric_value(httpx.get(f"{proxy.url}/metrics").text, "toolquake_upstream_errors_total",
                         kind="invalid_response")
    assert after == before + 1


@pytest.mark.parametrize("scoring", [True, False], ids=["answer_read", "answer_checked"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_upstream_json_nested_past_the_decoders_limit_is_an_invalid_response(proxy, custom, scoring, path):
    """A 2xx body that is valid JSON nested 100,000 lists deep: the decoder's RecursionError is the backend's
    invalid answer (502 upstream_invalid_response, counted), not a crash of the request; the proxy serves on.
    With scoring on the answer is decoded for the scorers, with scoring off only checked; both paths. (Scoring
    off: the shared custom proxy, through the `off` profile as the default one was.)"""
    p = proxy if scoring else custom
    path = path if scoring else f"/p/off{path}"
    metrics = f"{p.url}/metrics"
    before = metric_value(httpx.get(metrics).text, "toolquake_upstream_errors_total", kind="invalid_response")
    payload = body() if path.endswith("completions") else {"model": "fake-model", "input": "hi"}
    r = httpx.post(f"{p.url}{path}", json=payload, headers={"x-fake-fault": "deep-json"}, timeout=30)
    assert r.status_code == 502, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "upstream_invalid_response" and "nested too deeply" in error["message"]
    after = metric_value(httpx.get(metrics).text, "toolquake_upstream_errors_total", kind="invalid_response")
    assert after == before + 1
    assert httpx.post(f"{p.url}{path}", json=payload).status_code == 200


def test_upstream_cutting_a_stream_ends_the_client_stream(proxy):
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body(stream=True),
                      headers={"x-fake-fault": "cut-stream"}) as r:
        assert r.status_code == 200
        data = b"".join(r.iter_raw())
    assert b"[DONE]" not in data
    assert data.startswith(b"data: ")
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body()).status_code == 200


def test_client_abort_mid_stream_closes_the_upstream(proxy, fake_upstream):
    t = tag()
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body(stream=True),
                      headers={"x-fake-fault": "chunk-delay:300", "x-test-tag": t}) as r:
        first = next(r.iter_raw())
        assert first.startswith(b"data: ")
    # the proxy must notice and close its upstream connection: the fake sees a disconnect
    wait_for(lambda: any(x["method"] == "EVENT" and x["path"] == "disconnect" for x in recorded(fake_upstream, t)),
             timeout=10, what="the upstream stream to be closed after the client aborted")
    # and then leaves the in-flight gauge (it closes the upstream first)
    wait_for(lambda: scraped(proxy, "toolquake_in_flight_requests") == 0, what="the aborted request to end")


# --- other routes -------------------------------------------------------------------------------

def test_other_v1_paths_and_backend_extras_pass_through(proxy, fake_upstream):
    t = tag()
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    assert [m.id for m in client.models.list()] == ["fake-model"]
    emb = client.embeddings.create(model="fake-model", input="hi")
    assert emb.data[0].embedding == [0.1, 0.2]
    r = httpx.post(f"{proxy.url}/tokenize?verbose=1", json={"model": "m", "messages": MESSAGES},
                   headers={"x-test-tag": t, "x-toolquake-seed": "3"})
    assert r.status_code == 200 and r.json()["count"] > 0
    r = httpx.post(f"{proxy.url}/extras/tokenize/count", json={"input": "hello"}, headers={"x-test-tag": t})
    assert r.status_code == 200 and "count" in r.json()
    r = httpx.get(f"{proxy.url}/p/shuffled/v1/models", headers={"x-test-tag": t})
    assert r.status_code == 200
    r = httpx.get(f"{proxy.url}/v1/files/no-such-file", headers={"x-test-tag": t})
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]  # the upstream's own 404, relayed
    r = httpx.get(f"{proxy.url}/v1/no/such/path", headers={"x-test-tag": t})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"  # not in [server] passthrough
    seen = recorded(fake_upstream, t)
    assert [(s["method"], s["path"], s["query"]) for s in seen] == [
        ("POST", "/tokenize", "verbose=1"), ("POST", "/extras/tokenize/count", ""), ("GET", "/v1/models", ""),
        ("GET", "/v1/files/no-such-file", "")]
    assert not any(h.startswith("x-toolquake-") for s in seen for h in s["headers"])


def test_overhead_header_and_metrics_exposition(custom):
    p = custom  # model_allowlist = ["fake-model"]

    def counts(text: str) -> tuple[float, ...]:
        return (metric_value(text, "toolquake_requests_total", model="fake-model", stream="false",
                             status_class="2xx"),
                metric_value(text, "toolquake_requests_total", model="fake-model", stream="true"),
                metric_value(text, "toolquake_requests_total", model="other"),
                metric_value(text, "toolquake_proxy_overhead_seconds_count", route="chat_completions"))

    before = counts(httpx.get(f"{p.url}/metrics").text)
    r = httpx.post(f"{p.url}/v1/chat/completions", json=body())
    assert float(r.headers["x-toolquake-overhead-ms"]) >= 0
    with httpx.stream("POST", f"{p.url}/v1/chat/completions", json=body(stream=True)) as s:
        b"".join(s.iter_raw())
    httpx.post(f"{p.url}/v1/chat/completions", json=body(model="unlisted"))
    text = httpx.get(f"{p.url}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    for name in ("toolquake_requests", "toolquake_request_duration_seconds", "toolquake_upstream_duration_seconds",
                 "toolquake_time_to_first_byte_seconds", "toolquake_proxy_overhead_seconds",
                 "toolquake_in_flight_requests", "toolquake_perturbations", "toolquake_perturbation_failures"):
        assert name in families
    moved = [a - b for a, b in zip(counts(text), before)]
    assert moved == [1, 1, 1, 3]


# --- admin API ----------------------------------------------------------------------------------

def test_admin_api_needs_the_token_and_validates(custom, fake_upstream):
    p = custom  # TOOLQUAKE_ADMIN_TOKEN
    url = f"{p.url}/admin/profiles"
    good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.put(f"{url}/rev2", json={"perturbers": [{"name": "tool_order"}]}).status_code == 401
    assert httpx.get(f"{url}/rev2", headers=good).status_code == 404

    spec = {"mode": "perturb", "perturbers": [{"name": "tool_order", "params": {"mode": "reverse"}}]}
    r = httpx.put(f"{url}/rev2", json=spec, headers=good)
    assert r.status_code == 200 and r.json()["perturbers"][0]["params"] == {"mode": "reverse"}
    t = tag()
    httpx.post(f"{p.url}/p/rev2/v1/chat/completions", json=body(), headers={"x-test-tag": t})
    assert _tool_order_seen(fake_upstream, t) == [x["function"]["name"] for x in TOOLS][::-1]

    for bad in ({"perturbers": [{"name": "no_such_perturber"}]},
                {"perturbers": [{"name": "tool_order", "params": {"mode": "sideways"}}]},
                {"perturbers": [{"name": "tool_order", "probability": 2}]},
                {"mode": "perturb", "unknown_key": 1}):
        r = httpx.put(f"{url}/rev2", json=bad, headers=good)
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_profile"
    assert httpx.get(f"{url}/rev2", headers=good).json()["perturbers"][0]["params"] == {"mode": "reverse"}
    assert httpx.put(f"{url}/off", json=spec, headers=good).status_code == 400
    names = [x["name"] for x in httpx.get(url, headers=good).json()["profiles"]]
    assert "rev2" in names and "off" in names
    assert httpx.delete(f"{url}/rev2", headers=good).status_code == 204
    assert httpx.post(f"{p.url}/p/rev2/v1/chat/completions", json=body()).status_code == 404


def test_admin_api_is_disabled_without_a_token(proxy):
    r = httpx.get(f"{proxy.url}/admin/profiles", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "admin_disabled"


# --- configuration ------------------------------------------------------------------------------

BAD_CONFIGS = [
    ("[server]\nupstrem = 'http://x'\n", "upstrem"),
    ("[profiles.a]\nperturbers = [{ name = 'nope' }]\n", "unknown perturber 'nope'"),
    ("[profiles.a]\nmode = 'sideways'\n", "mode"),
    ("[server]\nupstream = 'ftp://x'\n", "http(s) URL"),
    ("[server\n", "invalid TOML"),
]


@pytest.mark.processes
def test_a_bad_config_file_stops_the_command_with_a_clear_message_and_no_traceback(tmp_path):
    """The command itself, as a process: a non-zero exit, the message on stderr, no traceback."""
    cfg = tmp_path / "bad.toml"
    config, fragment = BAD_CONFIGS[0]
    cfg.write_text(config)
    done = subprocess.run([sys.executable, "-m", "toolquake", "serve", "--config", str(cfg), "--port", "1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0
    assert fragment in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("config, fragment", BAD_CONFIGS)
def test_bad_config_files_fail_with_a_clear_message(tmp_path, config, fragment):
    """Each bad config, through the command's entry point in this process: it exits (SystemExit, which the
    interpreter prints to stderr with status 1) with the message; any other exception would be a traceback."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(config)
    with pytest.raises(SystemExit) as exc:
        toolquake_main(["serve", "--config", str(cfg), "--port", "1"])
    assert isinstance(exc.value.code, str) and exc.value.code.startswith("toolquake: ")
    assert fragment in exc.value.code


@pytest.mark.processes
def test_perturb_cli_prints_the_perturbed_request_and_what_was_applied(tmp_path, capsys):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(body()))
    done = subprocess.run(
        [sys.executable, "-m", "toolquake", "perturb", "--profile", "reversed", "--request", str(req)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [t["function"]["name"] for t in out["tools"]] == [t["function"]["name"] for t in TOOLS][::-1]
    assert out["messages"] == MESSAGES
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["applied"][0]["name"] == "tool_order" and summary["token_counter"] == "estimate"

    def shuffled() -> str:  # the same command in this process (its entry point), twice: the same output
        assert toolquake_main(["perturb", "--profile", "shuffled", "--request", str(req), "--seed", "7"]) == 0
        return capsys.readouterr().out

    again, twice = shuffled(), shuffled()
    assert again == twice and json.loads(again)["messages"] == MESSAGES


@pytest.mark.needs_corpus
def test_warm_up_sets_perturbers_up_at_start(proxy_factory):
    config = """
[server]
warm_up = true
[profiles.long]
perturbers = [{ name = "conversation_lengthening", params = { budget_tokens = 2000 } }]
"""
    p = proxy_factory(config)
    wait_for(lambda: "perturbers_set_up" in p.output(), timeout=120, what="the warm-up's perturbers_set_up line")
    line = next(json.loads(x) for x in p.output().splitlines() if "perturbers_set_up" in x)
    assert line["profiles"] == ["long", "off"] and line["perturbers"] == 1
    assert "perturber_setup_failed" not in p.output()
    cold = proxy_factory(config.replace("warm_up = true", "warm_up = false"))
    # the start-up that would have begun a warm-up is over: /readyz answers ready, which a warm-up in progress
    # holds back; without warm_up none was begun (so none will log later)
    assert httpx.get(f"{cold.url}/readyz").json()["status"] == "ready"
    assert "perturbers_set_up" not in cold.output()
