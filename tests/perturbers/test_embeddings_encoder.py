"""The own sentence encoder (bfcl/minilm.py) against sentence-transformers, which it stands in for: the same vectors
(to float32 rounding) for every kind of text the perturbers embed, the same int8 query vectors, a fallback to
sentence-transformers for a folder it does not read, and a process that embeds without importing transformers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.needs_embeddings]

if importlib.util.find_spec("sentence_transformers") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("needs the embeddings extra (make install-embeddings)", allow_module_level=True)

import numpy as np  # noqa: E402

from tests.support import ROOT  # noqa: E402
from toolquake.bfcl.embeddings import Embedder, EmbeddingsUnavailable, get_embedder, model_path  # noqa: E402

TEXTS = [
    "book a hotel room in Chicago",
    "   What is the weather in Paris?  \n",  # stripped, as sentence-transformers strips
    "",
    "x",
    "Ünïcödé текст 中文 😀 and ﬁ ligatures",
    "get_weather | Current weather of a city. | city: the city's name | unit: C or F",
    "word " * 700,  # past the model's 256 tokens: cut there
    "a" * 5000,  # one word longer than WordPiece reads: [UNK]
    "calculate_triangle_area | Calculate the area of a triangle given its base and height. | base: b | height: h",
]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_path()), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def corpus_texts():
    """Signatures of 64 of the BFCL corpus's functions, spread over it (the texts toolkit expansion embeds most)."""
    from toolquake.bfcl import corpus
    from toolquake.bfcl.embeddings import signature

    if not corpus.is_present():
        return []
    from toolquake.bfcl.corpus import SINGLE_TURN_CATEGORIES, load_cases

    fns = [f for c in load_cases(SINGLE_TURN_CATEGORIES) for f in c.functions]
    return [signature({"type": "function", "function": f}) for f in fns[::max(1, len(fns) // 64)][:64]]


def test_the_own_encoder_is_what_embeds_the_packaged_model() -> None:
    embedder = get_embedder()
    assert embedder._encoder is not None and embedder._model is None
    assert embedder.dim == 384


def test_vectors_equal_sentence_transformers_to_float32_rounding(reference, corpus_texts) -> None:
    texts = TEXTS + corpus_texts
    ours = Embedder().embed(texts)
    theirs = reference.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True,
                              show_progress_bar=False)
    assert ours.shape == theirs.shape == (len(texts), 384) and ours.dtype == np.float32
    # float32 rounding: the two compute the same operations, not always in the same order
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
    # and it is the model, not something near it: the nearest neighbour of every text is the same one
    assert ((ours @ ours.T).argsort(1)[:, -2] == (theirs @ theirs.T).argsort(1)[:, -2]).mean() > 0.99


def test_a_text_embedded_alone_or_in_a_batch_gets_the_same_vector(reference) -> None:
    embedder = Embedder()
    batch = embedder.embed(TEXTS)
    for i, text in enumerate(TEXTS):
        alone = Embedder().embed([text])[0]
        np.testing.assert_allclose(alone, batch[i], rtol=0, atol=1e-6)
        np.testing.assert_allclose(alone, reference.encode([text], convert_to_numpy=True, normalize_embeddings=True,
                                                           show_progress_bar=False)[0], rtol=0, atol=1e-6)


def test_query_vectors_equal_the_sentence_transformers_int8_path(reference) -> None:
    """embed_query by the own encoder's int8 copy against the same quantization of sentence-transformers' model
    (the path the embedder took before): the same vector."""
    from toolquake.bfcl.embeddings import _sentence_transformer

    ours = Embedder()
    theirs = Embedder()
    theirs._encoder, theirs._model, theirs._query_model = None, _sentence_transformer(model_path()), None
    for text in ("What is the weather in Paris?", "Convert 100 USD to EUR, then book a flight to Tokyo for two",
                 "\ud800 a lone surrogate", "", "word " * 400):
        for max_tokens in (4, 32, 64):
            a, b = ours.embed_query(text, max_tokens=max_tokens), theirs.embed_query(text, max_tokens=max_tokens)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
            assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5


def _folder_with(tmp_path, name: str, change) -> object:
    """A copy of the packaged model's folder (its big files linked, not copied) with one file changed."""
    src = model_path()
    dst = tmp_path / name
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    change(dst)
    return dst


def test_a_folder_the_encoder_does_not_read_is_loaded_by_sentence_transformers(tmp_path, reference) -> None:
    def cls_pooling(folder):
        pooling = folder / "1_Pooling" / "config.json"
        config = json.loads(pooling.read_text())
        pooling.unlink()
        pooling.write_text(json.dumps({**config, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))

    folder = _folder_with(tmp_path, "cls-pooled", cls_pooling)
    embedder = Embedder(folder)
    assert embedder._encoder is None and embedder._model is not None
    from sentence_transformers import SentenceTransformer

    cls = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    want = cls.encode(TEXTS[:4], convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
    np.testing.assert_allclose(embedder.embed(TEXTS[:4]), want, rtol=0, atol=1e-6)
    # and it is not the mean-pooled vector
    assert float(np.abs(want - reference.encode(TEXTS[:4], normalize_embeddings=True)).max()) > 0.01


def test_a_readable_folder_with_broken_weights_is_a_clear_error(tmp_path) -> None:
    def truncated(folder):
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.unlink()
        weights.write_bytes(data[: len(data) // 2])

    with pytest.raises(EmbeddingsUnavailable, match="cannot load the embedding model"):
        Embedder(_folder_with(tmp_path, "truncated", truncated))

    def renamed(folder):  # weights of another architecture's names: no BERT embeddings in them
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(model_path() / "model.safetensors"))
        (folder / "model.safetensors").unlink()
        save_file({k.replace("embeddings.", "embed."): v for k, v in tensors.items()},
                  str(folder / "model.safetensors"))

    with pytest.raises(EmbeddingsUnavailable, match="word_embeddings"):
        Embedder(_folder_with(tmp_path, "renamed", renamed))


@pytest.mark.processes
def test_a_process_embeds_without_importing_transformers() -> None:
    code = ("import sys; from toolquake.bfcl.embeddings import embed; v = embed(['hello']); "
            "print(v.shape[1], 'transformers' in sys.modules, 'sentence_transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["384", "False", "False"]
