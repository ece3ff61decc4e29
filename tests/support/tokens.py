"""OpenAI's tiktoken encoding files for the token-counter tests: where `make tiktoken-files` put them, and each
encoding as tiktoken itself builds it (to compare the counter's counts with)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def tiktoken_files() -> Path:
    """`make tiktoken-files`' folder, with OpenAI's files (checked by hash by the counter itself)."""
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs the tokenizers extra (tiktoken)")
    from toolquake.bfcl.corpus import cache_root

    folder = cache_root() / "tiktoken"
    if not (folder / "o200k_base.tiktoken").is_file():
        pytest.skip(f"needs OpenAI's encoding files in {folder}: make tiktoken-files")
    return folder


def tiktokens_own(encoding: str, folder: Path, tmp_path: Path, monkeypatch):
    """The encoding as tiktoken itself builds it: its own definition, loading from its own download cache (a
    private one here, filled under tiktoken's cache names), its own hash check."""
    import hashlib
    import shutil

    import tiktoken
    from tiktoken_ext import openai_public

    url = f"https://openaipublic.blob.core.windows.net/encodings/{encoding}.tiktoken"
    shutil.copy(folder / f"{encoding}.tiktoken", tmp_path / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    return tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS[encoding]())
