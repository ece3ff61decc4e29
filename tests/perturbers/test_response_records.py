"""response_lengthening with real records of the same endpoint (seed 003 challenge 2, issue #17): on real BFCL
multi-turn steps (the ground truth played on BFCL's simulators), the prefix property, the response budget, the
answer's needles and where the records come from; live, through the proxy, records seen earlier in traffic."""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

import openai
import pytest

from tests.support import recorded
from tests.support.lengthening import RESPONSE, car, records_of, tool_request
from toolquake.perturbers import build
from toolquake.perturbers.base import NOT_PERTURBED, ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.lengthening.records import find_main_array
from toolquake.perturbers.helpers.tokens import EstimateCounter

RESP = {"budget_scope": "response", "records": "auto", "position": 0.0, "target": "last"}
CASES = 100  # the first 100 multi_turn_base cases: ~360 steps that end in a tool response
TOLERANCE = 0.02  # the response-scope budget is met within 2 % (the estimate counter is additive: exact to a unit)


def perturb(params: dict[str, Any], body: dict[str, Any], case: Any = None, services: Services | None = None,
            seed: int = 5) -> tuple[dict[str, Any], dict[str, Any]]:
    services = services or Services(token_counter=EstimateCounter())
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=services, case=case)
    out = build("response_lengthening", params).apply(ChatRequest(body), ctx)
    return out.body, ctx.report


def played_steps(case: Any, backends: Any) -> Iterator[tuple[list[dict[str, Any]], str, Any]]:
    """Each request of the ground-truth trajectory that ends in tool results: (messages, last tool's name,
    the decoded last result), as proxy/replay/multiturn.py sends them."""
    from toolquake.bfcl.simulators import parse_call
    from toolquake.scorers.multiturn import long_context_of

    world = backends.world(list(case.extra["involved_classes"]), case.extra.get("initial_config") or {},
                           long_context_of(case))
    messages: list[dict[str, Any]] = []
    try:
        for t, turn in enumerate(case.turns):
            messages.extend(dict(m) for m in turn)
            calls = [parse_call(text) for text in case.ground_truth[t]]
            if not calls:
                continue
            results = world.execute(calls)
            ids = [f"call_{t}_{i}" for i in range(len(calls))]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.kwargs)}}
                for i, c in zip(ids, calls)]})
            messages.extend({"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results))
            yield list(messages), calls[-1].name, results[-1]
    finally:
        world.close()


@pytest.fixture(scope="module")
def steps(backends: Any) -> list[dict[str, Any]]:
    """Real multi_turn_base steps whose last tool response has an array of records, padded to 10K and 20K."""
    from toolquake.bfcl.corpus import load_category

    out = []
    for case in load_category("multi_turn_base")[:CASES]:
        for messages, tool, result in played_steps(case, backends):
            try:
                value = json.loads(result)
            except ValueError:
                continue
            if not isinstance(value, (dict, list)) or find_main_array(value) is None:
                continue
            body = {"model": "m", "messages": messages}
            padded = {k: perturb({**RESP, "budget_tokens": k}, body, case) for k in (10_000, 20_000)}
            out.append({"case": case, "messages": messages, "tool": tool, "value": value, "padded": padded})
    return out


@pytest.fixture(scope="module")
def bank() -> Any:
    from toolquake.perturbers.helpers.lengthening.record_bank import CorpusBank

    loaded = CorpusBank.load()
    if loaded.info.get("error"):
        pytest.skip(f"no record bank: {loaded.info['error']}")
    return loaded


def last_records(body: dict[str, Any]) -> list[Any]:
    value = json.loads(body["messages"][-1]["content"])
    return find_main_array(value)[1]


@pytest.mark.needs_corpus
def test_the_corpus_bank_holds_records_per_function(bank: Any) -> None:
    info = bank.info
    assert info["cases"] == 800 and info["calls"] > 4000, info  # the four multi_turn_* categories, 200 cases each
    assert set(info["per_function"]) == set(bank.records)
    for name, records in bank.records.items():
        texts = [json.dumps(r, sort_keys=True) for r in records]
        assert len(texts) == len(set(texts)), f"{name}: the bank holds a record twice"
    assert len(bank.get("ls")) >= 20 and len(bank.get("get_stock_info")) > 100


@pytest.mark.needs_corpus
def test_the_10k_records_are_a_prefix_of_the_20k_records(steps: list[dict[str, Any]]) -> None:
    assert len(steps) >= 20, "too few real steps with records to test on"
    short = [s["case"].id for s in steps if "budget_reached" in s["padded"][10_000][1]]
    print(f"{len(steps)} steps; short of the budget: {short}")
    for s in steps:
        (small, rs), (large, rl) = s["padded"][10_000], s["padded"][20_000]
        a, b = last_records(small), last_records(large)
        if rs.get("budget_reached", True):
            assert len(b) > len(a) > len(find_main_array(s["value"])[1]), (s["case"].id, rs, rl)
        else:  # records that cannot be varied and a small bank: both stop where the records run out
            assert a == b and rl["budget_reached"] is False, (s["case"].id, rs, rl)
        assert b[:len(a)] == a, f"{s['case'].id}: the 10K response is not a prefix of the 20K one"
        assert a[:len(find_main_array(s["value"])[1])] == find_main_array(s["value"])[1], "originals first"


@pytest.mark.needs_corpus
def test_the_padded_response_holds_the_budget_in_tokens(steps: list[dict[str, Any]]) -> None:
    counter = EstimateCounter()
    short = 0
    for s in steps:
        for budget, (body, report) in s["padded"].items():
            tokens = counter.count_text(body["messages"][-1]["content"])
            assert report["tokens_total"] == tokens and report["budget_scope"] == "response"
            if report.get("budget_reached", True):
                assert abs(tokens - budget) <= TOLERANCE * budget, (s["case"].id, budget, tokens, report)
            else:  # said, and true: every record of the bank was used and there are no look-alikes
                short += 1
                assert tokens < budget and report["records_lookalike"] == 0, report
                assert report["records_bank"] + report["records_rejected"] <= report["records_detail"][0]["bank_size"]
            assert body["messages"][:-1] == s["messages"][:-1], "only the last tool message changes"
    assert short < len(steps) // 4, f"{short} of {2 * len(steps)} padded responses fell short of the budget"


def needle_values(case: Any, messages: list[dict[str, Any]], value: Any) -> set[Any]:
    """Computed here, apart from the perturber: values of the response that the turn's ground truth uses."""
    from toolquake.bfcl.simulators import parse_call

    turn = sum(1 for m in messages if m["role"] == "user") - 1
    args = [a for c in map(parse_call, case.ground_truth[turn]) for a in (*c.args, *c.kwargs.values())]

    def flat(v: Any) -> Iterator[Any]:
        if isinstance(v, dict):
            for x in v.values():
                yield from flat(x)
        elif isinstance(v, list):
            for x in v:
                yield from flat(x)
        elif not isinstance(v, bool) and v is not None:
            yield v.strip().lower() if isinstance(v, str) else float(v)

    wanted = set(flat(args))
    return {x for x in flat(value) if x in wanted and x != ""}


def holds(record: Any, needles: set[Any]) -> bool:
    if isinstance(record, dict):
        return any(holds(x, needles) for x in record.values())
    if isinstance(record, list):
        return any(holds(x, needles) for x in record)
    if isinstance(record, bool) or record is None:
        return False
    return (record.strip().lower() if isinstance(record, str) else float(record)) in needles


@pytest.mark.needs_corpus
def test_no_padding_record_holds_a_value_the_answer_uses(steps: list[dict[str, Any]]) -> None:
    with_needles = extremes = rejected = 0
    for s in steps:
        needles = needle_values(s["case"], s["messages"], s["value"])
        originals = find_main_array(s["value"])[1]
        body, report = s["padded"][20_000]
        assert report["answer_check"] == "ground truth"
        padding = last_records(body)[len(originals):]
        assert not [r for r in padding if holds(r, needles)], (s["case"].id, needles)
        if needles:
            with_needles += 1  # e.g. the folder `ls` listed that the next `cd` enters: its record is never repeated
            # post_tweet's tags: the bank holds "#roadtrip" from other cases when the answer posts "#RoadTrip"
            rejected += report["records_rejected"] > 0
        for low in [n for n in needles if isinstance(n, float)]:  # a numeric needle that is an extreme stays one
            plain = [float(o) for o in originals if isinstance(o, (int, float)) and not isinstance(o, bool)]
            for extreme, beats in ((min, lambda v, n: v <= n), (max, lambda v, n: v >= n)):
                if plain and extreme(plain) == low:
                    extremes += 1
                    assert not [v for v in padding if isinstance(v, (int, float)) and beats(float(v), low)]
    print(f"steps with needles {with_needles}, with bank records rejected {rejected}; numeric extremes {extremes}")
    assert with_needles >= 5, f"only {with_needles} steps whose response holds a value of the ground truth"
    assert rejected >= 2, "no step on which the bank offered a record holding a needle: the check went untested"


@pytest.mark.needs_corpus
def test_padding_records_come_from_the_same_functions_bank(steps: list[dict[str, Any]], bank: Any) -> None:
    from_bank = 0
    for s in steps:
        originals = find_main_array(s["value"])[1]
        body, report = s["padded"][20_000]
        padding = last_records(body)[len(originals):]
        own = {json.dumps(r, sort_keys=True) for r in bank.get(s["tool"])}
        used = report["records_bank"]
        assert used == len([r for r in padding if json.dumps(r, sort_keys=True) in own][:used])
        head = padding[:used]  # the bank's records come first, the look-alikes after them
        assert all(json.dumps(r, sort_keys=True) in own for r in head), s["case"].id
        assert not [r for r in head if r in originals], "a response is never padded with its own records"
        from_bank += used
        assert report["records_source"] in ("endpoint", "endpoint+lookalike", "lookalike"), report
        if used and report["records_lookalike"]:
            assert report["records_source"] == "endpoint+lookalike"
    assert from_bank > 0


def test_an_extreme_value_the_answer_uses_stays_extreme() -> None:
    """The cheapest car is the answer (its price is a ground-truth argument): no padding record may be as cheap,
    nor hold its id; without a bank for the tool, look-alikes are drawn and checked the same way."""
    from toolquake.bfcl.corpus import Case

    case = Case(id="user_cheapest", category="user", turns=[], functions=[],
                ground_truth=[{"book_car": {"vehicle_id": ["693265999"], "price": [99.1]}}])
    body = tool_request()
    out, report = perturb({**RESP, "budget_tokens": 10_000}, body, case)
    recs = records_of(out)
    originals = RESPONSE["data"]["search_results"]
    assert recs[:2] == originals and len(recs) > 20
    prices = [r["pricing_info"]["base_price"] for r in recs[2:]]
    assert min(prices) > 99.1, min(prices)
    assert all(r["vehicle_id"] != "693265999" for r in recs[2:])
    assert report["records_rejected"] > 0 and report["records_source"] == "lookalike", report
    # the plain look-alikes (the default) do not check: prices drift ±30 %, some below the answer
    plain, _ = perturb({"budget_tokens": 10_000, "position": 1}, body, case)
    assert min(r["pricing_info"]["base_price"] for r in records_of(plain)[2:]) < 99.1


def test_target_all_counts_every_padded_response_together() -> None:
    weather = json.dumps({"forecast": [{"day": "Mon", "high_c": 24, "sky": "sunny"},
                                       {"day": "Tue", "high_c": 21, "sky": "cloudy"}]})
    body = tool_request(extra_tool=weather)
    out, report = perturb({**RESP, "target": "all", "budget_tokens": 8_000}, body)
    counter = EstimateCounter()
    sizes = [counter.count_text(out["messages"][i]["content"]) for i in (3, 4)]
    assert abs(sum(sizes) - 8_000) <= TOLERANCE * 8_000, sizes
    assert report["tokens_total"] == sum(sizes) and report["targets"] == 2
    added = [len(records_of(out, i)) - 2 for i in (3, 4)]
    assert min(added) > 20 and abs(added[0] - added[1]) <= 1, "the records are shared evenly between the responses"
    assert [d["records_lookalike"] for d in report["records_detail"]] == added


def test_without_ground_truth_the_report_says_the_answer_was_not_checked() -> None:
    _, report = perturb({**RESP, "budget_tokens": 5_000}, tool_request())
    assert report["answer_check"].startswith("none")


def test_a_response_without_records_is_not_perturbed() -> None:
    out, report = perturb({**RESP, "budget_tokens": 5_000}, tool_request(content=json.dumps({"status": "ok"})))
    assert out == tool_request(content=json.dumps({"status": "ok"}))
    assert NOT_PERTURBED in report


def test_endpoint_records_refuse_a_tool_the_bank_does_not_know() -> None:
    body = tool_request()
    out, report = perturb({**RESP, "records": "endpoint", "budget_tokens": 5_000}, body)
    assert out == body and "no records" in report["skipped_messages"][0]["reason"]


def test_a_response_the_assistant_already_answered_is_left_alone() -> None:
    """A new turn's first request still holds the last turn's tool results: the paper's protocol grows the response
    the next answer is about, so real-record padding leaves them alone (the default look-alikes do not look)."""
    body = tool_request()
    messages = body["messages"][:-1] + [{"role": "assistant", "content": "It is 7.9."},
                                        {"role": "user", "content": "Thanks. And the cheapest one?"}]
    answered = {**body, "messages": messages}
    out, report = perturb({**RESP, "budget_tokens": 5_000}, answered)
    assert out == answered and NOT_PERTURBED in report
    plain, _ = perturb({"budget_tokens": 5_000}, answered)
    assert len(records_of(plain)) > 2


def two_responses(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> dict[str, Any]:
    """A conversation that searched cars twice: the first results, then the second (the last tool message)."""
    body = tool_request(content=json.dumps({"data": {"search_results": first}}))
    messages = body["messages"][:-1] + [
        {"role": "user", "content": "Any cheaper ones in Burbank?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "search_car_rentals", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": json.dumps({"data": {"search_results": second}})},
        body["messages"][-1]]
    return {**body, "messages": messages}


@pytest.mark.parametrize("stream", [False, True])
def test_live_resp_10k_pads_with_records_of_that_tool_seen_earlier(proxy, fake_upstream, stream: bool) -> None:
    tag = f"resp-live-{stream}"
    earlier = [car(f"5550{i:05d}", name, 80.0 + i, 8.0, "Sixt Burbank")
               for i, name in enumerate(["Kia Rio", "Mazda 3", "Honda Fit", "VW Golf"])]
    seen = two_responses(earlier, [car("7770001", "Fiat 500", 70.0, 9.0, "Hertz Burbank")])
    client = openai.OpenAI(base_url=f"{proxy.url}/p/resp-10k-p1/v1", api_key="sk-test")
    answer = client.chat.completions.create(model="fake-model", messages=seen["messages"], tools=seen["tools"],
                                            stream=stream, extra_headers={"X-Test-Tag": tag})
    if stream:
        assert [c for c in answer]
    sent = json.loads(recorded(fake_upstream, tag)[-1]["body"])
    recs = records_of(sent, len(sent["messages"]) - 2)
    originals = [car("7770001", "Fiat 500", 70.0, 9.0, "Hertz Burbank")]
    assert recs[:1] == originals, "the response's own record first (position 0.0)"
    assert sorted(recs[1:5], key=lambda r: r["vehicle_id"]) == earlier, "then the records seen earlier"
    assert all(r["vehicle_id"] not in {e["vehicle_id"] for e in earlier} for r in recs[5:]), "never twice"
    tokens = EstimateCounter().count_text(sent["messages"][-2]["content"])
    assert abs(tokens - 10_000) <= TOLERANCE * 10_000
    assert sent["messages"][:-2] == seen["messages"][:-2] and sent["messages"][-1] == seen["messages"][-1]


@pytest.mark.parametrize("live_records", ["request", "process"])
def test_another_requests_records_pad_only_when_the_process_bank_is_asked_for(live_records: str) -> None:
    """One proxy process (one Services) serves two clients: by default the second client's response is padded
    with look-alikes of its own records, never with records the first client's tool returned."""
    services = Services(token_counter=EstimateCounter())
    first = [car(f"4440{i:05d}", name, 90.0 + i, 8.0, "Avis Oakland")
             for i, name in enumerate(["Seat Ibiza", "Opel Corsa", "Skoda Fabia"])]
    params = {**RESP, "budget_tokens": 3_000, "live_records": live_records}
    perturb(params, tool_request(content=json.dumps({"data": {"search_results": first}})), services=services)
    mine = [car("8880001", "Fiat 500", 70.0, 9.0, "Hertz Burbank")]
    out, report = perturb(params, tool_request(content=json.dumps({"data": {"search_results": mine}})),
                          services=services)
    recs = records_of(out)
    assert recs[0] == mine[0] and len(recs) > len(first) + 1
    theirs = {r["vehicle_id"] for r in first}
    used = [r for r in recs if r["vehicle_id"] in theirs]
    if live_records == "process":
        assert sorted(used, key=lambda r: r["vehicle_id"]) == first
    else:
        assert used == [] and report["records_source"] == "lookalike", report
