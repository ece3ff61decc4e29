"""Remedies in front of traffic and in shadow mode: the proxy (`toolquake serve`, the test remedies of
tests/plugins/remedies.py loaded as a plugin) and the fake upstream as their own processes, the `openai` SDK as the
client; what reached the upstream read from the fake's record, the counters from the real /metrics exposition.
One proxy for the module: each test sends to a profile of its own."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support import recorded, scraped, start_proxy, wait_for
from tests.support.chat import tag
from toolquake.proxy.live import results
from toolquake.scorers.consistency import DISAGREE

ADMIN = "admin-token-remedies"
SECRET_URL = "http://user:s3cret@127.0.0.1:9/remedy?key=abc"
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
         for n in ("weather_forecast", "humidity_forecast", "wind_forecast")]
MESSAGES = [{"role": "user", "content": "How humid will Miami be this week?"}]
KEEP_ONE = '{ name = "test_keep_tools", params = { k = 1 } }'


def _config(db) -> str:
    return f"""
[server]
plugins = ["tests.plugins.remedies"]
model_allowlist = ["fake-model"]

[profiles.kept]
remedies = [{KEEP_ONE}]

[profiles.reversed-kept]
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
remedies = [{KEEP_ONE}]

[profiles.case-kept]
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
remedies = [{KEEP_ONE}]

[profiles.broken-remedy]
remedies = [{{ name = "test_remedy_raises" }}, {{ name = "test_keep_tools", params = {{ k = 2 }} }}]

[profiles.shadow-kept]
mode = "shadow"
remedies = [{{ name = "test_keep_tools", params = {{ k = 1, from_end = true }} }}]

[profiles.hosted]
remedies = [{{ name = "test_remedy_host", params = {{ url = "{SECRET_URL}" }} }}]

[scoring]
store = "{db}"
"""


@pytest.fixture(scope="module")
def served(fake_upstream, tmp_path_factory):
    db = tmp_path_factory.mktemp("remedies") / "live.sqlite"
    proc = start_proxy(fake_upstream.url, _config(db), {"TOOLQUAKE_ADMIN_TOKEN": ADMIN})
    proc.db = db
    yield proc
    proc.stop()


def _send(proxy, profile: str, t: str, tools: list[dict] = TOOLS, messages: list[dict] = MESSAGES,
          headers: dict | None = None):
    client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-remedy", max_retries=0)
    return client.chat.completions.create(model="fake-model", messages=messages, tools=tools,
                                          extra_headers={"X-Test-Tag": t, **(headers or {})})


def _upstream_tools(fake, t: str) -> list[list[str]]:
    return [[x["function"]["name"] for x in json.loads(r["body"]).get("tools") or []] for r in recorded(fake, t)]


def _log(proxy) -> list[dict]:
    return [json.loads(line) for line in proxy.output().splitlines() if line.startswith("{")]


def _exposition(proxy) -> str:
    return httpx.get(f"{proxy.url}/metrics").text


def test_a_profile_of_remedies_only_serves_the_remedied_request_and_is_not_the_lean_path(served, fake_upstream):
    whole = scraped(served, "toolquake_request_decodes_total", kind="whole")
    t = tag()
    answer = _send(served, "kept", t)
    assert _upstream_tools(fake_upstream, t) == [["weather_forecast"]]
    assert answer.choices[0].message.tool_calls[0].function.name == "weather_forecast"
    # decoded whole (the lean path forwards a request it never reads), counted as a remedy under its profile
    assert scraped(served, "toolquake_request_decodes_total", kind="whole") == whole + 1
    assert 'toolquake_remedies_total{profile="kept",remedy="test_keep_tools"} 1.0' in _exposition(served)
    [line] = [e for e in _log(served) if e.get("event") == "request" and e.get("profile") == "kept"]
    assert (line["remedies"], line["perturbers"]) == (["test_keep_tools"], [])


def test_remedies_run_after_the_perturbations(served, fake_upstream):
    t = tag()
    _send(served, "reversed-kept", t)
    # reversed first, then the first one kept: the client's last tool; the other order would keep its first
    assert _upstream_tools(fake_upstream, t) == [["wind_forecast"]]
    text = _exposition(served)
    assert 'toolquake_remedies_total{profile="reversed-kept",remedy="test_keep_tools"} 1.0' in text
    assert scraped(served, "toolquake_perturbations_total", perturber="tool_order") >= 1
    assert scraped(served, "toolquake_perturbations_total", perturber="test_keep_tools") == 0
    # no case tied to the request: nothing is known of the tools it needed
    assert scraped(served, "toolquake_remedy_dropped_needed_total", profile="reversed-kept") == 0


def test_a_raising_remedy_is_skipped_the_request_served_and_counted(served, fake_upstream):
    t = tag()
    answer = _send(served, "broken-remedy", t)
    assert answer.choices[0].message.tool_calls[0].function.name == "weather_forecast"
    assert _upstream_tools(fake_upstream, t) == [["weather_forecast", "humidity_forecast"]]  # the next one ran
    text = _exposition(served)
    assert 'toolquake_remedy_failures_total{profile="broken-remedy",remedy="test_remedy_raises"} 1.0' in text
    assert 'toolquake_remedies_total{profile="broken-remedy",remedy="test_keep_tools"} 1.0' in text
    assert scraped(served, "toolquake_perturbation_failures_total", perturber="test_remedy_raises") == 0
    assert "this remedy always fails" in served.output()


@pytest.mark.needs_corpus
def test_a_needed_tool_a_remedy_dropped_is_counted_for_a_known_case(served, fake_upstream):
    from toolquake.bfcl.corpus import case_request, load_case

    wait_for(lambda: scraped(served, "toolquake_corpus_cases") > 0, what="the case index")
    body = case_request(load_case("multiple_0"))  # needs triangle_properties.get, the first of its two tools
    t = tag()
    _send(served, "case-kept", t, body["tools"], body["messages"], {"X-Toolquake-Case": "multiple_0"})
    assert _upstream_tools(fake_upstream, t) == [["circle_properties_get"]]
    assert 'toolquake_remedy_dropped_needed_total{profile="case-kept",remedy="test_keep_tools"} 1.0' in \
        _exposition(served)
    # the live row names it, in the remedy's step (kind "remedy"), for the report to count per case
    def scored() -> list[dict]:
        return [r for r in results.read_rows(served.db) if r["profile"] == "case-kept" and r["valid"] is not None]

    wait_for(lambda: bool(scored()), what="the scored row")
    [row] = scored()
    [step] = [s for s in row["perturbers"] if s.get("kind") == "remedy"]
    assert step["name"] == "test_keep_tools" and step["report"]["dropped_needed"] == ["triangle_properties_get"]
    assert not row["valid"]  # the model called the only tool it was left


def test_a_shadow_profile_of_remedies_only_compares_the_remedied_twin(served, fake_upstream):
    t = tag()
    answer = _send(served, "shadow-kept", t, TOOLS[:2])
    assert answer.choices[0].message.tool_calls[0].function.name == "weather_forecast"  # the client's own request
    wait_for(lambda: scraped(served, "toolquake_consistency_total", profile="shadow-kept") == 1, what="the twin")
    original, twin = _upstream_tools(fake_upstream, t)
    assert original == ["weather_forecast", "humidity_forecast"] and twin == ["humidity_forecast"]
    assert scraped(served, "toolquake_consistency_total", profile="shadow-kept", agree=DISAGREE) == 1
    assert 'toolquake_remedies_total{profile="shadow-kept",remedy="test_keep_tools"} 1.0' in _exposition(served)


def _admin(proxy, method: str, name: str, payload: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{proxy.url}/admin/profiles/{name}", json=payload,
                         headers={"Authorization": f"Bearer {ADMIN}"})


@pytest.mark.parametrize(("remedy", "status", "says"), [
    ({"name": "no_such_remedy"}, 400, "unknown remedy 'no_such_remedy'"),
    ({"name": "test_keep_tools", "params": {"k": "eight"}}, 400, "remedies[0]: remedy 'test_keep_tools'"),
    ({"name": "test_keep_tools", "params": {"nope": 1}}, 400, "remedies[0]: remedy 'test_keep_tools'"),
    ({"name": "test_remedy_host", "params": {"url": "http://127.0.0.1:9/elsewhere"}}, 403, "'url' may only be set"),
])
def test_the_admin_api_refuses_a_remedy_it_cannot_build_or_may_not_set(served, remedy, status, says):
    r = _admin(served, "PUT", "admin-remedied", {"remedies": [remedy]})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    assert _admin(served, "GET", "admin-remedied").status_code == 404  # nothing changed


def test_the_admin_api_adds_a_remedied_profile_and_shows_remedies_masked(served, fake_upstream):
    r = _admin(served, "PUT", "admin-kept", {"remedies": [{"name": "test_keep_tools", "params": {"k": 2}}]})
    assert r.status_code == 200, r.text
    assert r.json()["remedies"] == [{"name": "test_keep_tools", "params": {"k": 2}}]
    t = tag()
    _send(served, "admin-kept", t)
    assert _upstream_tools(fake_upstream, t) == [["weather_forecast", "humidity_forecast"]]
    shown = _admin(served, "GET", "hosted").json()
    assert shown["remedies"][0]["params"]["url"] != SECRET_URL and "s3cret" not in json.dumps(shown)
    # the operator's own value, sent back unchanged, is allowed
    again = _admin(served, "PUT", "hosted", {"remedies": [{"name": "test_remedy_host", "params": {"url": SECRET_URL}}]})
    assert again.status_code == 200, again.text
