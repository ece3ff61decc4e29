"""The recording keeps no secret (#28 and #45, item 6): a corpus of fake secrets of every common shape, put in
every place a record has strings (messages, tool calls and their arguments, tool results, tool names, descriptions,
parameter defaults, enums and examples, Responses input, the model's answers), sent through a real
`toolquake serve --record` with the openai SDK (chat and Responses, streamed and not): no secret is left in
the file's bytes, ordinary text and identifiers are, `cases from-recording` still reads it, and it is 0600.
The redactor's patterns take time linear in the text (1 MiB of hostile input), and a slow operator pattern
never holds up the proxy."""

from __future__ import annotations

import base64
import json
import secrets
import stat
import string
import threading
import time

import httpx
import pytest
from openai import OpenAI

from tests.support import scraped, start_proxy, wait_for
from tests.support.cases import read_records, toolquake

ALNUM = string.ascii_letters + string.digits
UPPER = string.ascii_uppercase + string.digits


def rand(alphabet: str, n: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def b64url(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def corpus() -> dict[str, str]:
    """Fake secrets of the right shapes, new random values on every run (never real ones)."""
    return {
        "openai": "sk-" + rand(ALNUM, 48),
        "openai_project": "sk-proj-" + rand(ALNUM + "_-", 120) + rand(ALNUM, 4),
        "anthropic": "sk-ant-api03-" + rand(ALNUM + "_-", 93) + "AA",
        "stripe_secret": "sk_live_" + rand(ALNUM, 99),
        "stripe_restricted": "rk_live_" + rand(ALNUM, 99),
        "stripe_publishable": "pk_live_" + rand(ALNUM, 99),
        "github_classic": "ghp_" + rand(ALNUM, 36),
        "github_fine_grained": "github_pat_" + rand(ALNUM, 22) + "_" + rand(ALNUM, 59),
        "aws_key_id": "AKIA" + rand(UPPER, 16),
        "aws_secret_key": rand(ALNUM + "/+", 40),
        "slack_bot": f"xoxb-{rand(string.digits, 12)}-{rand(string.digits, 13)}-{rand(ALNUM, 24)}",
        "slack_user": f"xoxp-{rand(string.digits, 11)}-{rand(string.digits, 11)}-{rand(string.digits, 12)}-"
                      f"{rand('0123456789abcdef', 32)}",
        "slack_webhook": f"https://hooks.slack.com/services/T{rand(UPPER, 9)}/B{rand(UPPER, 11)}/{rand(ALNUM, 24)}",
        "jwt": f"{b64url({'alg': 'HS256', 'typ': 'JWT'})}.{b64url({'sub': rand(ALNUM, 10), 'iat': 1700000000})}."
               f"{rand(ALNUM + '-_', 43)}",
        "bearer_opaque": rand(ALNUM + "._-", 40),
        "google_api": "AIza" + rand(ALNUM + "_-", 35),
        "url_password": rand(ALNUM, 20),
        "pem_body": "\n".join(rand(ALNUM + "+/", 64) for _ in range(4)),
    }


def in_context(name: str, value: str) -> str:
    """How a secret appears in text."""
    if name == "aws_secret_key":
        return f"aws_secret_access_key = {value}"
    if name == "bearer_opaque":
        return f"Authorization: Bearer {value}"
    if name == "jwt":
        return f"send the header Bearer {value} with it"
    if name == "url_password":
        return f"the database is at postgres://admin:{value}@db.internal:5432/app"
    if name == "pem_body":
        return f"-----BEGIN RSA PRIVATE KEY-----\n{value}\n-----END RSA PRIVATE KEY-----"
    return f"use {value} for it"


def needles(name: str, value: str) -> list[str]:
    """What must not be in the file: the whole value and its tail (a half-redacted key still leaks)."""
    if name == "pem_body":
        return value.splitlines()
    return [value, value[-12:]]


SEP = ", and "


def build_request(c: dict[str, str]) -> dict:
    """A chat request with a secret in every place a record has strings."""
    text = {k: in_context(k, v) for k, v in c.items()}
    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "description": f"Weather of a city. {text['jwt']}",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city.", "examples": [c["google_api"], "Paris"]},
                "units": {"type": "string", "enum": [c["stripe_publishable"], "metric"],
                          "default": c["anthropic"]},
                "api_key": {"type": "string", "default": "plain-looking-value-123"},
            }, "required": ["city", "units"]}}},
        # a secret-shaped tool name is redacted too; ordinary names stay
        {"type": "function", "function": {"name": c["github_classic"], "description": text["slack_webhook"],
                                          "parameters": {"type": "object", "properties": {}}}},
    ]
    call_args = json.dumps({"city": "Paris", "note": text["openai"], "password": "hunter2-hunter2",
                            "escaped": "\\u0073" + c["stripe_restricted"][1:]}).replace("\\\\u0073", "\\u0073")
    messages = [
        {"role": "system", "content": f"You are a travel agent. {text['openai_project']}"},
        {"role": "user", "content": f"Weather in Paris? {text['aws_key_id']}{SEP}{text['aws_secret_key']}"},
        {"role": "assistant", "content": f"Looking it up. {text['slack_bot']}", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": call_args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"sunny. {text['pem_body']}{SEP}{text['url_password']}"},
        {"role": "user", "content": [{"type": "text", "text": f"And tomorrow? {text['bearer_opaque']}"},
                                     {"type": "text", "text": text["github_fine_grained"]}]},
    ]
    return {"messages": messages, "tools": tools}


def test_no_secret_of_the_corpus_is_left_in_the_recording(fake_upstream, tmp_path):
    c = corpus()
    assert "\\u0073" in build_request(c)["messages"][2]["tool_calls"][0]["function"]["arguments"]
    recording = tmp_path / "secrets.jsonl"
    proxy = start_proxy(fake_upstream.url, '[record]\nredact = ["TOKEN-[0-9]+-[A-Z]+"]\n', None,
                        "--record", str(recording))
    sent = 0
    try:
        sdk = OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-" + rand(ALNUM, 40), max_retries=0)
        req = build_request(c)
        req["tools"][0]["function"]["description"] += " Booking TOKEN-4711-ZQX."
        # chat, not streamed: the model calls get_weather with the enum's first value (a secret)
        answer = sdk.chat.completions.create(model="fake-model", **req)
        assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert c["stripe_publishable"] in answer.choices[0].message.tool_calls[0].function.arguments
        sent += 1
        # chat, streamed: the model answers with a text that holds secrets
        said = f"Done. {in_context('stripe_secret', c['stripe_secret'])}{SEP}" \
               f"{in_context('slack_user', c['slack_user'])}"
        stream = sdk.chat.completions.create(model="fake-model", stream=True, **req,
                                             extra_headers={"X-Fake-Answer": json.dumps({"text": said})})
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == said
        sent += 1
        # Responses, not streamed and streamed: secrets in instructions, input text, call items, tool output
        tools = [{"type": "function", **t["function"]} for t in req["tools"]]
        items = [
            {"role": "user", "content": f"Weather in Lima? {in_context('openai', c['openai'])}"},
            {"type": "function_call", "call_id": "fc_1", "name": "get_weather",
             "arguments": json.dumps({"city": "Lima", "units": c["anthropic"]})},
            {"type": "function_call_output", "call_id": "fc_1", "output": f"cloudy {in_context('jwt', c['jwt'])}"},
        ]
        calls = json.dumps({"calls": [{"name": "get_weather", "arguments": {"city": c["google_api"],
                                                                             "units": "metric"}}]})
        resp = sdk.responses.create(model="fake-model", input=items, tools=tools,
                                    extra_headers={"X-Fake-Answer": calls},
                                    instructions=f"Be brief. {in_context('aws_key_id', c['aws_key_id'])}")
        assert [o.type for o in resp.output] == ["function_call"]
        sent += 1
        events = sdk.responses.create(model="fake-model", input=items, tools=tools, stream=True,
                                      extra_headers={"X-Fake-Answer": json.dumps({"text": said})})
        assert next(e.response for e in events if e.type == "response.completed").output_text == said
        sent += 1
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total") >= sent, what="every exchange recorded")
        assert scraped(proxy, "toolquake_recorded_total") == sent
    finally:
        proxy.stop()

    raw = recording.read_bytes()
    for name, value in c.items():
        for needle in needles(name, value):
            assert needle.encode() not in raw, (name, needle)
    assert b"TOKEN-4711-ZQX" not in raw and b"hunter2" not in raw
    # what is not secret stays: texts around the secrets, identifiers, schema keywords
    for kept in ("You are a travel agent.", "Weather in Paris?", "get_weather", "Weather of a city.", "The city.",
                 "Looking it up.", "sunny.", "And tomorrow?", "Weather in Lima?", "Be brief.", "Done.", '"units"',
                 '"enum"', '"metric"', '"call_1"', "aws_secret_access_key = [redacted]", "Authorization: Bearer",
                 "postgres://admin:[redacted]@db.internal", "plain-looking-value-123", '"role":"tool"', "Paris"):
        assert kept.encode() in raw, kept
    records = read_records(recording)
    assert len(records) == sent
    assert [(r["route"], r["stream"]) for r in sorted(records, key=lambda r: (r["route"], r["stream"]))] == [
        ("chat_completions", False), ("chat_completions", True), ("responses", False), ("responses", True)]
    for r in records:  # call arguments are still JSON, with the secret values replaced inside
        for m in [*r["request"]["messages"], r["answer"]["message"]]:
            for call in m.get("tool_calls") or []:
                args = json.loads(call["function"]["arguments"])
                assert isinstance(args, dict)
                if "note" in args:
                    assert args == {"city": "Paris", "note": "use [redacted] for it", "password": "[redacted]",
                                    "escaped": "[redacted]"}
        names = [t["function"]["name"] for t in r["request"]["tools"]]
        assert names[0] == "get_weather" and names[1] == "[redacted]"
    chat = next(r for r in records if r["route"] == "chat_completions" and not r["stream"])
    assert json.loads(chat["answer"]["message"]["tool_calls"][0]["function"]["arguments"])["units"] == "[redacted]"
    assert chat["request"]["tools"][0]["function"]["parameters"]["properties"]["units"]["enum"] == [
        "[redacted]", "metric"]
    assert stat.S_IMODE(recording.stat().st_mode) == 0o600

    cases = tmp_path / "cases.jsonl"
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases))
    assert r.returncode == 0, r.stderr
    assert "held secret-shaped strings" not in r.stderr  # what the recorder redacted is not changed again
    made = [json.loads(line) for line in cases.read_text().splitlines()]
    assert 3 <= len(made) <= sent  # the two Responses exchanges hold one conversation: one case (a conflict)
    assert all(m["expected"] == "no call" or m["expected"][0]["name"] == "get_weather" for m in made)


# -- the shapes of #45: Hugging Face tokens, Basic credentials outside a header, cookies, JSON inside a JSON
# string, a password in a URL without a user, keys named pass/pwd, numbers and lists under secret-named keys


def more_secrets() -> dict[str, str]:
    """Fake secrets of the shapes #45 found missed, new random values on every run."""
    return {
        "huggingface": "hf_" + rand(ALNUM, 34),
        "basic": base64.b64encode(f"svc-{rand(ALNUM, 6)}:{rand(ALNUM, 20)}".encode()).decode(),
        "cookie": rand(ALNUM, 32),
        "set_cookie": rand(ALNUM, 40),
        "escaped_json": rand(ALNUM, 24),
        "double_encoded": rand(ALNUM, 24),
        "redis": rand(ALNUM, 24),
        "pass_key": rand(ALNUM, 16),
        "pwd_key": rand(ALNUM, 16),
        "db_pass": rand(ALNUM, 16),
        "number": str(secrets.randbelow(9 * 10**15) + 10**15),
        "listed": rand(ALNUM, 20),
        "listed_too": rand(ALNUM, 20),
        "prose_listed": rand(ALNUM, 20),
        "prose_listed_too": rand(ALNUM, 20),
    }


#: ordinary text that looks like those shapes: it stays as it is
LOOK_ALIKES = ("You shall not pass: the bridge is closed.", "Boarding pass: confirmed for seat 12A.",
               "Our password policy asks for a rotation every year.", "A Basic understanding of HTTP helps.",
               "Basic information is on the wiki.", "Bake a cookie: flour, sugar, butter.", "PWD=/home/agent",
               "redis://cache.internal:6379/0", "basic authentication is off", '"bypass": "cache"',
               '"compass": "north"', '"tokens": 12', '"enabled": true')


def more_request(m: dict[str, str]) -> dict:
    """A chat request with the #45 shapes in message texts, call arguments and tool results, and the look-alikes."""
    escaped = '{\\"api_key\\": \\"%s\\", \\"city\\": \\"Paris\\"}' % m["escaped_json"]
    assert '\\"api_key\\"' in escaped  # JSON inside a JSON string, as a tool that logs JSON returns it
    keyed = json.dumps({"db": {"host": "db.internal", "pass": m["pass_key"], "pwd": m["pwd_key"]},
                        "api_key": int(m["number"]), "client_secret": [m["listed"], m["listed_too"]],
                        "bypass": "cache", "compass": "north", "tokens": 12, "enabled": True})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "http_get", "arguments": json.dumps(a)}}
             for i, a in enumerate([{"url": "https://api.internal/v1", "pass": m["pass_key"]},
                                    {"url": "https://api.internal/v2", "api_key": int(m["number"])},
                                    {"url": "https://api.internal/v3"}, {"url": "https://api.internal/v4"}])]
    results = [f"HTTP/1.1 200 OK\r\nSet-Cookie: session={m['set_cookie']}; Path=/; HttpOnly\r\n\r\n"
               f"the request sent Cookie: sid={m['cookie']}; theme=dark",
               f"upstream said: {escaped}", keyed,
               json.dumps(json.dumps({"api_key": m["double_encoded"], "note": "ok"}))]
    return {"messages": [
        {"role": "system", "content": f"You are a DevOps agent. Cache: redis://:{m['redis']}@cache.internal:6379/0"
                                      f", config line db_pass: {m['db_pass']}. {LOOK_ALIKES[0]}"},
        {"role": "user", "content": f"Pull the model with {m['huggingface']}, then call the API with "
                                    f"Basic {m['basic']} in the header. {' '.join(LOOK_ALIKES[1:9])}"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)),
        {"role": "user", "content": f'and "api_key": ["{m["prose_listed"]}", "{m["prose_listed_too"]}"] '
                                    f"too. {LOOK_ALIKES[9]}"},
    ], "tools": [{"type": "function", "function": {
        "name": "http_get", "description": "GET a URL.", "parameters": {"type": "object", "properties": {
            "url": {"type": "string"}, "pass": {"type": "string"}, "api_key": {"type": "integer"}},
            "required": ["url"]}}}]}


def strings(value: object) -> str:
    """Every string of a structure (keys included), one per line, JSON texts as they are."""
    if isinstance(value, str):
        return value + "\n"
    if isinstance(value, list):
        return "".join(strings(v) for v in value)
    if isinstance(value, dict):
        return "".join(strings(k) + strings(v) for k, v in value.items())
    return ""


def check_more(m: dict[str, str], raw: bytes, text: str) -> None:
    """No value of `m` in `raw`, the look-alikes and the text around the secrets in `text`."""
    for name, value in m.items():
        assert value.encode() not in raw, (name, value)
    assert b"api.internal" in raw and b"db.internal" in raw
    for kept in (*LOOK_ALIKES, "Pull the model with [redacted]", "with Basic [redacted] in the header",
                 "redis://:[redacted]@cache.internal:6379/0", "Set-Cookie: [redacted]", "Cookie: [redacted]",
                 "db_pass: [redacted]", 'upstream said: {\\"api_key\\": \\"[redacted]\\"',
                 '"api_key": "[redacted]"', '"client_secret": ["[redacted]", "[redacted]"]', '"pass": "[redacted]"',
                 '"pwd": "[redacted]"', '"host": "db.internal"'):
        assert kept in text, kept


def test_the_shapes_of_45_are_redacted_and_their_look_alikes_stay():
    """Through the redactor directly: every #45 shape in every place, and the ordinary text that looks like one."""
    from toolquake.proxy.live.redact import Redactor

    m = more_secrets()
    redacted = Redactor()(more_request(m))
    check_more(m, json.dumps(redacted, ensure_ascii=False).encode(), strings(redacted))
    args = [json.loads(c["function"]["arguments"]) for c in redacted["messages"][2]["tool_calls"]]
    assert args[:2] == [{"url": "https://api.internal/v1", "pass": "[redacted]"},
                        {"url": "https://api.internal/v2", "api_key": "[redacted]"}]
    double = json.loads(json.loads(redacted["messages"][6]["content"]))  # still JSON in a JSON string
    assert double == {"api_key": "[redacted]", "note": "ok"}
    assert redacted["tools"] == more_request(m)["tools"]  # a schema under a secret-named key is walked, not replaced
    assert Redactor()(redacted) == redacted  # redacting again changes nothing (`cases from-recording` does)


def test_the_shapes_of_45_are_not_in_a_real_recording(fake_upstream, tmp_path):
    """The same request through `toolquake serve --record` with the openai SDK, on chat completions and the
    Responses API (a function call's output that is JSON with secret-named keys)."""
    m = more_secrets()
    recording = tmp_path / "more.jsonl"
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    try:
        sdk = OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-" + rand(ALNUM, 40), max_retries=0)
        req = more_request(m)
        answer = sdk.chat.completions.create(model="fake-model", **req,
                                             extra_headers={"X-Fake-Answer": json.dumps({"text": "Done."})})
        assert answer.choices[0].message.content == "Done."
        items = [{"role": "user", "content": req["messages"][1]["content"]},
                 {"type": "function_call", "call_id": "fc_1", "name": "http_get",
                  "arguments": req["messages"][2]["tool_calls"][0]["function"]["arguments"]},
                 {"type": "function_call_output", "call_id": "fc_1", "output": req["messages"][5]["content"]}]
        tools = [{"type": "function", **t["function"]} for t in req["tools"]]
        resp = sdk.responses.create(model="fake-model", input=items, tools=tools,
                                    extra_headers={"X-Fake-Answer": json.dumps({"text": "Done."})})
        assert resp.output_text == "Done."
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total") >= 2, what="both exchanges recorded")
        assert scraped(proxy, "toolquake_recorded_total") == 2
    finally:
        proxy.stop()
    records = read_records(recording)
    assert sorted(r["route"] for r in records) == ["chat_completions", "responses"]
    check_more(m, recording.read_bytes(), strings(records))


#: inputs that make backtracking patterns quadratic: runs of each pattern's prefixes and characters
HOSTILE_UNITS = ["a", "A", "1", "/", ":", "-", "_", " ", "\n", "://a", "://a:b", "@", "a:", "http://a:", "eyJ",
                 "eyJa.", "eyJaaaaaaaaa.", "xoxb-1", "xoxb-1-", "AKC", "APA", "sk-", "sk-a", "sk_live_", "ghp_",
                 "AIza", "aws key '", "BEGIN ", "-----BEGIN RSA PRIVATE KEY-----", "-----BEGIN ", "bearer ",
                 "bearer", "authorization:", "password=", "api_key: '", "secret_access_key= ", "1234567890:",
                 "pypi-AgEIcHlwaS5vcmc", "AccountKey=", "SG.", "glpat-", "M", "Ma", "//a/:_authToken=", "é",
                 # the shapes of #45
                 "hf_", "hf_a", "basic ", "Basic QUFB", "Basic YTpi", "cookie:", "cookie: a=", "Set-Cookie: a=b",
                 "cookie: a=\\", "\\", '\\"', '\\"api_key\\": \\"', '"api_key": [', "api_key:[", "api_key:[a",
                 "redis://:", "://:", "://:a", "://a:", "pass=", '"pass": "', "db_pass: ", "a_pass:", "pwd=", "_pwd",
                 'pass\\"', '{"a":', "[", '"', '{\\"', "password=[", "password=[[", "api_key: [redacted]"]


def test_the_redactor_is_linear_on_hostile_text():
    from toolquake.proxy.live.redact import REDACTED, Redactor

    redactor = Redactor(["TOKEN-[0-9]+-[A-Z]+"], timeout=10)
    small, big = 1 << 17, 1 << 20
    for unit in HOSTILE_UNITS:
        def took(n: int) -> float:
            """CPU seconds of this thread (the matching runs in it), so a busy machine does not count."""
            text = (unit * (n // len(unit) + 1))[:n] + "!"
            t = time.thread_time()
            redactor(text)  # the text's patterns, and for a text that starts like JSON, its decoding
            return time.thread_time() - t

        t_small, t_big = took(small), took(big)
        # linear: 8x the text takes about 8x the time (quadratic: 64x); a wide margin
        assert t_big < 24 * t_small + 0.2, (unit, t_small, t_big)
        assert t_big < 5.0, (unit, t_big)  # and within the default budget, 5 CPU seconds per text
    assert redactor.timeouts == 0
    assert redactor.text("x sk-" + "a" * 30) == f"x {REDACTED}"


def test_every_library_detector_is_found_and_matches_its_shape():
    """The detect-secrets plugins named in LIBRARY_DETECTORS exist in the installed version, and each one used
    finds a value of its own shape (a library upgrade that renames or drops one fails here)."""
    from toolquake.proxy.live.redact import LIBRARY_DETECTORS, library_patterns

    patterns = library_patterns()
    assert len(patterns) >= len(LIBRARY_DETECTORS)
    samples = ["AKIA" + rand(UPPER, 16), "AccountKey=" + rand(ALNUM, 88), "https://u:" + rand(ALNUM, 12) + "@h.io",
               "https://acct:" + rand("abcdefghij", 24) + "@acct.cloudant.com",
               "M" + rand(ALNUM, 23) + "." + rand(ALNUM, 6) + "." + rand(ALNUM, 27), "ghp_" + rand(ALNUM, 36),
               "glpat-" + rand(ALNUM, 20), rand("0123456789abcdef", 32) + "-us12", "BEGIN RSA PRIVATE KEY",
               "pypi-AgEIcHlwaS5vcmc" + rand(ALNUM, 70), "SG." + rand(ALNUM, 22) + "." + rand(ALNUM, 43),
               "xoxb-1234-abcd", "https://api.softlayer.com/soap/v3/" + rand("abcdef0123", 64),
               "sq0csp-" + rand(ALNUM, 43), "sk_live_" + rand(ALNUM, 24), "123456789:" + rand(ALNUM, 35),
               "AC" + rand("abcdef0123", 32)]
    for sample in samples:
        assert any(p.search(sample) for p in patterns), sample


def test_a_slow_operator_pattern_never_holds_up_the_proxy(fake_upstream, tmp_path):
    """A catastrophic `[record] redact` pattern on a text made for it: the writer thread gives up after its
    CPU budget and writes `[redacted]` for that text; meanwhile the event loop answers /healthz at once (the
    matching runs without the GIL)."""
    recording = tmp_path / "slow.jsonl"
    config = '[record]\nredact = ["(a|aa)+$"]\nredact_timeout = 2.0\n'
    proxy = start_proxy(fake_upstream.url, config, None, "--record", str(recording))
    slow = "a" * 80 + "!"
    worst = [0.0]
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                t = time.perf_counter()
                assert http.get(f"{proxy.url}/healthz").status_code == 200
                worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    try:
        prober.start()
        t0 = time.perf_counter()
        r = httpx.post(f"{proxy.url}/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": slow}, {"role": "user", "content": "Oslo"}]})
        assert r.status_code == 200
        wait_for(lambda: scraped(proxy, "toolquake_recorded_total") >= 1, timeout=120, what="the exchange recorded")
        took = time.perf_counter() - t0
    finally:
        stop.set()
        prober.join(60)
        proxy.stop()
    records = read_records(recording)
    assert [m["content"] for m in records[0]["request"]["messages"]] == ["[redacted]", "Oslo"]
    assert took >= 2.0  # the scan ran for its whole budget (2 s of CPU) ...
    assert worst[0] < took / 3, (worst[0], took)  # ... and the loop was never held for it


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_recording_is_0600_whatever_the_umask(tmp_path, umask):
    import os

    from toolquake.proxy.live.recording import _PREPARED, prepare

    path = tmp_path / f"umask-{umask:o}.jsonl"
    old = os.umask(umask)
    try:
        prepare(path)
    finally:
        os.umask(old)
        _PREPARED.clear()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.processes
def test_cases_from_a_recording_written_unredacted_come_out_redacted(tmp_path):
    """A recording with every secret of both corpora left in (an old or foreign file, or one edited by hand):
    `cases from-recording` redacts what it copies, and the cases are still valid."""
    c, m = corpus(), more_secrets()
    first, second = build_request(c), more_request(m)
    answer = {"message": {"role": "assistant", "tool_calls": [{"id": "call_9", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "units": c["anthropic"],
                                                        "api_key": m["pwd_key"]})}}]}, "finish_reason": "tool_calls"}
    lines = [{"toolquake_recording": 1, "created": 1.0}]
    for i, request in enumerate([first, second]):
        lines.append({"v": 1, "ts": 1763900000.0 + i, "request_id": f"r{i}", "route": "chat_completions",
                      "profile": "off", "model": "m", "stream": False, "request": request,
                      "answer": answer if i == 0 else {"message": {"role": "assistant", "content": "Done."}}})
    recording = tmp_path / "by-hand.jsonl"
    recording.write_text("".join(json.dumps(line) + "\n" for line in lines))
    raw = recording.read_bytes()
    assert all(v.encode() in raw for v in m.values()) and c["openai"].encode() in raw  # the secrets are there

    cases = tmp_path / "cases.jsonl"
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases))
    assert r.returncode == 0, r.stderr
    assert "2 exchange(s) held secret-shaped strings the recording had kept" in r.stderr
    made = [json.loads(line) for line in cases.read_text().splitlines()]
    assert len(made) == 2
    out = cases.read_bytes()
    for name, value in c.items():
        for needle in needles(name, value):
            assert needle.encode() not in out, (name, needle)
    check_more(m, out, strings(made))
    assert made[0]["expected"] == [{"name": "get_weather", "arguments": {
        "city": ["Paris"], "units": ["[redacted]"], "api_key": ["[redacted]"]}}]
    assert toolquake("cases", "validate", str(cases)).returncode == 0
