"""paraphrase against a real OpenAI-compatible server process (the fake upstream, scripted), and
through the proxy; the value checks (numbers, quoted strings) on their own."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.support import Proc, recorded, start_fake_upstream
from tests.support.llama_server import start_llama_server
from tests.support.ports import refusing_url
from toolquake.perturbers import build
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.protected import added_numbers, missing_from
from toolquake.perturbers.helpers.tokens import EstimateCounter
from toolquake.perturbers.paraphrase import EXAMPLE_REPHRASING, SYSTEM_PROMPT

GOOD = (
    "Calculate the depreciated value of a property costing $200,000 with an annual depreciation rate of 3% for 5 years."
)
GOOD_REPHRASED = "Determine the value of a $200,000 asset which loses 3% of its worth each year, after 5 years."
LOSES_NUMBER = "Find the area of a triangle with a base of 10 units and height of 5 units."
LOSES_NUMBER_REPHRASED = "What is the area of a triangle whose base is ten units and height is six units?"
IN_WORDS = "What will my $2,000 deposit be worth after 5 years at 3% a year?"
IN_WORDS_REPHRASED = "After five years at three percent per year, what is a two thousand dollar deposit worth?"
LOSES_QUOTE = 'Search my files for the phrase "quarterly report" in the docs folder.'
LOSES_QUOTE_REPHRASED = "Look through the docs folder for files mentioning the quarterly results."
QUOTED_ANSWER = "Which game had the highest number of points scored by one NBA player?"
QUOTED_QUERY = "What is the record for the highest number of points scored by a single player in an NBA game?"
ANSWERED = "How many moons does Mars have?"
ANSWERED_INSTEAD = "Mars has 2 moons, Phobos and Deimos."


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Iterator[Proc]:
    """A second fake upstream playing the generator: it answers each known request with a rephrasing."""
    script = tmp_path_factory.mktemp("gen") / "script.jsonl"
    entries = [
        (GOOD, GOOD_REPHRASED),
        (LOSES_NUMBER, LOSES_NUMBER_REPHRASED),
        (IN_WORDS, IN_WORDS_REPHRASED),
        (LOSES_QUOTE, LOSES_QUOTE_REPHRASED),
        (QUOTED_QUERY, f'"{QUOTED_ANSWER}"'),
        (ANSWERED, ANSWERED_INSTEAD),
    ]
    script.write_text("".join(json.dumps({"match": q, "answer": {"text": a}}) + "\n" for q, a in entries))
    proc = start_fake_upstream("--script", str(script))
    yield proc
    proc.stop()


def generator_requests(gen: Proc) -> list[dict[str, Any]]:
    return [
        json.loads(r["body"])
        for r in httpx.get(f"{gen.url}/_fake/requests").json()
        if r["path"].endswith("/chat/completions")
    ]


def request(text: str) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
    }


def run(gen_url: str, text: str, cache_dir: Path, **params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    perturber = build("paraphrase", {"generator_url": gen_url, "cache_dir": str(cache_dir), **params})
    ctx = PerturbContext(perturbation_seed=1, rng=random.Random(1), services=Services(token_counter=EstimateCounter()))
    out = perturber.apply(ChatRequest(request(text)), ctx)
    return out.body, ctx.report


@pytest.mark.processes
def test_accepted_paraphrase_replaces_the_last_user_message(generator, tmp_path) -> None:
    before = len(generator_requests(generator))
    out, report = run(f"{generator.url}/v1", GOOD, tmp_path, generator_model="rephraser")
    assert report["paraphrase"] == "accepted" and report["cached"] is False
    assert out["messages"][-1] == {"role": "user", "content": GOOD_REPHRASED}
    assert out["messages"][0] == request(GOOD)["messages"][0]
    assert report["tokens_added"] == EstimateCounter().count_text(GOOD_REPHRASED) - EstimateCounter().count_text(GOOD)
    sent = generator_requests(generator)[before:]
    assert len(sent) == 1
    asked = sent[0]
    assert asked["model"] == "rephraser" and asked["temperature"] == 0
    assert asked["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert asked["messages"][2]["content"] == EXAMPLE_REPHRASING
    assert asked["messages"][-1] == {"role": "user", "content": GOOD}


@pytest.mark.processes
def test_the_disk_cache_makes_replays_stable_without_the_generator(generator, tmp_path) -> None:
    run(f"{generator.url}/v1", GOOD, tmp_path)
    files = list(tmp_path.rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["original"] == GOOD
    before = len(generator_requests(generator))
    out, report = run(f"{generator.url}/v1", GOOD, tmp_path)
    assert report["cached"] is True and out["messages"][-1]["content"] == GOOD_REPHRASED
    assert len(generator_requests(generator)) == before, "a cached paraphrase asks the generator nothing"
    # another replica sharing the directory, whose generator is down, gets the same answer
    with refusing_url("/v1") as dead:
        out, report = run(dead, GOOD, tmp_path)
    assert out["messages"][-1]["content"] == GOOD_REPHRASED and report["cached"] is True


@pytest.mark.processes
@pytest.mark.parametrize(
    "text,lost", [(LOSES_NUMBER, ["5"]), (LOSES_QUOTE, ['"quarterly report"']), (ANSWERED, ["new 2"])]
)
def test_paraphrase_losing_a_value_is_rejected_and_counted(generator, tmp_path, text: str, lost: list[str]) -> None:
    out, report = run(f"{generator.url}/v1", text, tmp_path)
    assert out == request(text)
    assert report["paraphrase"] == "rejected" and report["rejected_for"] == lost
    assert report["not_perturbed"] == "rephrasing rejected"  # the pair is counted apart, not scored in the arm


@pytest.mark.processes
def test_numbers_spelled_out_in_the_rephrasing_are_kept_values(generator, tmp_path) -> None:
    out, report = run(f"{generator.url}/v1", IN_WORDS, tmp_path)
    assert report["paraphrase"] == "accepted" and "not_perturbed" not in report
    assert out["messages"][-1]["content"] == IN_WORDS_REPHRASED


@pytest.mark.processes
def test_quotes_wrapping_the_whole_answer_are_removed(generator, tmp_path) -> None:
    out, report = run(f"{generator.url}/v1", QUOTED_QUERY, tmp_path)
    assert report["paraphrase"] == "accepted"
    assert out["messages"][-1]["content"] == QUOTED_ANSWER


def test_unreachable_generator_raises_so_the_pipeline_serves_unperturbed(tmp_path) -> None:
    with refusing_url("/v1") as dead, pytest.raises(httpx.HTTPError):
        run(dead, GOOD, tmp_path, timeout_s=2)
    assert not list(tmp_path.rglob("*.json")), "failures are not cached"


def test_value_checks() -> None:
    assert missing_from("Pay $1,200 on 2024-05-01", "On 2024-05-01, pay 1200 dollars") == []
    assert missing_from("Pay $1,200 now", "Pay twelve hundred now") == []  # seed 001 §2.1: numbers in words
    assert missing_from("for 5 years", "for five years") == []
    assert missing_from("sides 5, 4 and 3", "sides five, four and three") == []
    assert missing_from("sides 5, 4 and 3", "sides five, four and two") == ["3"]
    assert missing_from("250 dollars", "two hundred and fifty dollars") == []
    assert added_numbers("for five years", "for 5 years") == []
    assert missing_from("rate of -2.5 per 'unit'", "a -2.5 rate per item") == ['"unit"']
    assert missing_from("Find 'Miami, FL' weather", "Weather for 'Miami, FL'") == []
    assert added_numbers("Book 3 rooms for 2024-05-01", "Reserve 3 rooms on 2024-05-01") == []
    assert added_numbers("Book three rooms", "Book 3 rooms at 10:30") == ["10", "30"]  # three = 3


def test_parameters_are_checked(monkeypatch) -> None:
    monkeypatch.delenv("TOOLQUAKE_GENERATOR_URL", raising=False)
    monkeypatch.delenv("TOOLQUAKE_GENERATOR_MODEL", raising=False)
    assert build("paraphrase", {}).params()["generator_url"] == "http://127.0.0.1:8000/v1"  # the default upstream
    monkeypatch.setenv("TOOLQUAKE_GENERATOR_URL", "http://rephraser:8000/v1")
    monkeypatch.setenv("TOOLQUAKE_GENERATOR_MODEL", "fixed")
    params = build("paraphrase", {}).params()  # a fixed rephraser, recorded in the arm's parameters
    assert (params["generator_url"], params["generator_model"]) == ("http://rephraser:8000/v1", "fixed")
    assert build("paraphrase", {"generator_url": "http://x/v1"}).params()["generator_url"] == "http://x/v1"
    with pytest.raises(ValueError):
        build("paraphrase", {"generator_url": "localhost:8000"})
    with pytest.raises(ValueError):
        build("paraphrase", {"generator_url": "http://x/v1", "temperature": 0.5})


@pytest.mark.processes
def test_through_the_proxy_the_upstream_gets_the_paraphrase(generator, proxy_factory, fake_upstream, tmp_path) -> None:
    with refusing_url("/v1") as dead:  # a generator that is down
        config = f"""
[profiles.rephrased]
mode = "perturb"
perturbers = [{{ name = "paraphrase", params = {{ generator_url = "{generator.url}/v1", cache_dir = "{tmp_path / "c"}" }} }}]

[profiles.rephrased_down]
mode = "perturb"
perturbers = [{{ name = "paraphrase", params = {{ generator_url = "{dead}", cache_dir = "{tmp_path / "d"}", timeout_s = 2 }} }}]
"""
        proxy = proxy_factory(config)

        def upstream_got(profile: str) -> str:
            """Send GOOD through `profile` like an agent would; what the upstream received as the question."""
            client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-test")
            answer = client.chat.completions.create(
                model="fake-model", messages=request(GOOD)["messages"], extra_headers={"X-Test-Tag": f"para-{profile}"}
            )
            assert answer.choices[0].message.content
            return json.loads(recorded(fake_upstream, f"para-{profile}")[-1]["body"])["messages"][-1]["content"]

        assert upstream_got("rephrased") == GOOD_REPHRASED
        # the generator is down: the agent still gets its answer, to its original request
        assert upstream_got("rephrased_down") == GOOD
        metrics = httpx.get(f"{proxy.url}/metrics").text
        assert 'toolquake_perturbation_failures_total{perturber="paraphrase"} 1.0' in metrics


@pytest.mark.slow
@pytest.mark.model
def test_a_real_model_behind_llama_cpp_server(tmp_path) -> None:
    """The embedded SmolLM2-135M served by llama.cpp's OpenAI-compatible server as the generator.
    The model is tiny: whatever it answers must end accepted, rejected or unchanged, never raise."""
    server = start_llama_server(2048)
    try:
        for text in (GOOD, LOSES_NUMBER):
            out, report = run(f"{server.url}/v1", text, tmp_path, generator_model="smollm2", timeout_s=120)
            assert report["paraphrase"] in ("accepted", "rejected", "unchanged")
            entry = json.loads(
                next(f for f in tmp_path.rglob("*.json") if json.loads(f.read_text())["original"] == text).read_text()
            )
            assert isinstance(entry["answer"], str)
            if report["paraphrase"] == "accepted":
                assert missing_from(text, out["messages"][-1]["content"]) == []
            else:
                assert out == request(text)
    finally:
        server.stop()
