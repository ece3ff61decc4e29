"""Live scoring of Responses API traffic: the same verdicts, metrics and rows as on chat completions.

The answers are built from the ground truth (right) and from a changed value (wrong); the expected
verdict of each is computed here by the scorer from the message the client got.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.live.test_live_scoring import MODEL, expected_verdict, gt_calls, live_config, wrong_value
from tests.support import scraped, wait_for
from toolquake.proxy.live import results


def message_of_response(response) -> dict:
    """The chat message a Responses answer stands for (what the scorer reads)."""
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if item.type == "function_call"]
    return {"role": "assistant", "tool_calls": calls} if calls else {"role": "assistant", "content": ""}


@pytest.mark.needs_corpus
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_answers_to_known_cases_are_scored_and_stored(proxy_factory, tmp_path, stream):
    from toolquake.bfcl.corpus import case_request, load_case

    db = tmp_path / "live.sqlite"
    proxy = proxy_factory(live_config(db, semantic=False))
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
    wait_for(lambda: len(results.read_rows(db)) == 2, what="both rows stored")
    for row in results.read_rows(db):
        verdict, error = sent[row["request_id"]]
        assert row["route"] == "responses" and row["stream"] == int(stream)
        assert ("valid" if row["valid"] else "invalid") == verdict and (row["taxonomy"] or None) == error
    assert scraped(proxy, "toolquake_scored_total", profile="reversed", verdict="valid") == 1
    assert scraped(proxy, "toolquake_scored_total", profile="reversed", verdict="invalid") == 1
