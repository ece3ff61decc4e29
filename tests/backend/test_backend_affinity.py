"""The embedded backend's choice of model instance (`--parallel N`): a request goes to the free instance that has
already evaluated the longest prefix of its prompt (llama-cpp-python then evaluates only the rest), the longest
free one among equals, and waits while every instance is busy. On the real model: the prefixes are the instances'
own record of what they evaluated (the whole blocks of their last prompt, prompt_cache.py)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.backend import MODEL
from toolquake.proxy.backend.prompt_cache import BLOCK

pytestmark = [*MODEL]


@pytest.fixture(scope="module")
def engine():
    from toolquake.proxy.backend.local import default_weights
    from toolquake.proxy.backend.server import Engine

    return Engine(str(default_weights()), n_ctx=2048, threads=1, parallel=2)


def _answer(engine, tokens: list[int]) -> None:
    engine.generate(tokens, None, max_tokens=1, temperature=0.0, top_p=1.0, sampling_seed=None, stop=[])


def test_a_prompt_goes_to_the_instance_that_evaluated_its_prefix(engine) -> None:
    head = engine.tokenize("You are a helpful assistant. The tools: get_weather(city), convert_currency(amount, "
                           "from, to), list_events(day). Answer with one call. " * 3, special=False)
    first = head + engine.tokenize(" What is the weather in Paris?", special=False)
    _answer(engine, first)
    served = engine.free[-1]  # given back last: FIFO order alone would hand out the other one first
    other = engine.free[0]
    reusable = engine.prompt_cache.reusable
    assert reusable(served, first) >= len(head) - BLOCK and reusable(other, first) < len(head) - BLOCK
    second = head + engine.tokenize(" Convert 100 USD to EUR.", special=False)
    got = engine.borrow(second)
    try:
        assert got is served
    finally:
        engine.give_back(got)
    # a prompt neither instance has seen any of: the one free the longest
    unrelated = engine.tokenize("Zebras graze.", special=False)
    assert reusable(served, unrelated) == 0 == reusable(other, unrelated)
    longest_free = engine.free[0]
    got = engine.borrow(unrelated)
    try:
        assert got is longest_free
    finally:
        engine.give_back(got)


def test_a_request_waits_while_every_instance_is_busy_and_gets_the_one_given_back(engine) -> None:
    held = [engine.borrow([1, 2, 3]), engine.borrow([1, 2, 3])]
    assert engine.free == []
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(engine.borrow([4, 5])))
    waiter.start()
    # a positive signal that it waits: it is among the condition's waiters (CPython's threading.Condition)
    deadline = time.monotonic() + 30
    while len(engine.free_changed._waiters) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.free_changed._waiters) == 1 and got == []
    engine.give_back(held[1])
    waiter.join(30)
    assert got == [held[1]]
    engine.give_back(held[0])
    engine.give_back(got[0])
    assert len(engine.free) == 2
