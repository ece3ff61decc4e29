"""tool_search, in-process (the step's logic: `apply` on a request, as the pipeline calls it): what it keeps, on
made-up toolkits and on BFCL `multiple` cases padded to 500 tools, by BM25 and by embeddings."""

from __future__ import annotations

import copy
import random
import statistics
from typing import Any

import pytest

from tests.support.catalogs import padded_cases
from tests.support.perturbers import HAVE_EMBEDDINGS, on_corpus
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.remedies import build


def tool(name: str, description: str = "", **params: str) -> dict[str, Any]:
    props = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props}}}


def names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def run(params: dict[str, Any], body: dict[str, Any], services: Services | None = None
        ) -> tuple[ChatRequest, dict[str, Any]]:
    ctx = PerturbContext(perturbation_seed=3, rng=random.Random(3), services=services or Services())
    out = build("tool_search", params).apply(ChatRequest(body), ctx)
    return out, ctx.report


TOPICS = ["weather forecast temperature", "flight booking airline seat", "hotel room reservation",
          "stock price ticker market", "currency exchange rate", "translate text language", "calendar event meeting",
          "email send message inbox", "restaurant table dinner", "movie showtime cinema", "music song playlist",
          "news headline article", "recipe cooking ingredient", "taxi ride driver", "parcel shipment tracking",
          "bank account balance", "fitness workout steps", "lyrics of a song", "dictionary word definition",
          "timezone local time city"]
TOOLKIT = [tool(f"t{i}_{t.split()[0]}", f"Look up {t}.", query=f"the {t.split()[1]} to look up")
           for i, t in enumerate(TOPICS)]


def test_keeps_the_related_tools_at_most_k_in_the_request_order():
    body = {"model": "m", "messages": [{"role": "user", "content": "Book a flight seat with an airline to Rome, "
                                                                   "and a hotel room reservation there"}],
            "tools": TOOLKIT}
    out, report = run({"k": 3, "method": "bm25"}, body)
    kept = names(out.tools)
    assert len(kept) == 3 and {"t1_flight", "t2_hotel"} <= set(kept)
    assert kept == [n for n in names(TOOLKIT) if n in kept]  # the request's order
    assert report["kept"] == 3 and report["k"] == 3 and report["method"] == "bm25"
    assert sorted(report["dropped"]) == sorted(set(names(TOOLKIT)) - set(kept))
    assert build("tool_search", {"k": 3}).dropped_tools(report) == report["dropped"]


def test_called_tools_and_the_named_tool_are_kept_and_k_plus_called_is_the_most():
    called = ["t10_music", "t15_bank"]
    messages = [{"role": "user", "content": "Play a song, check my balance"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
                    for i, n in enumerate(called)]},
                {"role": "tool", "tool_call_id": "c0", "content": "ok"},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "user", "content": "Now what is the weather forecast temperature in Oslo?"}]
    body = {"model": "m", "messages": messages, "tools": TOOLKIT,
            "tool_choice": {"type": "function", "function": {"name": "t19_timezone"}}}
    out, report = run({"k": 2, "method": "bm25", "turns": 1}, body)
    kept = names(out.tools)
    assert set(called) <= set(kept) and "t19_timezone" in kept and "t0_weather" in kept
    assert len(kept) == 2 + len(called) and report["kept"] == len(kept)


def test_a_toolkit_within_k_is_left_as_it_came():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLKIT[:5]}
    request = ChatRequest(body)
    ctx = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=Services())
    assert build("tool_search", {"k": 8, "method": "bm25"}).apply(request, ctx) is request
    assert ctx.report == {"k": 8, "method": "bm25", "kept": 5, "dropped": []}


def test_deterministic_and_never_mutates_its_input():
    body = {"model": "m", "messages": [{"role": "user", "content": "Exchange rate of the euro"}], "tools": TOOLKIT}
    before = copy.deepcopy(body)
    services = Services()
    # seen once (scored doc by doc), twice (indexed), three times (the index reused), and by fresh caches
    bm25 = {"k": 4, "method": "bm25"}
    outs = [run(bm25, body, services)[0] for _ in range(3)] + [run(bm25, body, Services())[0]]
    assert body == before
    assert all(out.body == outs[0].body for out in outs) and "t4_currency" in names(outs[0].tools)


@pytest.mark.parametrize("params, says", [({"k": 0}, "k must"), ({"method": "regex"}, "method must"),
                                          ({"turns": 0}, "turns must"), ({"kk": 1}, "unknown field `kk`")])
def test_bad_parameters_are_refused_at_load(params, says):
    with pytest.raises(ValueError, match=f"remedy 'tool_search': .*{says}"):
        build("tool_search", params)


# --- BFCL `multiple` cases padded to 500 tools ------------------------------------------------------------------


def kept_needed(method: str, count: int, services: Services | None = None) -> float:
    services = services or Services()
    if method == "embeddings":  # the pool's vectors are the padding tools' (loaded from its disk cache)
        from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool

        get_pool(services)
    found = 0
    for body, needed in padded_cases(count):
        out, report = run({"k": 8, "method": method}, body, services)
        assert len(out.tools) <= 8 and report["method"] == method
        found += needed <= set(names(out.tools))
    return found / count


@on_corpus
def test_bm25_keeps_the_needed_tool_of_padded_bfcl_cases():
    assert kept_needed("bm25", 100) >= 0.9


@on_corpus
@pytest.mark.needs_embeddings
@pytest.mark.skipif(not HAVE_EMBEDDINGS, reason="needs the embeddings extra (make install-embeddings)")
def test_embeddings_keep_the_needed_tool_of_padded_bfcl_cases():
    assert kept_needed("embeddings", 60) >= 0.9


# --- by embeddings: the query the model reads, and its cache ------------------------------------------------------


needs_embeddings = pytest.mark.skipif(not HAVE_EMBEDDINGS, reason="needs the embeddings extra")


@on_corpus
@pytest.mark.needs_embeddings
@needs_embeddings
def test_the_int8_query_embedding_keeps_the_needed_tool_and_stays_close_to_the_models():
    """The query the remedy embeds (the last user message, its first QUERY_TOKENS tokens, by the int8 copy of the
    model) keeps the needed tools of 100 padded BFCL cases at the bar, and each vector is close to the model's own."""
    from toolquake.bfcl.embeddings import get_embedder
    from toolquake.perturbers.toolkit_expansion import last_user_text
    from toolquake.remedies.tool_search import _QUERIES, QUERY_TOKENS

    services = Services()
    assert kept_needed("embeddings", 100, services) >= 0.9
    assert len(services.get(_QUERIES, dict)) == 100  # the query path ran: one vector per case's question
    embedder = get_embedder()
    questions = [last_user_text(body["messages"]) for body, _ in padded_cases(20)]
    exact = embedder.embed(questions)
    fast = [embedder.embed_query(q, max_tokens=QUERY_TOKENS) for q in questions]
    cosines = [float(a @ b) for a, b in zip(exact, fast)]  # a question past QUERY_TOKENS loses its tail
    assert statistics.median(cosines) > 0.9 and min(cosines) > 0.75


def step(messages: list[dict[str, Any]], i: int, result: str) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "t13_taxi", "arguments": "{}"}}
    return [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": result}]


@pytest.mark.needs_embeddings
@needs_embeddings
def test_a_turns_later_steps_reuse_the_query_embedding_and_read_the_recent_turns():
    """An agent's steps within a turn repeat the last user message: one query embedding for the turn, kept by its
    digest (not its text: a 200 KB message costs the cache about 2 KB); each step's new tool results still count."""
    services = Services()
    question = "Get me a taxi ride to the airport. " + "Thank you kindly, dear assistant. " * 6000
    results = {"t14_parcel": "The driver says the parcel shipment tracking number is needed first.",
               "t15_bank": "Done. Also note: the bank account balance is low.",
               "t3_stock": "The stock price ticker market closed."}
    for i, (named, result) in enumerate(results.items()):
        messages = step([{"role": "user", "content": question}], i, result)
        out, report = run({"k": 2, "method": "embeddings", "turns": 1}, {"model": "m", "messages": messages,
                                                                         "tools": TOOLKIT}, services)
        assert report["method"] == "embeddings" and "t13_taxi" in names(out.tools)
        assert named in names(out.tools)  # the step's tool result, read lexically
    from toolquake.remedies.tool_search import _QUERIES, QUERY_CACHE_BYTES

    cache = services.get(_QUERIES, dict)
    assert len(cache) == 1 and cache.nbytes < 4096 <= len(question) and cache.max_bytes == QUERY_CACHE_BYTES


@pytest.mark.needs_embeddings
@needs_embeddings
def test_a_lone_surrogate_in_the_question_is_searched_by_embeddings():
    """JSON's "\\ud800" decodes to a lone surrogate, which the model's tokenizer refuses: the question is still
    embedded (that character replaced), not the step failed."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Exchange rate of the euro \ud800 today"}],
            "tools": TOOLKIT}
    out, report = run({"k": 3, "method": "embeddings"}, body)
    assert report["method"] == "embeddings" and "t4_currency" in names(out.tools) and len(out.tools) == 3
