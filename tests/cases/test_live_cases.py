"""Live scoring of your own cases: `toolquake serve --cases FILE` ties requests to them by content hash (or
X-Toolquake-Case) and scores them; the verdicts show up on /metrics under the case's category and in the
results store."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support import scraped, start_proxy, wait_for
from tests.support.cases import TIME, WEATHER
from toolquake.proxy.live import results
from toolquake.proxy.replay.report import summarize_db

SYSTEM = {"role": "system", "content": "You answer travellers."}
CASES = [
    {"id": "paris", "messages": [SYSTEM, {"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME],
     "expected": [{"name": "get_weather", "arguments": {"city": ["Paris"], "unit": ["celsius", ""]}}]},
    {"id": "tokyo", "messages": [SYSTEM, {"role": "user", "content": "What time is it in Tokyo?"}],
     "tools": [WEATHER, TIME], "expected": [{"name": "get_time", "arguments": {"tz": ["Asia/Tokyo"]}}]},
    {"id": "thanks", "category": "smalltalk", "messages": [SYSTEM, {"role": "user", "content": "Thanks a lot!"}],
     "tools": [WEATHER, TIME], "expected": "no call"},
]
#: (case, what the client sends as the user message, the fake's answer, header?, expected (valid, taxonomy))
SENT = [
    ("paris", "Weather in Paris?", {"calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}, False,
     (True, None)),
    # the same conversation in other case and spacing: the content hash normalises it
    ("paris", "  weather in   PARIS? ", {"calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}]}, False,
     (False, "wrong_param_value")),
    ("tokyo", "What time is it in Tokyo?", {"calls": [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]},
     False, (False, "wrong_function")),
    ("thanks", "Thanks a lot!", {"text": "You are welcome."}, False, (True, None)),
    ("thanks", "a message no case has", {"calls": [{"name": "get_time", "arguments": {"tz": "UTC"}}]}, True,
     (False, "irrelevance_violation")),
]


@pytest.fixture
def served(fake_upstream, tmp_path):
    cases = tmp_path / "mine.jsonl"
    cases.write_text("".join(json.dumps(c) + "\n" for c in CASES))
    db = tmp_path / "live.sqlite"
    config = f'[server]\nmodel_allowlist = ["fake-model"]\n\n[scoring]\nstore = "{db}"\nsemantic = false\n'
    proxy = start_proxy(fake_upstream.url, config, None, "--cases", str(cases))
    yield proxy, db
    proxy.stop()


def test_user_cases_are_scored_live_by_content_hash_and_header(served):
    proxy, db = served
    sdk = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0)
    by_id = {c["id"]: c for c in CASES}
    request_ids: list[str] = []
    for case_id, text, answer, by_header, _ in SENT:
        case = by_id[case_id]
        headers = {"X-Fake-Answer": json.dumps(answer)}
        if by_header:
            headers["X-Toolquake-Case"] = case_id
        raw = sdk.chat.completions.with_raw_response.create(
            model="fake-model", messages=[SYSTEM, {"role": "user", "content": text}], tools=case["tools"],
            extra_headers=headers)
        request_ids.append(raw.headers["x-toolquake-request-id"])
    # a request of no case: counted as unlabeled, not scored
    sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                tools=[WEATHER, TIME])
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == len(SENT), what="every answer scored")
    wait_for(lambda: len(results.read_rows(db)) == len(SENT), what="every row stored")
    want: dict[tuple[str, str], int] = {}
    for case_id, _, _, _, (valid, _) in SENT:
        key = (by_id[case_id].get("category", "mine"), "valid" if valid else "invalid")
        want[key] = want.get(key, 0) + 1
    for (category, verdict), n in want.items():
        assert scraped(proxy, "toolquake_scored_total", category=category, verdict=verdict) == n, (category, verdict)
    assert scraped(proxy, "toolquake_scoring_skipped_total", reason="unlabeled") == 1
    assert scraped(proxy, "toolquake_errors_total", error_type="wrong_function") == 1
    stored = {r["request_id"]: r for r in results.read_rows(db)}  # two workers: rows may land in any order
    rows = [stored[i] for i in request_ids]
    assert [(r["case_id"], bool(r["valid"]), r["taxonomy"]) for r in rows] == [
        (case_id, valid, taxonomy) for case_id, _, _, _, (valid, taxonomy) in SENT]
    assert [r["resolved_by"] for r in rows] == ["header" if h else "content" for *_, h, _ in SENT]
    assert [r["category"] for r in rows] == ["mine", "mine", "mine", "smalltalk", "smalltalk"]
    assert rows[3]["expected"] == "irrelevance" and rows[0]["expected"] == "ground_truth"
    summary = summarize_db(db)
    assert summary["arms"]["off"]["by_category"]["mine"]["accuracy"] == pytest.approx(1 / 3)
