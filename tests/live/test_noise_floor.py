"""The noise floor in shadow mode (#18): an unperturbed twin for a share `noise_rate` of requests, compared with
the original answer and counted under `toolquake_consistency_total{profile="<noise>"}` — never in the profile's.

End to end: the proxy and the fake upstream as their own processes, the `openai` SDK as the client. The fake
answers deterministically, or, with `X-Fake-Flaky: P` and no `seed` in the body, replaces its answer with a
no-call text at random: then the original and its unperturbed twin disagree exactly when one of them is that
text, which the test checks row by row against the answers it received itself.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.fake_upstream import FLAKY_TEXT
from tests.support import recorded, scraped, wait_for
from tests.support.shadow import MESSAGES, TOOLS, client, config
from toolquake.proxy.live import results
from toolquake.proxy.replay.report import render_markdown, summarize_db
from toolquake.scorers.consistency import AGREE_EXACT, DISAGREE

NOISE = "<noise>"


def test_deterministic_model_has_a_zero_noise_floor_and_the_profile_keeps_its_own_count(proxy_factory, fake_upstream,
                                                                                          tmp_path):
    db = tmp_path / "noise.sqlite"
    proxy = proxy_factory(config(db, noise_rate=1.0, max_concurrent=64, store_contents=True))
    tag = uuid.uuid4().hex
    n = 6
    c = client(proxy)
    for i in range(n):
        c.chat.completions.create(model="fake-model", tools=TOOLS, extra_headers={"X-Test-Tag": tag},
                                  messages=[{"role": "user", "content": f"{MESSAGES[0]['content']} ({i})"}])
    wait_for(lambda: scraped(proxy, "toolquake_consistency_total", profile=NOISE) == n
             and scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed") == n, what="twins")
    # the reversed twin calls the other tool; the unperturbed twin asks the same question and gets the same call
    assert scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed", agree=DISAGREE) == n
    assert scraped(proxy, "toolquake_consistency_total", profile=NOISE, model="fake-model", agree=AGREE_EXACT) == n
    assert scraped(proxy, "toolquake_shadow_requests_total", profile=NOISE, outcome="answered") == n
    assert scraped(proxy, "toolquake_shadow_requests_total", profile="shadow-reversed", outcome="answered") == n
    # upstream: per client request the original, the reversed twin, and the noise twin (the original's tools,
    # its messages, not streamed)
    seen = [json.loads(s["body"]) for s in recorded(fake_upstream, tag) if s["method"] == "POST"]
    assert len(seen) == 3 * n
    names = [[t["function"]["name"] for t in b["tools"]] for b in seen]
    assert names.count(["weather_forecast", "humidity_forecast"]) == 2 * n
    assert names.count(["humidity_forecast", "weather_forecast"]) == n
    wait_for(lambda: db.exists() and len(results.read_rows(db)) == 2 * n, what="stored rows")
    rows = results.read_rows(db)
    noise = [r for r in rows if r["arm"] == "noise"]
    assert len(noise) == n and all(r["agree"] == AGREE_EXACT and r["perturbers"] == [] for r in noise)
    assert all(r["profile"] == "shadow-reversed" and r["shadow_of"] and r["valid"] is None for r in noise)
    s = summarize_db(db)
    assert s["consistency"]["shadow-reversed"]["n"] == n and s["consistency"]["shadow-reversed"]["disagree"] == n
    assert s["noise"][NOISE]["n"] == n and s["noise"][NOISE]["rate_disagree"] == 0.0
    text = render_markdown(s)
    assert "## Noise floor" in text and "| shadow-reversed | 6 | 0 | 0 | 6 |" in text


def test_nondeterministic_model_noise_is_measured_per_twin_and_never_mixed_in(proxy_factory, fake_upstream, tmp_path):
    stats = pytest.importorskip("scipy.stats")
    db = tmp_path / "noise.sqlite"
    proxy = proxy_factory(config(db, noise_rate=0.6, max_concurrent=64, store_contents=True))
    tag = uuid.uuid4().hex
    n = 40
    c = client(proxy)
    answers = {}
    for i in range(n):
        raw = c.chat.completions.with_raw_response.create(
            model="fake-model", tools=TOOLS[:1], extra_headers={"X-Test-Tag": tag, "X-Fake-Flaky": "0.5"},
            messages=[{"role": "user", "content": f"Weather in city number {i}?"}])
        answers[raw.headers["x-toolquake-request-id"]] = raw.parse().choices[0].message
    sampled_out = lambda: scraped(proxy, "toolquake_shadow_requests_total", profile=NOISE,  # noqa: E731
                                 outcome="sampled_out")
    wait_for(lambda: scraped(proxy, "toolquake_consistency_total", profile=NOISE) + sampled_out() == n
             and scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed") == n, what="twins")
    noised = int(scraped(proxy, "toolquake_consistency_total", profile=NOISE))
    assert 0 < noised < n  # a share of 0.6, decided per request from its seed
    wait_for(lambda: db.exists() and len(results.read_rows(db)) == n + noised, what="stored rows")
    rows = results.read_rows(db)
    noise = [r for r in rows if r["arm"] == "noise"]
    twins = [r for r in rows if r["arm"] == "twin"]
    assert len(noise) == noised and len(twins) == n
    for r in noise:  # disagreement exactly when one side is the flaky text (no call) and the other a call
        original_flaky = answers[r["shadow_of"]].content == FLAKY_TEXT
        twin_flaky = r["response_body"]["choices"][0]["message"]["content"] == FLAKY_TEXT
        assert (r["agree"] == DISAGREE) == (original_flaky != twin_flaky), r
    disagree = sum(r["agree"] == DISAGREE for r in noise)
    assert 0 < disagree < noised
    assert scraped(proxy, "toolquake_consistency_total", profile=NOISE, agree=DISAGREE) == disagree
    # the profile's own consistency counts its perturbed twins only
    twin_disagree = sum(r["agree"] == DISAGREE for r in twins)
    assert scraped(proxy, "toolquake_consistency_total", profile="shadow-reversed", agree=DISAGREE) == twin_disagree
    s = summarize_db(db)
    assert s["consistency"]["shadow-reversed"]["n"] == n
    assert s["consistency"]["shadow-reversed"]["disagree"] == twin_disagree
    assert s["noise"][NOISE]["n"] == noised and s["noise"][NOISE]["disagree"] == disagree
    assert s["noise"]["shadow-reversed"]["n"] == noised
    ci = stats.binomtest(disagree, noised).proportion_ci(method="wilson")
    assert s["noise_ci"][NOISE]["rate_disagree"] == pytest.approx([ci.low, ci.high], abs=1e-4)


def test_noise_rate_is_validated_and_the_noise_label_is_no_profile_name(tmp_path):
    from toolquake.proxy.server.config import ConfigError, load_config

    bad = tmp_path / "bad.toml"
    bad.write_text('[profiles.x]\nmode = "shadow"\nnoise_rate = 1.5\n')
    with pytest.raises(ConfigError, match="noise_rate must be between 0 and 1"):
        load_config(str(bad))
    bad.write_text('[profiles."<noise>"]\nmode = "shadow"\n')
    with pytest.raises(ConfigError, match="invalid profile name"):
        load_config(str(bad))
