"""Asking an OpenAI-compatible server to rewrite text, with an on-disk cache that replicas can share.

The cache is a directory of small JSON files named by a hash of everything that determines the
answer (prompt version, model, input). Writes are atomic (temporary file, then rename), so any
number of processes and hosts may share the directory (a volume); a replay reads the same answer
that the first run got.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()
#: bytes a generator cache directory may grow to (its keys come from client text: every new prompt adds a file);
#: beyond it nothing more is written (answers are still used). $TOOLQUAKE_GENERATOR_CACHE_MAX_BYTES overrides it.
ENV_CACHE_MAX = "TOOLQUAKE_GENERATOR_CACHE_MAX_BYTES"
DEFAULT_CACHE_MAX = 1024**3
# directory → bytes this process knows it holds (counted once, then kept up to date by its writes)
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


class GeneratorError(RuntimeError):
    """The generator answered with an error or something that is not a chat completion."""


def toolquake_cache() -> Path:
    return Path(os.environ.get("TOOLQUAKE_CACHE") or Path.home() / ".cache" / "toolquake")


def _size_of(directory: Path) -> int:
    total = 0
    try:
        for sub in os.scandir(directory):
            if sub.is_dir(follow_symlinks=False):
                for entry in os.scandir(sub.path):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


class DiskCache:
    def __init__(self, directory: str | Path, max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes if max_bytes is not None else int(os.environ.get(ENV_CACHE_MAX) or DEFAULT_CACHE_MAX)

    @staticmethod
    def key(*parts: Any) -> str:
        return hashlib.sha256(json.dumps(parts, ensure_ascii=False, sort_keys=True).encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict[str, Any]) -> bool:
        """Write `value` under `key`; False (nothing written) when the directory is at `max_bytes`."""
        data = json.dumps(value, ensure_ascii=False).encode()
        with _held_lock:
            held = _held.get(self.directory)
            if held is None:
                held = _held[self.directory] = _size_of(self.directory)
            if held + len(data) > self.max_bytes:
                return False
            _held[self.directory] = held + len(data)
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True


class Generator:
    """A synchronous client of one OpenAI-compatible server (`base_url` ends in /v1)."""

    def __init__(self, base_url: str, timeout: float) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)))

    def chat(self, model: str, messages: list[dict[str, Any]], api_key: str | None = None, **params: Any) -> str:
        """The text of the first choice; GeneratorError when there is none."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = self.client.post(f"{self.base_url}/chat/completions", headers=headers,
                                json={"model": model, "messages": messages, **params})
        if resp.status_code != 200:
            raise GeneratorError(f"generator answered HTTP {resp.status_code}")
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise GeneratorError("generator answer is not a chat completion") from None
        if not isinstance(content, str):
            raise GeneratorError("generator answered without text")
        return content


def generator(services: Any, base_url: str, timeout: float) -> Generator:
    """The process-wide client for `base_url` (one connection pool per generator)."""
    with _lock:
        return services.get(f"generator:{base_url}:{timeout}", lambda: Generator(base_url, timeout))
