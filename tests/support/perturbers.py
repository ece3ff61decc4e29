"""What the perturber and remedy tests share: whether the BFCL corpus and the embeddings extra are here (and the
marks that skip a test without them), a BFCL case as a chat request, and a request sent through a proxy profile."""

from __future__ import annotations

import importlib.util
import uuid
from typing import Any

import openai
import pytest

HAVE_EMBEDDINGS = importlib.util.find_spec("sentence_transformers") is not None
#: skips a test where the embeddings extra is not installed
embeddings = pytest.mark.skipif(not HAVE_EMBEDDINGS, reason="needs the embeddings extra (make install-embeddings)")


def corpus_present() -> bool:
    try:
        from toolquake.bfcl import corpus
    except ImportError:
        return False
    return corpus.is_present()


#: marks for a test (or `pytestmark`) that reads the BFCL corpus: selected by `needs_corpus`, skipped without it
needs_corpus = [pytest.mark.needs_corpus,
                pytest.mark.skipif(not corpus_present(), reason="needs the BFCL corpus: toolquake corpus pull")]


def on_corpus(fn):
    """`needs_corpus` as a decorator of one test."""
    for mark in needs_corpus:
        fn = mark(fn)
    return fn


def needs_pool(fn):
    """Marks for tests that use the tool pool: the corpus and the embeddings extra."""
    for mark in (*needs_corpus, pytest.mark.needs_embeddings, embeddings):
        fn = mark(fn)
    return fn


def names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def bfcl(case_id: str) -> tuple[Any, dict[str, Any]]:
    """A BFCL case and its chat request (model `fake-model`)."""
    from toolquake.bfcl.corpus import case_request, load_case

    case = load_case(case_id)
    return case, case_request(case, model="fake-model")


def send(proxy, profile: str, body: dict[str, Any], case_id: str | None = None) -> tuple[str, Any]:
    """`body` through `profile` of `proxy` with the `openai` SDK, tagged for the fake upstream: (tag, answer)."""
    tag = uuid.uuid4().hex
    headers = {"X-Test-Tag": tag}
    if case_id:
        headers["X-Toolquake-Case"] = case_id
    client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="k", default_headers=headers, timeout=300)
    answer = client.chat.completions.create(**body)
    return tag, answer


