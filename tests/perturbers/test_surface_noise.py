"""surface_noise: slips in free words only; numbers, quoted strings, URLs and identifiers intact."""

from __future__ import annotations

import json
import random
from typing import Any

import openai
import pytest

from tests.support import recorded
from toolquake.perturbers import build
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.protected import protected_spans
from toolquake.perturbers.helpers.tokens import EstimateCounter
from toolquake.perturbers.surface_noise import NEIGHBOURS, noisify

TEXTS = [
    "Find the area of a triangle with a base of 10 units and height of 5 units.",
    "Book a flight from 'San Francisco' to \"New York\" on 2024-05-01 at 10:30 with a budget of $1,200, please.",
    "Fetch https://api.example.com/v2/items?id=77 and save it as report_final.csv in /tmp/out for getUserData.",
    "What is the humidity level in Miami, Florida in the upcoming 7 days? Use the NOAA feed, not the cache.",
    "Calculate the depreciated value of a property costing $200,000 with an annual rate of 3% for 5 years.",
]


def protected_parts(text: str) -> list[str]:
    return [text[a:b] for a, b in protected_spans(text)]


def apply(text: str, rate: float, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "system", "content": "Answer briefly, please."},
                                       {"role": "user", "content": "an earlier question, left alone"},
                                       {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": text}]}
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(seed),
                         services=Services(token_counter=EstimateCounter()))
    out = build("surface_noise", {"rate": rate}).apply(ChatRequest(body), ctx)
    assert out.body["messages"][:3] == body["messages"][:3], "only the last user message changes"
    return out.body, ctx.report


def test_protected_spans_cover_values() -> None:
    assert protected_parts(TEXTS[1]) == ["'San Francisco'", '"New York"', "2024-05-01", "10:30", "1,200"]
    assert protected_parts(TEXTS[2]) == ["https://api.example.com/v2/items?id=77", "report_final.csv", "/tmp/out",
                                         "getUserData"]
    assert protected_parts(TEXTS[3]) == ["Miami", "Florida", "7", "NOAA"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(8))
def test_values_survive_any_amount_of_noise(text: str, seed: int) -> None:
    out, report = apply(text, 1.0, seed)
    noisy = out["messages"][-1]["content"]
    assert noisy != text and report["edits"] > 0
    pos = 0
    for part in protected_parts(text):  # every value is still there, in order
        found = noisy.find(part, pos)
        assert found >= 0, f"{part!r} lost in {noisy!r}"
        pos = found + len(part)


def test_rate_zero_changes_nothing_and_rate_scales_the_edits() -> None:
    out, report = apply(TEXTS[0], 0.0, 1)
    assert out["messages"][-1]["content"] == TEXTS[0] and report["edits"] == 0
    long_text = " ".join(TEXTS) * 4
    counts = {rate: sum(sum(noisify(long_text, rate, random.Random(s))[1].values()) for s in range(5))
              for rate in (0.05, 0.2, 0.5)}
    assert counts[0.05] < counts[0.2] < counts[0.5]
    words = len([w for w in long_text.split() if w.isalpha()])
    assert 0.02 * words < counts[0.05] / 5 < 0.2 * words


def test_every_kind_of_slip_happens() -> None:
    kinds: dict[str, int] = {}
    for seed in range(20):
        for kind, n in noisify(" ".join(TEXTS), 0.3, random.Random(seed))[1].items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert set(kinds) == {"neighbour_key", "swap", "double", "drop", "case", "whitespace", "punctuation"}


def test_keyboard_neighbours_are_adjacent_keys() -> None:
    assert set(NEIGHBOURS["s"]) == set("qweadzxc") and set(NEIGHBOURS["p"]) == set("ol")
    assert all(k not in v for k, v in NEIGHBOURS.items())


def test_same_seed_same_noise() -> None:
    assert apply(TEXTS[4], 0.3, 9) == apply(TEXTS[4], 0.3, 9)
    assert apply(TEXTS[4], 0.3, 9)[0] != apply(TEXTS[4], 0.3, 10)[0]


def test_rate_is_checked() -> None:
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError):
            build("surface_noise", {"rate": rate})


def test_noisy_profile_through_the_proxy(proxy, fake_upstream) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/p/noisy/v1", api_key="sk-test")
    text = " ".join(TEXTS)
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": text}],
                                   extra_headers={"X-Test-Tag": "noisy"})
    sent = json.loads(recorded(fake_upstream, "noisy")[-1]["body"])
    noisy = sent["messages"][-1]["content"]
    assert noisy != text
    for part in protected_parts(text):
        assert part in noisy
