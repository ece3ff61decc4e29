"""Presets as the papers run them, through the CLI against the fake upstream: `@seed003*` refuses budgets counted by
the estimate unless `--allow-estimate`, and the report names the counter and the tokens each arm reached."""

from __future__ import annotations

import json
import sqlite3
import statistics
from collections import Counter

import pytest

from tests.support import start_fake_upstream
from tests.support.replay import replay

PAD_TINY = ('[profiles.pad-tiny]\nmode = "perturb"\nperturbers = [{ name = "catalog_padding", '
            'params = { budget_tokens = 1500, position = 0.5 } }]\n')


@pytest.fixture(scope="module")
def no_tokenizer():
    """A backend that offers no /tokenize (as OpenAI's API and most gateways)."""
    fake = start_fake_upstream("--tokenize", "none")
    yield fake
    fake.stop()


@pytest.mark.processes
@pytest.mark.parametrize("counter", ["auto", "estimate"])
def test_seed003_presets_refuse_the_estimate_and_say_how_to_pick_a_counter(no_tokenizer, tmp_path, counter) -> None:
    cases = tmp_path / "cases.jsonl"  # one case of one's own: no corpus needed to get to the check
    cases.write_text(json.dumps({"id": "weather", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                                 "tools": [{"type": "function", "function": {
                                     "name": "get_weather", "parameters": {"type": "object", "properties": {
                                         "city": {"type": "string"}}, "required": ["city"]}}}],
                                 "expected": [{"name": "get_weather", "arguments": {"city": ["Oslo"]}}]}) + "\n")
    for preset in ("@seed003", "@seed003-responses", "@seed003-conversations"):
        r = replay("--backend", f"{no_tokenizer.url}/v1", "--profiles", preset, "--token-counter", counter,
                   "--cases", str(cases), "--out", str(tmp_path / preset[1:]))
        assert r.returncode == 2, r.stderr[-2000:]
        assert preset in r.stderr and "--allow-estimate" in r.stderr, r.stderr
        assert "tiktoken:o200k_base" in r.stderr and "tokenizer:/path/tokenizer.json" in r.stderr
        assert not (tmp_path / preset[1:] / "replay.sqlite").exists(), "nothing recorded before the refusal"
    # other presets and plain profiles are not budgeted in the model's tokens: they run on the estimate
    r = replay("--backend", f"{no_tokenizer.url}/v1", "--profiles", "@tool_order", "--cases", str(cases),
               "--token-counter", counter, "--out", str(tmp_path / "order"))
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_allow_estimate_runs_and_the_report_names_the_counter_and_the_tokens_reached(no_tokenizer, tmp_path) -> None:
    from tests.support.report import report_text as report
    from toolquake.bfcl.corpus import is_present

    if not is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    config = tmp_path / "config.toml"
    config.write_text(PAD_TINY)  # @seed003 = off + pad-* of this config: one small budget
    r = replay("--backend", f"{no_tokenizer.url}/v1", "--profiles", "@seed003", "--config", str(config),
               "--categories", "multiple", "--limit", "3", "--allow-estimate", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING" in r.stderr and "offers no tokenizer" in r.stderr
    db = sqlite3.connect(tmp_path / "out" / "replay.sqlite")
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    reached = [json.loads(p)["applied"][0]["report"]["tokens_after"]
               for (p,) in db.execute("SELECT perturbers FROM results WHERE profile = 'pad-tiny'")]
    db.close()
    assert meta["token_counter"] == "estimate" and len(reached) == 3
    got = json.loads(report(tmp_path / "out", "--format", "json"))
    (model,) = got["models"]
    arm = got["padding"][model]["pad-tiny"]
    assert arm["token_counter"] == {"estimate": 3} and arm["budget_tokens"] == 1500
    assert arm["tokens_after"]["median"] == statistics.median(reached)
    text = report(tmp_path / "out")
    assert "estimate 3" in text and f"{statistics.median(reached):.0f}" in text


def test_the_report_gives_the_counter_and_tokens_reached_of_each_lengthening_arm(tmp_path) -> None:
    """Long-response and long-conversation arms: per arm the counter named in its reports and the spread of the
    tokens its requests reached, recomputed here from the reports written to a real results file."""
    import random

    from tests.support.report import report_text as report
    from tests.support.results import perturb_arm, write_results
    from toolquake.proxy.replay.store import Record

    arms = {"off": {"mode": "off", "perturbers": []},
            "resp-10k": perturb_arm("response_lengthening", budget_tokens=10000, position=0.0),
            "conv-20k": perturb_arm("conversation_lengthening", budget_tokens=20000, setting="structured")}
    rng = random.Random(5)
    records, reached = [], {"resp-10k": [], "conv-20k": []}
    for i in range(9):
        for p, spec in arms.items():
            perturbers = None
            if spec["perturbers"]:
                step = spec["perturbers"][0]
                budget = step["params"]["budget_tokens"]
                # a multi-turn pair lengthens each of its requests: two reports here
                reports = [{"counter": "tiktoken:o200k_base", "budget_tokens": budget,
                            "tokens_total": int(budget * rng.uniform(0.97, 1.02))} for _ in range(2)]
                reached[p] += [r["tokens_total"] for r in reports]
                perturbers = {"applied": [{"name": step["name"], "params": step["params"], "report": r}
                                          for r in reports]}
            records.append(Record(f"multi_turn_base_{i}", p, "multi_turn_base", "scored", valid=rng.random() < 0.7,
                                  perturbers=perturbers))
    write_results(tmp_path / "replay.sqlite", arms, records)
    got = json.loads(report(tmp_path, "--format", "json"))["lengthening"]["m1"]
    assert set(got) == {"resp-10k", "conv-20k"}
    for p, tokens in reached.items():
        assert got[p]["token_counter"] == {"tiktoken:o200k_base": 18} and got[p]["requests"] == 18
        assert got[p]["budget_tokens"] == arms[p]["perturbers"][0]["params"]["budget_tokens"]
        spread = got[p]["tokens_total"]
        # whole tokens
        assert (spread["min"], spread["median"], spread["max"]) == (min(tokens), round(statistics.median(tokens)),
                                                                    max(tokens))
    text = report(tmp_path)
    assert "Long tool responses and conversations" in text
    line = next(x for x in text.splitlines() if "conv-20k" in x and "tiktoken:o200k_base 18" in x)
    assert f" {round(statistics.median(reached['conv-20k']))} " in line


def _categories_replayed(out) -> dict[str, int]:
    db = sqlite3.connect(out / "replay.sqlite")
    try:
        return dict(db.execute("SELECT category, COUNT(DISTINCT case_id) FROM results GROUP BY category").fetchall())
    finally:
        db.close()


@pytest.mark.needs_corpus
def test_presets_replay_the_papers_categories_by_default_and_categories_overrides(fake_upstream, tmp_path) -> None:
    from toolquake.bfcl.corpus import format_sensitivity_ids, is_present

    if not is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    # @seed003 is `off` + the config's pad-*: a cheap stand-in arm here (the selection is what is tested)
    config = tmp_path / "config.toml"
    config.write_text('[profiles.pad-stand-in]\nmode = "off"\n[profiles.fmt-stand-in]\nmode = "off"\n')
    fake = fake_upstream

    def run(out: str, *args: str) -> dict[str, int]:
        r = replay("--backend", f"{fake.url}/v1", "--config", str(config), "--limit", "2", "--out",
                   str(tmp_path / out), *args)
        assert r.returncode in (0, 1), r.stderr[-2000:]
        return _categories_replayed(tmp_path / out)

    assert run("s3", "--profiles", "@seed003") == {"simple_python": 2, "live_simple": 2, "multiple": 2}
    # seed 002: BFCL's format-sensitivity selection (its first two entries here), each under its own category
    picked = [(cat, i) for cat, ids in format_sensitivity_ids().items() for i in ids][:2]
    got = run("s2", "--profiles", "@seed002")
    assert got == dict(Counter(cat for cat, _ in picked))
    both = run("both", "--profiles", "@seed003,@seed002")
    assert {"simple_python", "live_simple", "multiple"} <= set(both) and sum(both.values()) == 2 * 3 + 2
    assert run("over", "--profiles", "@seed003", "--categories", "parallel") == {"parallel": 2}
    assert run("plain", "--profiles", "off,pad-stand-in") == {"multiple": 2}
