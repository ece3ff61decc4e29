"""The weights the embedded backend serves by default (proxy/backend/local.py `default_weights`): the shipped Q4_1
file expanded once to F16 in `$TOOLQUAKE_CACHE/models`, kept to the weights' own values (the F16 copy's logits stay
within a tenth of a logit of an F32 copy's, the exact expansion), written whole or not at all, found again without
converting, and the shipped file served as it is where the cache cannot be written."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from tests.support.backend import MODEL

pytestmark = MODEL

PROMPT = ("<|im_start|>system\nYou call tools.<|im_end|>\n<|im_start|>user\nWhat is the weather in Paris? Use "
          "get_weather(city).<|im_end|>\n<|im_start|>assistant\n")


def _logits(path: Path) -> np.ndarray:
    """The logits at every position of PROMPT (one batch, so every file is evaluated the same way)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, n_batch=512, logits_all=True, verbose=False)
    llm.eval(llm.tokenize(PROMPT.encode(), special=True))
    return np.array(llm.scores[:llm.n_tokens])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_expanded_once_then_found_and_kept_to_the_weights_values(cache: Path, monkeypatch) -> None:
    from toolquake.proxy.backend.local import EXPANDED_TYPE, default_weights, expand, gguf_path, models_dir

    monkeypatch.setenv("TOOLQUAKE_CACHE", str(cache))
    said: list[str] = []
    llama_log = logging.getLogger("llama-cpp-python")  # silenced while converting, then as it was
    before = llama_log.level
    llama_log.setLevel(logging.INFO)
    try:
        weights = default_weights(said.append)
        assert llama_log.level == logging.INFO
    finally:
        llama_log.setLevel(before)
    assert weights.parent == models_dir() == cache / "models" and f".{EXPANDED_TYPE}." in weights.name
    assert len(said) == 1 and said[0].startswith("expanding ") and str(weights) in said[0], said
    assert [p.name for p in (cache / "models").iterdir()] == [weights.name]  # no partial file left beside it
    assert weights.stat().st_size > 2 * gguf_path().stat().st_size  # two bytes a weight
    assert weights.stat().st_mode & 0o044 == 0o044  # readable by another user sharing the cache
    # found again: nothing converted, nothing said
    stamp = weights.stat().st_mtime_ns
    assert default_weights(said.append) == weights and len(said) == 1 and weights.stat().st_mtime_ns == stamp
    # F32 holds every Q4_1 weight (scale x q + min) exactly: the F16 copy's logits stay within a tenth of a logit of
    # it at every position, with the same top token (measured 0.097 over four prompts; the shipped file's own
    # kernels, which round the activations to 8 bits, differ from it by up to 1.6)
    exact = cache / "exact.F32.gguf"
    expand(gguf_path(), exact, ftype="F32")
    f16, f32 = _logits(weights), _logits(exact)
    assert np.abs(f16 - f32).max() < 0.25, np.abs(f16 - f32).max()
    assert (f16.argmax(1) == f32.argmax(1)).all()


def test_a_cache_that_cannot_be_written_serves_the_shipped_file(tmp_path: Path, monkeypatch) -> None:
    from toolquake.proxy.backend.local import default_weights, gguf_path

    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache folder should be")
    monkeypatch.setenv("TOOLQUAKE_CACHE", str(not_a_dir))
    said: list[str] = []
    assert default_weights(said.append) == gguf_path()
    assert len(said) == 2 and said[1].startswith("serving the shipped ") and "cannot be written" in said[1], said


def test_a_failed_conversion_leaves_no_file(tmp_path: Path) -> None:
    from toolquake.proxy.backend.local import BackendUnavailable, expand

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"GGUF? no" * 100)
    out = tmp_path / "out"
    with pytest.raises(BackendUnavailable, match="could not convert"):
        expand(not_gguf, out / "model.F16.gguf")
    assert list(out.iterdir()) == []
    with pytest.raises(ValueError, match="Q4_0"):
        expand(not_gguf, out / "model.Q4_0.gguf", ftype="Q4_0")
