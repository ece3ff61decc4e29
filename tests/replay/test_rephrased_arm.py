"""The `rephrased` arm of `@seed001` end to end: `toolquake replay` as a process, the real proxy in it, one fake
upstream as the model under test (an oracle) and a second one as the fixed rephraser.

What must hold (issue #17, item 3): a rephrasing that keeps its numbers in words is accepted; one that loses a
value is rejected, the request is sent unchanged, and the pair is counted as not perturbed and kept out of the
arm's accuracy; the rephrasings are cached, so a second model replayed later sees the same text without the
rephraser being asked again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream
from tests.support.report import report

pytestmark = [pytest.mark.processes, pytest.mark.needs_corpus]
N = 6
PREFIX = "Kindly tell me this: "


def _corpus_present() -> bool:
    from toolquake.bfcl import corpus

    return corpus.is_present()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not _corpus_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    from toolquake.bfcl.convert import openai_name
    from toolquake.bfcl.corpus import load_category
    from toolquake.scorers.mutations import ground_truth_calls

    root = tmp_path_factory.mktemp("rephrased")
    cases = load_category("multiple")[:N]
    text = {c.id: c.turns[0][-1]["content"] for c in cases}
    # the rephraser: seed 001's own example (numbers in words) for multiple_0, a rephrasing that loses the
    # numbers for multiple_1, a polite prefix for the others
    rephrasing = {c.id: PREFIX + text[c.id] for c in cases}
    rephrasing["multiple_0"] = ("What are the dimensions and properties of a triangle whose three sides are five, "
                                "four and three units long?")
    rephrasing["multiple_1"] = "Calculate the area of a triangle from the lengths of its sides."
    gen_script = root / "rephraser.jsonl"
    gen_script.write_text("".join(json.dumps({"match": text[c.id], "answer": {"text": rephrasing[c.id]}}) + "\n"
                                  for c in cases))
    # the model under test answers every original and every rephrasing right, except multiple_2's rephrasing
    lines = []
    for c in cases:
        calls = [{"name": openai_name(g["name"]), "arguments": g["arguments"]} for g in ground_truth_calls(c)]
        lines.append({"match": text[c.id], "answer": {"calls": calls}})
        if c.id in ("multiple_1", "multiple_2"):  # multiple_1's rephrasing lost its numbers: no right call left
            other = next(openai_name(f["name"]) for f in c.functions if openai_name(f["name"]) != calls[0]["name"])
            calls = [{"name": other, "arguments": calls[0]["arguments"]}]
        lines.append({"match": rephrasing[c.id], "answer": {"calls": calls}})
    lines.sort(key=lambda e: -len(e["match"]))  # a rephrasing that contains its original is matched first
    model_script = root / "model.jsonl"
    model_script.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = root / "config.toml"
    config.write_text(f'[profiles.rephrased]\nmode = "perturb"\nperturbers = [{{ name = "paraphrase", params = '
                      f'{{ cache_dir = "{root / "shared-cache"}" }} }}]\n')
    gen = start_fake_upstream("--script", str(gen_script))
    model = start_fake_upstream("--script", str(model_script))
    yield root, config, gen, model, cases, text, rephrasing
    gen.stop()
    model.stop()


def replay(out: Path, config: Path, backend: str, gen_url: str, model: str) -> dict[str, int]:
    """Run the replay; returns the scored pairs per arm from the table it prints."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_GENERATOR_URL": gen_url,
           "TOOLQUAKE_GENERATOR_MODEL": "fixed-rephraser"}
    done = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", backend,
                           "--profiles", "off,rephrased", "--config", str(config), "--categories", "multiple",
                           "--limit", str(N), "--out", str(out), "--model", model, "--concurrency", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.split()[0]: int(line.split()[1]) for line in done.stdout.splitlines()[1:] if line.strip()}


def chat_requests(proc) -> list[dict]:
    return [json.loads(r["body"]) for r in httpx.get(f"{proc.url}/_fake/requests").json()
            if r["path"].endswith("/chat/completions")]


def last_user(body: dict) -> str:
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")


def test_rejected_rephrasings_are_counted_apart_and_kept_out_of_the_accuracy(setup) -> None:
    root, config, gen, model, cases, text, rephrasing = setup
    httpx.delete(f"{gen.url}/_fake/requests")
    httpx.delete(f"{model.url}/_fake/requests")
    printed = replay(root / "a", config, f"{model.url}/v1", f"{gen.url}/v1", "model-a")

    # what the model under test was sent in the rephrased arm: the perturbed requests themselves
    sent = [last_user(b) for b in chat_requests(model)]
    originals, rephrased = set(text.values()), set(rephrasing.values())
    rephrased_sent = [s for s in sent if s in rephrased and s not in originals]
    unchanged_ids = [c.id for c in cases if rephrasing[c.id] not in sent]  # the arm sent the original instead
    assert unchanged_ids == ["multiple_1"]  # lost its numbers: rejected
    assert rephrasing["multiple_0"] in rephrased_sent  # "5 units" → "five": accepted
    # every rephraser call asked the fixed model
    assert {b["model"] for b in chat_requests(gen)} == {"fixed-rephraser"}

    out = report(str(root / "a"), "--format", "json").stdout
    arm = json.loads(out)["arms"]["rephrased"]
    # expected numbers from what was sent: the rephrased requests the oracle answers right, over those sent
    right = [s for s in rephrased_sent if s != rephrasing["multiple_2"]]
    assert arm["not_perturbed"] == len(unchanged_ids)
    assert arm["n"] == len(rephrased_sent)
    assert arm["accuracy"] == pytest.approx(len(right) / len(rephrased_sent))
    assert arm["perturbed_share"] == pytest.approx(len(rephrased_sent) / N)
    assert arm["failed"] == 0
    assert printed == {"off": N, "rephrased": len(rephrased_sent)}  # the replay's own table agrees
    assert json.loads(out)["arms"]["off"]["accuracy"] == 1.0
    # the in-process proxy counted tokens with the backend's tokenizer (the fake serves /tokenize), and says so
    import sqlite3

    db = sqlite3.connect(root / "a" / "replay.sqlite")
    assert dict(db.execute("SELECT key, value FROM meta").fetchall())["token_counter"] == "upstream"
    db.close()
    # the report labels the rephraser: the fixed model, for every pair's rephrasing
    label = json.loads(out)["rephrasers"]["model-a"]["rephrased"]
    assert label["rephraser"] == "fixed-rephraser" and label["self"] is False
    assert label["generator_url"] == f"{gen.url}/v1" and set(label["pairs"]) == {"fixed-rephraser"}


def test_without_a_fixed_rephraser_the_arm_is_refused_unless_self_rephrasing_is_asked(setup) -> None:
    """No TOOLQUAKE_GENERATOR_MODEL: each model would rephrase its own queries. Refused before anything is
    recorded; with --self-rephrase the model under test rephrases (asked under its own name) and the report says
    so."""
    root, config, gen, model, cases, text, rephrasing = setup
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_GENERATOR_URL": f"{model.url}/v1"}
    env.pop("TOOLQUAKE_GENERATOR_MODEL", None)
    # the rephrasing cache is keyed by the rephraser's model: model-s's own entries
    args = [sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend", f"{model.url}/v1",
            "--profiles", "off,rephrased", "--config", str(config), "--categories", "multiple", "--limit", "2",
            "--model", "model-s"]
    refused = subprocess.run([*args, "--out", str(root / "s0")], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "rephrased" in refused.stderr and "--self-rephrase" in refused.stderr
    assert "TOOLQUAKE_GENERATOR_MODEL" in refused.stderr
    assert not (root / "s0" / "replay.sqlite").exists()
    httpx.delete(f"{model.url}/_fake/requests")
    done = subprocess.run([*args, "--self-rephrase", "--out", str(root / "s1")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    # the rephrasing prompts went to the model under test, under its own name
    prompts = [b for b in chat_requests(model) if b["messages"][0]["content"].startswith("You are a helpful")]
    assert prompts and {b["model"] for b in prompts} == {"model-s"}
    out = report(str(root / "s1"), "--format", "json").stdout
    label = json.loads(out)["rephrasers"]["model-s"]["rephrased"]
    assert label["self"] is True and label["rephraser"] == "the model under test"
    text_report = report(str(root / "s1")).stdout
    assert "the model under test (self-rephrasing)" in text_report


def test_a_second_model_sees_the_same_rephrasings_from_the_shared_cache(setup) -> None:
    root, config, gen, model, cases, text, rephrasing = setup
    if not (root / "shared-cache").exists():
        replay(root / "a", config, f"{model.url}/v1", f"{gen.url}/v1", "model-a")
    httpx.delete(f"{gen.url}/_fake/requests")
    httpx.delete(f"{model.url}/_fake/requests")
    replay(root / "b", config, f"{model.url}/v1", f"{gen.url}/v1", "model-b")
    assert chat_requests(gen) == []  # every rephrasing came from the cache
    sent = {last_user(b) for b in chat_requests(model) if b["model"] == "model-b"}
    assert {rephrasing[c.id] for c in cases if c.id != "multiple_1"} <= sent


def test_the_drop_on_all_cases_sends_the_rejected_rephrasings_and_says_it_is_the_paper_s(setup) -> None:
    """`rephrased-all` (#47): the rephrasing the value check rejects (multiple_1's, which lost its numbers) is sent
    anyway and labelled, so the drop is over all cases, as seed 001's Table 2; `rephrased` leaves it out, which
    biases the drop down. Worked out by hand: 6 cases, `off` all right; `rephrased` 5 sent, 4 right (multiple_2's
    rephrasing is answered wrong): −20 %; `rephrased-all` 6 sent, 4 right (multiple_1's too): −33.3 %."""
    root, _, gen, model, cases, text, rephrasing = setup
    config = root / "config-all.toml"
    cache = root / "shared-cache"
    config.write_text("".join(f'[profiles.{name}]\nmode = "perturb"\nperturbers = [{{ name = "paraphrase", params = '
                              f'{{ cache_dir = "{cache}"{extra} }} }}]\n\n'
                              for name, extra in (("rephrased", ""), ("rephrased-all", ', rejected = "send"'))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLQUAKE_GENERATOR_URL": f"{gen.url}/v1",
           "TOOLQUAKE_GENERATOR_MODEL": "fixed-rephraser"}
    httpx.delete(f"{model.url}/_fake/requests")
    done = subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", "--backend",
                           f"{model.url}/v1", "--profiles", "off,rephrased,rephrased-all", "--config", str(config),
                           "--categories", "multiple", "--limit", str(N), "--out", str(root / "all"), "--model",
                           "model-all", "--concurrency", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    sent = [last_user(b) for b in chat_requests(model)]
    assert sent.count(rephrasing["multiple_1"]) == 1  # sent by rephrased-all only
    data = json.loads(report(str(root / "all"), "--format", "json").stdout)
    checked, every = data["arms"]["rephrased"], data["arms"]["rephrased-all"]
    assert (checked["n"], checked["not_perturbed"], every["n"], every["not_perturbed"]) == (5, 1, 6, 0)
    assert checked["accuracy"] == pytest.approx(4 / 5) and every["accuracy"] == pytest.approx(4 / 6)
    assert checked["drop_vs_off"] == pytest.approx(-0.2) and every["drop_vs_off"] == pytest.approx(-1 / 3)
    drops = data["rephrasing_drops"]["model-all"]
    assert (drops["rephrased"]["cases"], drops["rephrased"]["table2"], drops["rephrased"]["rejected_sent"]) == (
        "checked", False, 0)
    assert (drops["rephrased-all"]["cases"], drops["rephrased-all"]["table2"],
            drops["rephrased-all"]["rejected_sent"]) == ("all cases", True, 1)
    import sqlite3

    db = sqlite3.connect(root / "all" / "replay.sqlite")
    (stored,) = db.execute("SELECT perturbers FROM results WHERE profile = 'rephrased-all' AND case_id = 'multiple_1'"
                           ).fetchone()
    db.close()
    (step,) = json.loads(stored)["applied"]
    assert step["report"]["paraphrase"] == "rejected, sent" and step["report"]["rejected_for"]  # labelled
    md = report(str(root / "all"), "--no-plots").stdout
    assert ("| model-all | rephrased-all | all cases, rejected rephrasings sent (labelled) | yes | 6 | 0.667 | "
            "-33.3 %") in md
    assert "| model-all | rephrased | cases whose rephrasing passed the value check | no | 5 | 0.800 | -20.0 %" in md
