"""Live scoring on the fast path (#34): with scoring on, as `toolquake serve` runs by default, a request that no
profile perturbs takes the lean path and is decoded whole only when it is tied to a case — by its
`X-Toolquake-Case` header or by the hash of its first user message — and then scored as before. Any other
request is decoded once (the typed validation every request gets) and counted as unlabeled.

The decodes are counted by the proxy itself (`toolquake_request_decodes_total{kind}`, at the decode sites);
the verdicts are computed here by the scorer from the answers the client got.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support import recorded, scraped, wait_for
from tests.support.chat import tag
from tests.support.live import MODEL, expected_verdict, gt_calls, message_of_response, send, wrong_value
from tests.support.shadow import MESSAGES, TOOLS
from toolquake.proxy import live
from toolquake.proxy.live import recording, results
from toolquake.proxy.server import lean
from toolquake.proxy.server.app import create_app
from toolquake.proxy.server.config import load_config

CHAT_PATHS = ("/v1/chat/completions", "/v1/responses", "/p/off/v1/chat/completions")


def _scope(path: str) -> dict:
    # as uvicorn gives it (the lean path reads the raw path: an escape in it goes to the framework's guard)
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "headers": []}


def _app(tmp_path, extra: str = ""):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[scoring]\nstore = "{tmp_path / "r.sqlite"}"\n[profiles.shuffled]\nmode = "perturb"\n'
                   f'perturbers = [{{ name = "tool_order" }}]\n{extra}')
    config = load_config(cfg, env={}, overrides={"upstream": "http://127.0.0.1:9/v1"})
    return create_app(config, extensions=[live.attach, recording.attach])  # as `toolquake serve` attaches them


def test_with_scoring_on_requests_nothing_perturbs_take_the_lean_path(tmp_path):
    app = _app(tmp_path)
    st = app.state.proxy
    assert st.config.scoring.enabled and st.case_observers and not st.observers  # live scoring is attached
    adapter = lean.LeanPath.of(app)
    assert adapter is not None
    for path in CHAT_PATHS:
        assert adapter._route(_scope(path)) is not None, path
    # a perturbing profile still goes to the framework's route
    assert adapter._route(_scope("/p/shuffled/v1/chat/completions")) is None


def test_an_observer_of_every_request_keeps_them_off_the_lean_path(tmp_path):
    """A recording reads every unperturbed exchange: those requests are decoded and take the framework's route."""
    app = _app(tmp_path, f'[record]\npath = "{tmp_path / "rec.jsonl"}"\n')
    assert app.state.proxy.observers
    adapter = lean.LeanPath.of(app)
    assert all(adapter._route(_scope(path)) is None for path in CHAT_PATHS)


def _decodes(proxy) -> tuple[float, float]:
    return (scraped(proxy, "toolquake_request_decodes_total", kind="typed"),
            scraped(proxy, "toolquake_request_decodes_total", kind="whole"))


@pytest.mark.needs_corpus
def test_default_server_scores_matched_requests_and_decodes_the_others_once(proxy_factory, tmp_path):
    from toolquake.bfcl.corpus import case_request, load_case

    db = tmp_path / "default.sqlite"
    proxy = proxy_factory(None, None, None, "--results-db", str(db))  # the packaged config: scoring on
    wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, what="the case index")
    case = load_case("multiple_2")
    body = case_request(case)
    renamed = [{"type": "function", "function": {**t["function"], "name": t["function"]["name"] + "_v2"}}
               for t in body["tools"]]
    question = [{"role": "user", "content": "Which tools do you have?"}]
    responses = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-live", max_retries=0).responses

    # matching no case: tools no case has; the case's question under other tool names; the case's own tools
    # with another question (hashed, found nowhere); a Responses request without tools
    for unmatched in ({"messages": MESSAGES, "tools": TOOLS}, {**body, "tools": renamed},
                      {**body, "messages": question}):
        send(proxy, "off", unmatched, answer={"text": "fine"}, case_header=None, stream=False)
    responses.create(model=MODEL, input="hi")
    assert _decodes(proxy) == (4, 0)  # each validated once, none decoded whole
    wait_for(lambda: scraped(proxy, "toolquake_scoring_skipped_total", profile="off", reason="unlabeled") == 4,
             what="four unlabeled requests")

    # matching: by content (chat, then Responses), and by header
    sent = {}
    rid, message = send(proxy, "off", body, answer={"calls": gt_calls(case)}, case_header=None, stream=False)
    sent[rid] = (case, "content", expected_verdict(case, message))
    other = load_case("simple_python_1")
    rid, message = send(proxy, "off", case_request(other), answer={"calls": wrong_value(gt_calls(other))},
                        case_header=other.id, stream=True)
    sent[rid] = (other, "header", expected_verdict(other, message))
    third = load_case("simple_python_0")
    third_body = case_request(third)
    raw = responses.with_raw_response.create(
        model=MODEL, input=third_body["messages"], tools=[{"type": "function", **t["function"]}
                                                          for t in third_body["tools"]],
        extra_headers={"X-Fake-Answer": json.dumps({"calls": gt_calls(third)})})
    sent[raw.headers["x-toolquake-request-id"]] = (third, "content",
                                                    expected_verdict(third, message_of_response(raw.parse())))
    assert {verdict for _, _, (verdict, _) in sent.values()} == {"valid", "invalid"}
    assert _decodes(proxy) == (7, 3)  # each matched request decoded whole once more, for its scorer

    wait_for(lambda: len(results.read_rows(db)) == 3, what="the three rows")
    for row in results.read_rows(db):
        expected_case, resolved_by, (verdict, error) = sent[row["request_id"]]
        assert (row["case_id"], row["resolved_by"], row["profile"]) == (expected_case.id, resolved_by, "off")
        assert ("valid" if row["valid"] else "invalid") == verdict and (row["taxonomy"] or None) == error
    assert scraped(proxy, "toolquake_scored_total", verdict="valid") == sum(
        v == "valid" for _, _, (v, _) in sent.values())
    assert scraped(proxy, "toolquake_scored_total") == 3
    assert scraped(proxy, "toolquake_scoring_skipped_total", reason="unlabeled") == 4


@pytest.mark.parametrize("extra", [(), ("--no-scoring",)], ids=["default", "no-scoring"])
def test_a_body_that_is_not_utf8_is_refused_though_nothing_decodes_it_whole(request, proxy_factory, fake_upstream,
                                                                            extra):
    """The typed decode skips the fields the proxy does not read without looking inside them; a body that is not
    UTF-8 is still refused (400 invalid_json, as a decoded one is), never forwarded. The default server is the
    session's proxy (the packaged config, scoring on)."""
    proxy = proxy_factory(None, None, None, *extra) if extra else request.getfixturevalue("proxy")
    messages = b'"messages": [{"role": "user", "content": "hi"}]'
    large = ('{"note": "' + "\u00e9" * 40_000 + '", ').encode() + messages + b"}"  # 80 KB of two-byte characters
    cut = 65_536 + 1  # past the first 64 KiB slice, the second byte of a two-byte character replaced
    bodies = {"a key": b'{"\xffmodel": "m", ' + messages + b"}",
              "a skipped value, beyond the first 64 KiB": large[:cut] + b"\xff" + large[cut + 1:],
              "a character cut short at the end of a skipped value": b'{"note": "\xc3", ' + messages + b"}"}
    for what, raw in bodies.items():
        t = tag()
        r = httpx.post(f"{proxy.url}/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json", "x-test-tag": t})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (what, r.text[:300])
        assert recorded(fake_upstream, t) == [], what
    t = tag()  # the same large body, valid: relayed
    r = httpx.post(f"{proxy.url}/v1/chat/completions", content=large,
                   headers={"content-type": "application/json", "x-test-tag": t})
    assert r.status_code == 200 and len(recorded(fake_upstream, t)) == 1
