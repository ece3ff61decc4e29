"""The embedded backend's prompt reuse (proxy/backend/prompt_cache.py): an answer's logits are bit for bit those of
a fresh instance whatever the instances evaluated before (a sibling prompt, the same prompt, the previous turn with
its generated answer, a state restored from the cache); a prompt family comes back from the cache after every
instance moved on; the cache's bookkeeping (bound in bytes, least recently used out, a sequence a longer one
extends dropped); `--cache-ram` checked. The model tests run SmolLM2-135M in this process (one load per engine)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.support.backend import needs_model


def _engine(**kwargs):
    from toolquake.proxy.backend.local import default_weights
    from toolquake.proxy.backend.server import Engine

    return Engine(str(default_weights()), n_ctx=4096, threads=1, **kwargs)


def _answer(engine, tokens: list[int], max_tokens: int = 1):
    """(the generation, the next-token logits after the prompt) — with max_tokens 1 the one sampled token is never
    evaluated, so the context's last logits are the prompt's."""
    import llama_cpp

    gen = engine.generate(tokens, None, max_tokens=max_tokens, temperature=0.0, top_p=1.0, sampling_seed=None,
                          stop=[])
    llm = engine.free[-1]  # the instance just given back
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(engine.n_vocab,)).copy()
    return gen, logits


@pytest.fixture(scope="module")
def engines():
    """(two instances with the cache, one instance without it)"""
    return _engine(parallel=2), _engine(parallel=1, cache_ram_mib=0)


def _turn(engine, text: str) -> list[int]:
    return engine.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _head(engine, words: str) -> list[int]:
    """A system turn (~150 tokens) that names some tools."""
    return engine.tokenize(f"<|im_start|>system\nYou are a helpful assistant. {words}<|im_end|>\n") + \
        engine.tokenize(("Tools: " + words + ". ") * 10, special=False)


def _fresh(prompt: list[int]) -> np.ndarray:
    """The prompt's logits from an engine that evaluated nothing before."""
    return _answer(_engine(parallel=1, cache_ram_mib=0), prompt)[1]


@pytest.mark.model
@needs_model
def test_logits_are_a_fresh_instances_whatever_was_evaluated_before(engines) -> None:
    from toolquake.proxy.backend.prompt_cache import BLOCK

    engine, _ = engines
    head = _head(engine, "get_weather(city), convert_currency(amount, from, to), list_events(day)")
    question = head + _turn(engine, "What is the weather in Rome?")
    reference = _fresh(question)
    _answer(engine, head + _turn(engine, "Convert 5 USD to EUR."), max_tokens=12)  # a sibling, with its answer
    for history in ("after a sibling", "the same prompt again"):
        gen, logits = _answer(engine, question)
        assert gen.cached_tokens >= len(head) - BLOCK, history  # reused: the comparison is about reuse
        assert np.array_equal(logits, reference), (history, float(np.abs(logits - reference).max()))
    # the next turn: the prompt holds the previous answer, which was evaluated a token at a time
    gen, _ = _answer(engine, question, max_tokens=12)
    follow = question + engine.tokenize(gen.text + "<|im_end|>\n", special=True) + _turn(engine, "And in Paris?")
    gen2, logits = _answer(engine, follow)
    assert gen2.cached_tokens >= len(head)
    assert np.array_equal(logits, _fresh(follow)), float(np.abs(logits - _fresh(follow)).max())


@pytest.mark.model
@needs_model
def test_a_prompt_family_comes_back_from_the_cache_after_every_instance_moved_on(engines) -> None:
    from toolquake.proxy.backend.prompt_cache import BLOCK

    engine, _ = engines
    cache = engine.prompt_cache
    family = _head(engine, "search_notes(query), add_note(title, body)")
    _answer(engine, family + _turn(engine, "Search my notes for Atlas."), max_tokens=8)
    for other in ("book_flight(origin, destination, date)", "get_stock_price(symbol)", "translate(text, target)"):
        _answer(engine, _head(engine, other) + _turn(engine, "Hello."), max_tokens=4)  # both instances move on
    before = (cache.restored, cache.restored_tokens)
    prompt = family + _turn(engine, "Search my notes for garden.")
    gen, logits = _answer(engine, prompt)
    assert cache.restored == before[0] + 1
    assert cache.restored_tokens - before[1] == gen.cached_tokens >= len(family) - BLOCK
    assert gen.cached_tokens % BLOCK == 0 and gen.cached_tokens < len(prompt)
    assert np.array_equal(logits, _fresh(prompt))
    assert 0 < cache.bytes <= cache.max_bytes


@pytest.mark.model
@needs_model
def test_with_the_cache_off_an_instance_still_reuses_its_own_sequence_and_nothing_is_kept(engines) -> None:
    _, engine = engines
    head = _head(engine, "get_time(zone)")
    _answer(engine, head + _turn(engine, "Time in Oslo?"), max_tokens=4)
    _answer(engine, _head(engine, "unrelated_tool(x)") + _turn(engine, "Hi."), max_tokens=4)
    gen, _ = _answer(engine, head + _turn(engine, "Time in Lima?"))
    assert gen.cached_tokens == 0  # its own sequence is another now, and nothing was kept
    gen, _ = _answer(engine, head + _turn(engine, "Time in Rome?"))
    assert gen.cached_tokens > 0 and len(engine.prompt_cache) == 0 == engine.prompt_cache.kept


# -- the bookkeeping, on states that are plain bytes -------------------------------------------------------


def _key(*runs: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.full(n, v, dtype=np.intc) for v, n in runs])


def test_the_cache_stays_within_its_bytes_least_recently_used_out_first() -> None:
    from toolquake.proxy.backend.prompt_cache import PromptCache

    cache = PromptCache(1000)
    for v in range(1, 5):
        cache.put(_key((v, 100)), b"x" * 300)
    assert cache.bytes == 900 and len(cache) == 3  # the fourth pushed the first out
    assert cache.longest(_key((1, 100)))[0] == 0
    assert cache.longest(_key((2, 50), (9, 5)))[0] == 50  # looking 2 up makes it the most recent
    cache.put(_key((5, 100)), b"x" * 300)
    assert cache.longest(_key((3, 100)))[0] == 0 and cache.longest(_key((2, 100)))[0] == 100
    cache.put(_key((6, 100)), b"x" * 501)  # over half the cache: not kept
    assert cache.longest(_key((6, 100)))[0] == 0 and cache.bytes == 900


def test_a_kept_sequence_that_a_longer_one_extends_is_dropped() -> None:
    from toolquake.proxy.backend.prompt_cache import PromptCache

    cache = PromptCache(10_000)
    cache.put(_key((1, 64)), b"a" * 100)
    cache.put(_key((1, 64), (2, 64)), b"b" * 200)
    assert len(cache) == 1 and cache.bytes == 200
    found, key, state = cache.longest(_key((1, 64), (3, 10)))
    assert found == 64 and len(key) == 128 and bytes(state) == b"b" * 200
    cache.put(_key((1, 64), (3, 64)), b"c" * 200)  # a sibling, not an extension: both stay
    assert len(cache) == 2 and cache.longest(_key((1, 64), (3, 64)))[0] == 128


def test_cache_ram_takes_mebibytes_zero_or_more() -> None:
    from toolquake.proxy.backend.server import CACHE_RAM_MIB, build_parser, non_negative

    parser = build_parser()
    assert parser.parse_args([]).cache_ram == CACHE_RAM_MIB
    assert parser.parse_args(["--cache-ram", "0"]).cache_ram == 0
    for bad in ("-1", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--cache-ram", bad])
    with pytest.raises(argparse.ArgumentTypeError, match="0 or more"):
        non_negative("-1")
