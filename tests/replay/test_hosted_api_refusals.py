"""A hosted API's request rules are not the model's failures (#47).

The fake upstream enforces OpenAI's documented request validation (`--tools-array-max N`: 400
`array_above_max_length`, param `tools`; `--refuse-temperature`: 400 `unsupported_value`, param `temperature`) and,
behind it, a small context (`--max-tools N`: 400 `context_length_exceeded`). A refusal of the request's shape is
not a verdict: the pair is final, reported as not comparable by code and left out of n and of every statistic,
with one warning line during the run; a refusal for the context stays the model's failure, as BFCL counts it.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, start_fake_upstream, start_proxy
from tests.support.replay import oracle_script, replay, rows
from tests.support.report import report_text

LIMIT = 6  # of each category
CAP = 20  # the tools array the fake accepts (OpenAI: 128)
CONTEXT = 2  # the tools that fit its context
SHAPE_CODE, CONTEXT_CODE = "array_above_max_length", "context_length_exceeded"


def sent(fake, tag: str) -> list[dict]:
    return [json.loads(q["body"]) for q in httpx.get(f"{fake.url}/_fake/requests", params={"tag": tag}).json()
            if q["path"] == "/v1/chat/completions"]


@pytest.fixture(scope="module")
def hosted():
    """The oracle (the ground truth for every case) behind OpenAI's tools-array cap and a two-tool context."""
    from toolquake.bfcl.corpus import load_category

    cases = load_category("simple_python")[:LIMIT] + load_category("multiple")[:LIMIT]
    fake = start_fake_upstream("--script", str(oracle_script(cases, set())), "--tools-array-max", str(CAP),
                               "--max-tools", str(CONTEXT))
    yield fake, cases
    fake.stop()


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings  # catalog padding screens its tools with the embedding model
def test_a_refusal_of_the_request_s_shape_is_not_comparable_and_a_context_refusal_stays_a_failure(hosted, tmp_path):
    fake, cases = hosted
    out = tmp_path / "run"
    args = ("--backend", f"{fake.url}/v1", "--profiles", "off,pad-8k-p10", "--categories", "simple_python,multiple",
            "--limit", str(LIMIT), "--out", str(out), "--header", "X-Test-Tag: hosted")
    r = replay(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    # one warning line, at the first refusal of the shape, saying what the backend refuses
    warnings = [line for line in r.stderr.splitlines() if "these pairs measure the API, not the model" in line]
    assert len(warnings) == 1, r.stderr[-3000:]
    assert f"the backend refuses more than {CAP} tools: these pairs measure the API, not the model" in warnings[0]
    stored = rows(out)
    assert len(stored) == len(cases) * 2 and all(x["status"] == "scored" for x in stored)
    many = {c.id for c in cases if len(c.functions) > CONTEXT}
    assert many and len(many) < len(cases)
    for x in stored:
        if x["profile"] == "pad-8k-p10":  # padded past the cap: refused for the request's shape, no verdict
            assert (x["valid"], x["error_type"], x["error_code"], x["http_status"]) == (
                None, "not_comparable", SHAPE_CODE, 400), x
        elif x["case_id"] in many:  # within the cap, past the context: the model's failure, as BFCL counts it
            assert (x["valid"], x["error_type"], x["error_code"]) == (0, "inference_error", CONTEXT_CODE), x
        else:
            assert (x["valid"], x["error_code"]) == (1, None), x
    # final: a rerun sends nothing again
    before = len(sent(fake, "hosted"))
    assert before == len(stored)
    again = replay(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(sent(fake, "hosted")) == before

    data = json.loads(report_text("--no-plots", "--format", "json", str(out)))
    pad, off = data["arms"]["pad-8k-p10"], data["arms"]["off"]
    assert pad["not_comparable"] == {SHAPE_CODE: len(cases)}
    assert (pad["n"], pad["accuracy"], pad["failed"], pad["unscored"]) == (0, None, 0, 0)  # out of n: not 0.0
    assert pad["paired"]["n"] == 0 and pad["drop_vs_off"] is None
    assert off["not_comparable"] == {}
    assert (off["n"], off["failed"], off["failed_codes"]) == (len(cases), len(many), {CONTEXT_CODE: len(many)})
    assert off["accuracy"] == pytest.approx((len(cases) - len(many)) / len(cases))
    assert all(cat["not_comparable"] == LIMIT for cat in pad["by_category"].values())
    # no flip, no caused failure, no padding cell from a pair that has no verdict
    assert not [f for f in data["flips"] if f["profile"] == "pad-8k-p10"]
    assert "pad-8k-p10" not in (data["caused_errors"].get("fake-model") or {})
    assert not data["padding_extremes"]

    md = report_text("--no-plots", str(out))
    assert "not comparable (refused for the request's shape, in no number)" in md
    assert "| fake-model | pad-8k-p10 | 0 | – |" in md  # the arms table: n 0, no accuracy
    assert f"{len(cases)} ({SHAPE_CODE} {len(cases)})" in md
    table = list(csv.DictReader(io.StringIO(report_text("--no-plots", "--format", "csv", "--csv-stats", str(out)))))
    row = next(x for x in table if x["Profile"] == "pad-8k-p10")
    assert (row["N"], row["Not Comparable"], row["Not Comparable Codes"]) == (
        "0", str(len(cases)), f"{SHAPE_CODE}:{len(cases)}")


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_a_model_that_refuses_temperature_is_not_comparable_and_temperature_none_sends_none(tmp_path):
    from toolquake.bfcl.corpus import load_category

    cases = load_category("simple_python")[:3]
    fake = start_fake_upstream("--script", str(oracle_script(cases, set())), "--refuse-temperature")
    try:
        base = ("--backend", f"{fake.url}/v1", "--profiles", "off", "--categories", "simple_python", "--limit", "3")
        r = replay(*base, "--out", str(tmp_path / "zero"), "--header", "X-Test-Tag: zero")
        assert r.returncode == 0, r.stderr[-2000:]
        warned = [line for line in r.stderr.splitlines() if "not the model" in line]
        assert len(warned) == 1 and "--temperature none" in warned[0], r.stderr[-2000:]
        assert {(x["error_type"], x["error_code"], x["valid"]) for x in rows(tmp_path / "zero")} == {
            ("not_comparable", "unsupported_value", None)}
        zero = json.loads(report_text("--no-plots", "--format", "json", str(tmp_path / "zero")))
        assert zero["arms"]["off"]["n"] == 0 and zero["arms"]["off"]["accuracy"] is None  # not 0.000
        assert zero["arms"]["off"]["not_comparable"] == {"unsupported_value": 3}
        assert zero["sent_with"]["fake-model"]["temperature"] == "0"
        assert all(q["temperature"] == 0 for q in sent(fake, "zero"))

        r = replay(*base, "--out", str(tmp_path / "none"), "--temperature", "none", "--header", "X-Test-Tag: none")
        assert r.returncode == 0, r.stderr[-2000:]
        assert all("temperature" not in q for q in sent(fake, "none")) and len(sent(fake, "none")) == 3
        assert {(x["valid"], x["error_code"]) for x in rows(tmp_path / "none")} == {(1, None)}
        data = json.loads(report_text("--no-plots", "--format", "json", str(tmp_path / "none")))
        assert data["arms"]["off"]["n"] == 3 and data["arms"]["off"]["accuracy"] == 1.0
        assert data["sent_with"]["fake-model"]["temperature"] == "none"
        md = report_text("--no-plots", str(tmp_path / "none"))
        assert "| fake-model | none (not sent: the model's default) |" in md
        # a resume with another temperature would mix two samplings: refused
        r = replay(*base, "--out", str(tmp_path / "none"))
        assert r.returncode == 2 and "temperature none" in r.stderr
    finally:
        fake.stop()


def _cases_file(tmp_path: Path, ids: list[str]) -> Path:
    path = tmp_path / "cases.jsonl"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "description": "the city"}},
                                                   "required": ["city"]}}}]
    path.write_text("".join(json.dumps({
        "id": cid, "category": "weather",
        "messages": [{"role": "user", "content": f"What is the weather in Paris? ({cid})"}], "tools": tools,
        "expected": [{"name": "get_weather", "arguments": {"city": ["Paris"]}}]}) + "\n" for cid in ids))
    return path


def sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", "sweep", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings  # the tools and related axes add tools screened with the embedding model
def test_a_sweep_past_the_api_s_tools_cap_is_not_comparable_and_below_it_breaks_at_the_context(tmp_path):
    """Past 60 tools the fake refuses the shape (OpenAI's cap), past 40 the context: a sweep to 200 tools has no
    breaking point to give (not comparable, out of every number); one to 60 breaks every case at 41."""
    ids = ["w-1", "w-2", "w-3"]
    right = {"calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    answers = tmp_path / "answers.jsonl"  # right at every size the backend answers
    answers.write_text("".join(json.dumps({"match": f"({cid})", "answer": right, "measure": "tools", "wrong": []})
                               + "\n" for cid in ids))
    fake = start_fake_upstream("--breaking", str(answers), "--tools-array-max", "60", "--max-tools", "40")
    try:
        cases = _cases_file(tmp_path, ids)
        far = sweep("--backend", f"{fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1", "--max",
                    "200", "--out", str(tmp_path / "far"))
        assert far.returncode == 0, far.stderr[-2000:]
        assert far.stderr.count("the backend refuses more than 60 tools: these pairs measure the API") == 1
        near = sweep("--backend", f"{fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1", "--max",
                     "60", "--out", str(tmp_path / "near"))
        assert near.returncode == 0, near.stderr[-2000:]
        again = sweep("--backend", f"{fake.url}/v1", "--cases", str(cases), "--axis", "tools", "--min", "1",
                      "--max", "200", "--out", str(tmp_path / "far"))
        assert again.returncode == 0 and "(sent 0, failed 0)" in again.stderr, again.stderr[-2000:]
    finally:
        fake.stop()
    db = sqlite3.connect(tmp_path / "far" / "sweep.sqlite")
    try:
        refused = db.execute("SELECT case_id, error_code, valid FROM results WHERE error_type = 'not_comparable'"
                             ).fetchall()
    finally:
        db.close()
    assert sorted(c for c, _, _ in refused) == ids and {(code, v) for _, code, v in refused} == {(SHAPE_CODE, None)}
    far_n = json.loads(report_text("--no-plots", "--format", "json", tmp_path / "far"))["sweeps"]["fake-model"]["tools"]
    assert far_n["n"] == 0 and far_n["not_comparable"] == {SHAPE_CODE: 3} and far_n["not_comparable_cases"] == ids
    assert far_n["incomplete"] == [] and far_n["censored"] == [] and far_n["median"] is None
    near = json.loads(report_text("--no-plots", "--format", "json", tmp_path / "near"))
    near_n = near["sweeps"]["fake-model"]["tools"]
    assert near_n["n"] == 3 and near_n["not_comparable"] == {}
    assert {c: (v["last_right"], v["first_wrong"]) for c, v in near_n["cases"].items()} == {
        cid: (40, 41) for cid in ids}
    assert near_n["first_wrong_failed"] == {cid: CONTEXT_CODE for cid in ids}  # the context: a failure
    text = report_text("--no-plots", str(tmp_path / "far"))
    assert "not comparable: the backend refused a point for the request's shape" in text


def test_budget_arms_are_refused_on_the_estimate_without_a_preset_and_through_a_proxy(fake_upstream, tmp_path):
    """Every arm that fills a token budget is refused on the estimate counter, whatever names it (not only
    `@seed003`), in replay and sweep, and with --proxy when that proxy says it counts with the estimate."""
    fake = fake_upstream
    proxy = start_proxy(fake.url)  # [server] token_counter: the estimate (the default)
    try:
        common = ("--backend", f"{fake.url}/v1", "--cases", str(_cases_file(tmp_path, ["w-1"])))
        r = replay(*common, "--profiles", "off,pad-8k-p10", "--token-counter", "estimate", "--out",
                   str(tmp_path / "a"))
        assert r.returncode == 2 and "pad-8k-p10: these arms fill a token budget" in r.stderr, r.stderr[-2000:]
        r = replay(*common, "--profiles", "off,pad-8k-p10", "--proxy", proxy.url, "--out", str(tmp_path / "b"))
        assert r.returncode == 2 and "the proxy's [server] token_counter is the estimate" in r.stderr, \
            r.stderr[-2000:]
        r = replay(*common, "--profiles", "off,shuffled", "--proxy", proxy.url, "--out", str(tmp_path / "c"))
        assert r.returncode == 0, r.stderr[-2000:]  # no budget: nothing to refuse
        assert httpx.get(f"{proxy.url}/readyz").json() == {"status": "ready", "token_counter": "estimate"}
        r = sweep(*common, "--axis", "catalog_tokens", "--max", "4000", "--token-counter", "estimate", "--out",
                  str(tmp_path / "d"))
        assert r.returncode == 2 and "these arms fill a token budget" in r.stderr, r.stderr[-2000:]
    finally:
        proxy.stop()


def test_generated_related_tools_need_a_fixed_generator_or_consent(fake_upstream, tmp_path):
    """`toolkit_expansion` with `source = "generate"` and no generator model would have the model under test write
    its own related tools: refused without --self-rephrase, as the rephraser is."""
    config = tmp_path / "config.toml"
    config.write_text('[profiles.gen-tools]\nmode = "perturb"\nperturbers = [{ name = "toolkit_expansion", params = '
                      '{ source = "generate", generator_url = "http://127.0.0.1:9/v1" } }]\n')
    fake = fake_upstream
    r = replay("--backend", f"{fake.url}/v1", "--profiles", "off,gen-tools", "--config", str(config), "--cases",
               str(_cases_file(tmp_path, ["w-1"])), "--out", str(tmp_path / "out"),
               env={"TOOLQUAKE_GENERATOR_MODEL": ""})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "gen-tools: no fixed generator model is configured" in r.stderr and "--self-rephrase" in r.stderr


@pytest.mark.parametrize("status,code,param,message,kind", [
    # OpenAI
    (400, "context_length_exceeded", "messages", "This model's maximum context length is 128000 tokens.", "context"),
    (400, "array_above_max_length", "tools", "Invalid 'tools': array too long. Expected an array with maximum "
     "length 128, but got an array with length 300 instead.", "shape"),
    (400, "unsupported_value", "temperature", "Unsupported value: 'temperature' does not support 0 with this model. "
     "Only the default (1) value is supported.", "shape"),
    (400, "unsupported_parameter", "max_tokens", "Unsupported parameter: 'max_tokens' is not supported with this "
     "model. Use 'max_completion_tokens' instead.", "shape"),
    (400, "invalid_function_parameters", "tools[0].function.parameters", "Invalid schema for function 'f'.", "shape"),
    (400, "invalid_request_error", "tools[3].function.name", "Invalid 'tools[3].function.name': string too long.",
     "shape"),
    (400, "invalid_request_error", "messages", "Invalid 'messages[1].content': empty.", None),
    # vLLM (a flat or nested BadRequestError whose message says why)
    (400, "BadRequestError", "", "This model's maximum context length is 4096 tokens. However, you requested 5000 "
     "tokens (4000 in the messages, 1000 in the completion).", "context"),
    (400, "BadRequestError", "", "The prompt (9000 tokens) is longer than the maximum model length of 8192.",
     "context"),
    (400, "BadRequestError", "", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
     "set", "shape"),
    # llama.cpp
    (400, "exceed_context_size_error", "", "the request exceeds the available context size", "context"),
    # not a validation answer, or the proxy's own error: never classified
    (500, "array_above_max_length", "tools", "maximum length 128", None),
    (400, "invalid_json", "", "the body's 'tools' is not JSON", None),
    (404, "model_not_found", "model", "The model 'x' does not exist", None),
])
def test_the_refusals_table_tells_the_request_s_shape_from_the_context(status, code, param, message, kind):
    from toolquake.proxy.replay.failures import refusal, refusal_warning

    found = refusal(status, code, param, message)
    assert (found.kind if found else None) == kind
    if kind == "shape" and param == "tools":
        assert refusal_warning(found, code, param, message).startswith(
            "the backend refuses more than 128 tools: these pairs measure the API, not the model")
