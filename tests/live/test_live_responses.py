"""Live scoring of Responses API traffic: the same verdicts, metrics and rows as on chat completions.

The answers are built from the ground truth (right) and from a changed value (wrong); the expected
verdict of each is computed here by the scorer from the message the client got. One proxy for the module: each
test reads the rows of its own requests and what they added to the counters.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.support import scraped, start_proxy, wait_for
from tests.support.live import MODEL, expected_verdict, gt_calls, live_config, message_of_response, wrong_value
from toolquake.proxy.live import results


@pytest.fixture(scope="module")
def served(fake_upstream, tmp_path_factory):
    db = tmp_path_factory.mktemp("responses") / "live.sqlite"
    proxy = start_proxy(fake_upstream.url, live_config(db, semantic=False))
    yield proxy, db
    proxy.stop()


@pytest.mark.needs_corpus
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_answers_to_known_cases_are_scored_and_stored(served, stream):
    from toolquake.bfcl.corpus import case_request, load_case

    proxy, db = served
    before = {v: scraped(proxy, "toolquake_scored_total", profile="reversed", verdict=v) for v in ("valid", "invalid")}
    client = openai.OpenAI(base_url=f"{proxy.url}/p/reversed/v1", api_key="sk-live", max_retries=0)
    sent = {}
    for case_id, kind in (("simple_python_0", "right"), ("simple_python_1", "wrong")):
        case = load_case(case_id)
        body = case_request(case)
        calls = gt_calls(case) if kind == "right" else wrong_value(gt_calls(case))
        tools = [{"type": "function", **t["function"]} for t in body["tools"]]
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=body["messages"], tools=tools, stream=stream,
            extra_headers={"X-Toolquake-Case": case_id, "X-Fake-Answer": json.dumps({"calls": calls})})
        parsed = raw.parse()
        answer = list(parsed)[-1].response if stream else parsed
        sent[raw.headers["x-toolquake-request-id"]] = expected_verdict(case, message_of_response(answer))
    assert sorted(v for v, _ in sent.values()) == ["invalid", "valid"]  # the two answers really differ
    mine = lambda: [r for r in results.read_rows(db) if r["request_id"] in sent]  # noqa: E731
    wait_for(lambda: len(mine()) == 2, what="both rows stored")
    for row in mine():
        verdict, error = sent[row["request_id"]]
        assert row["route"] == "responses" and row["stream"] == int(stream)
        assert ("valid" if row["valid"] else "invalid") == verdict and (row["taxonomy"] or None) == error
    assert scraped(proxy, "toolquake_scored_total", profile="reversed", verdict="valid") == before["valid"] + 1
    assert scraped(proxy, "toolquake_scored_total", profile="reversed", verdict="invalid") == before["invalid"] + 1
