"""The tool pool: every unique function of the BFCL single-turn corpus (unique by name, seed 003 §4.1),
as OpenAI tools, each with its signature embedding and its token cost, built once and cached on disk.

Cache layout under `$TOOLQUAKE_CACHE/tool_pool/bfcl-<corpus version>-<embedding model id>-v<format>/`:
`tools.json` (the tools and their corpus names), `embeddings.npy` (normalised signature embeddings),
`costs-<counter>.npy` (token cost of each tool per token counter, added as counters are used).
Perturbers get the pool through `get_pool(services)`: built (or read from disk) on first use, shared
by every request afterwards, never rebuilt per request.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from toolquake.bfcl.embeddings import Embedder, get_embedder, signature
from toolquake.perturbers.helpers.tokens import EstimateCounter

if TYPE_CHECKING:
    import numpy as np

FORMAT = 1
SERVICE = "tool_pool"
_ESTIMATE = EstimateCounter()


def tool_name(tool: dict[str, Any]) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return str((fn or {}).get("name", "")) if isinstance(fn, dict) else ""


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def _counter_key(counter: Any) -> str:
    key = getattr(counter, "key", None) or getattr(counter, "source", "unknown")
    model = getattr(counter, "model", None) if getattr(counter, "source", "") == "upstream" else None
    return f"{key}@{model}" if model else key


@dataclass
class ToolPool:
    """The pool in memory. Row i of `embeddings` and of every cost array is `tools[i]`."""

    tools: list[dict[str, Any]]
    sources: list[str]                      # corpus (dotted) name of each tool
    embeddings: np.ndarray                  # (n, dim) float32, L2-normalised signature embeddings
    model_id: str
    corpus_version: str
    directory: Path | None = None
    names: list[str] = field(init=False)
    index: dict[str, int] = field(init=False)
    _costs: dict[str, np.ndarray] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.names = [tool_name(t) for t in self.tools]
        self.index = {n: i for i, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.tools)

    # -- token costs -------------------------------------------------------------------------

    def costs(self, counter: Any) -> np.ndarray:
        """Token cost of each pool tool (`counter.count_tool`), computed once per counter and kept
        on disk; counters without `count_tool` get the estimate."""
        import numpy as np

        if not hasattr(counter, "count_tool"):
            counter = _ESTIMATE
        key = _counter_key(counter)
        cached = self._costs.get(key)
        if cached is not None:
            return cached
        with self._lock:
            if key in self._costs:
                return self._costs[key]
            path = self._cost_path(key)
            if path is not None and path.is_file():
                arr = np.load(path)
                if arr.shape == (len(self.tools),):
                    self._costs[key] = arr
                    return arr
            if hasattr(counter, "count_texts"):
                from toolquake.perturbers.helpers.tokens import tool_json

                values = [n + 1 for n in counter.count_texts([tool_json(t) for t in self.tools])]
            elif counter.source == "upstream":
                with ThreadPoolExecutor(max_workers=8) as pool:
                    values = list(pool.map(counter.count_tool, self.tools))
            else:
                values = [counter.count_tool(t) for t in self.tools]
            arr = np.asarray(values, dtype=np.int64)
            if path is not None:
                _atomic_save(path, arr)
            self._costs[key] = arr
            return arr

    def _cost_path(self, key: str) -> Path | None:
        if self.directory is None:
            return None
        digest = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
        return self.directory / f"costs-{_safe(key.split(':', 1)[0])}-{digest}.npy"

    # -- similarity --------------------------------------------------------------------------

    def embed_tools(self, tools: list[dict[str, Any]], embedder: Embedder, extra: tuple[str, ...] = ()) -> np.ndarray:
        """Signature embeddings of `tools` (the pool's row when a tool is a pool tool, same name and
        signature; the model otherwise), followed by those of the `extra` texts."""
        import numpy as np

        out = np.zeros((len(tools) + len(extra), self.embeddings.shape[1]), dtype=np.float32)
        todo: list[int] = []
        texts: list[str] = []
        for i, tool in enumerate(tools):
            sig = signature(tool)
            j = self.index.get(tool_name(tool))
            if j is not None and signature(self.tools[j]) == sig:
                out[i] = self.embeddings[j]
            else:
                todo.append(i)
                texts.append(sig)
        if todo:  # a toolkit's signatures are embedded once and then come from the embedder's cache
            out[todo] = embedder.embed(texts)
        if extra:  # apart: batched with long signatures, a short query would be padded to their length
            out[len(tools):] = embedder.embed(list(extra))
        return out

    def equivalents(self, originals: np.ndarray, threshold: float) -> np.ndarray:
        """Boolean mask of pool tools whose signature has cosine ≥ threshold to any original."""
        import numpy as np

        if originals.shape[0] == 0:
            return np.zeros(len(self.tools), dtype=bool)
        return (self.embeddings @ originals.T).max(axis=1) >= threshold

    def excluded(self, tools: list[dict[str, Any]], originals: np.ndarray, threshold: float) -> np.ndarray:
        """Pool tools a perturber must never add: equivalents of the originals and names already present."""
        mask = self.equivalents(originals, threshold)
        for tool in tools:
            j = self.index.get(tool_name(tool))
            if j is not None:
                mask[j] = True
        return mask


# -- building and caching ----------------------------------------------------------------------


def corpus_functions() -> tuple[str, list[dict[str, Any]]]:
    """(corpus version, unique function docs of the single-turn categories, first occurrence wins)."""
    from toolquake.bfcl.corpus import CORPUS_VERSION, SINGLE_TURN_CATEGORIES, load_cases

    seen: set[str] = set()
    docs: list[dict[str, Any]] = []
    for case in load_cases(SINGLE_TURN_CATEGORIES):
        for doc in case.functions:
            name = doc.get("name")
            if isinstance(name, str) and name not in seen:
                seen.add(name)
                docs.append(doc)
    return CORPUS_VERSION, docs


def build_pool(embedder: Embedder, docs: list[dict[str, Any]], corpus_version: str) -> ToolPool:
    """A pool from BFCL function docs: converted as an FC model sees them, unique by OpenAI name."""
    from toolquake.bfcl.convert import to_openai_tools

    tools: list[dict[str, Any]] = []
    sources: list[str] = []
    seen: set[str] = set()
    for doc in docs:
        converted, name_map = to_openai_tools([doc])
        name = tool_name(converted[0])
        if name in seen:  # `a.b` and `a_b` both in the corpus: the first one stays
            continue
        seen.add(name)
        tools.append(converted[0])
        sources.append(name_map[name])
    embeddings = embedder.embed([signature(t) for t in tools])
    return ToolPool(tools, sources, embeddings, embedder.model_id, corpus_version)


def cache_dir(model_id: str, corpus_version: str) -> Path:
    from toolquake.bfcl.corpus import cache_root

    return cache_root() / "tool_pool" / _safe(f"bfcl-{corpus_version}-{model_id}-v{FORMAT}")


def _atomic_save(path: Path, arr: Any) -> None:
    import numpy as np

    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def save_pool(pool: ToolPool, directory: Path) -> None:
    """Write the pool to `directory` atomically (a concurrent writer of the same pool is harmless)."""
    import numpy as np

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=directory.parent))
    try:
        meta = {"format": FORMAT, "corpus_version": pool.corpus_version, "model_id": pool.model_id,
                "sources": pool.sources, "tools": pool.tools}
        (tmp / "tools.json").write_bytes(msgspec.json.encode(meta))
        np.save(tmp / "embeddings.npy", pool.embeddings)
        try:
            os.rename(tmp, directory)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pool.directory = directory
    pool.costs(_ESTIMATE)  # the estimate's costs are part of every pool


def read_pool(directory: Path) -> ToolPool | None:
    """The pool cached in `directory`, or None when it is missing or unreadable."""
    import numpy as np

    try:
        meta = msgspec.json.decode((directory / "tools.json").read_bytes())
        embeddings = np.load(directory / "embeddings.npy")
    except (OSError, ValueError, msgspec.DecodeError):
        return None
    if meta.get("format") != FORMAT or embeddings.shape[0] != len(meta.get("tools") or []):
        return None
    return ToolPool(meta["tools"], meta["sources"], embeddings, meta["model_id"], meta["corpus_version"],
                    directory=directory)


def load_pool(embedder: Embedder | None = None) -> ToolPool:
    """The pool for the installed corpus and embedding model: from the disk cache, else built
    (about a minute on two CPU cores) and cached."""
    from toolquake.bfcl.corpus import CORPUS_VERSION

    embedder = embedder or get_embedder()
    directory = cache_dir(embedder.model_id, CORPUS_VERSION)
    pool = read_pool(directory)
    if pool is not None:
        return pool
    t0 = time.perf_counter()
    version, docs = corpus_functions()
    pool = build_pool(embedder, docs, version)
    save_pool(pool, directory)
    _log_built(len(pool), directory, time.perf_counter() - t0)
    return read_pool(directory) or pool


def _log_built(tools: int, directory: Path, seconds: float) -> None:
    """One `tool_pool_built` event in the proxy's log (where structlog is configured: a bare CLI prints nothing)."""
    import structlog

    if structlog.is_configured():
        structlog.get_logger("toolquake.tool_pool").info("tool_pool_built", tools=tools, directory=directory.name,
                                                         seconds=round(seconds, 3))


_build_lock = threading.Lock()


def get_pool(services: Any) -> ToolPool:
    """The shared pool of this process (a `Services` entry), created on first use."""
    with _build_lock:
        return services.get(SERVICE, load_pool)


def get_shared_embedder(services: Any) -> Embedder:
    with _build_lock:
        return services.get("embedder", get_embedder)
