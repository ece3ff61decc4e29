"""OpenAI's tiktoken encodings without a download: find the encoding file locally, check it, build the encoding.

`tiktoken` fetches an encoding's ranks file from OpenAI's servers the first time it is asked for it, which
cannot work offline (and a proxy should not stall on it). Here the file comes from, in order:

1. the path the user gave (`tiktoken:/path/o200k_base.tiktoken`);
2. `$TOOLQUAKE_CACHE/tiktoken/<file>.tiktoken`, named as OpenAI names it (`make tiktoken-files` puts them there);
3. tiktoken's own download cache (`TIKTOKEN_CACHE_DIR`, `DATA_GYM_CACHE_DIR`, or `<tmp>/data-gym-cache`),
   where each file is named by the SHA-1 of its URL;
4. the copies of tiktoken's cache that the `litellm` package ships (same names), when it is installed
   (read as files: litellm is never imported).

Every file is checked against the SHA-256 that tiktoken's own encoding definitions
(`tiktoken_ext.openai_public`) publish for that encoding, so a file is used only when it is byte for byte
OpenAI's. The pattern and special tokens come from those same definitions: each definition is run with
its file loader swapped (in a private copy of its globals, nothing global is changed) for one that reads
the local file.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import tempfile
import types
from pathlib import Path
from typing import Any

#: encodings tiktoken defines with one `.tiktoken` ranks file (gpt2 uses two other files: use r50k_base,
#: its identical successor)
ENCODINGS = ("r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base", "o200k_harmony")


class TiktokenFileError(ValueError):
    """No usable local file for the encoding, or a file that is not OpenAI's."""


class _Wanted(Exception):
    """Raised by the probing loader: carries the URL and hash an encoding definition asks for."""

    def __init__(self, url: str, expected_hash: str | None) -> None:
        super().__init__(url)
        self.url = url
        self.expected_hash = expected_hash


def _definitions(loader: Any) -> dict[str, Any]:
    """tiktoken's encoding constructors, rebound to globals in which `load_tiktoken_bpe` is `loader`."""
    try:
        import tiktoken  # noqa: F401
        from tiktoken_ext import openai_public
    except ImportError:
        raise TiktokenFileError("token_counter 'tiktoken:' needs the `tiktoken` package: "
                                "pip install 'toolquake[tokenizers]' (or pip install tiktoken)") from None
    scope = dict(vars(openai_public))
    scope["load_tiktoken_bpe"] = loader
    rebound = {}
    for name, fn in openai_public.ENCODING_CONSTRUCTORS.items():
        if isinstance(fn, types.FunctionType):
            rebound[name] = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            scope[fn.__name__] = rebound[name]
    return rebound


def wanted_file(encoding: str) -> tuple[str, str]:
    """(URL, SHA-256) of the ranks file tiktoken's definition of `encoding` loads."""
    def probe(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        raise _Wanted(url, expected_hash)

    definition = _definitions(probe).get(encoding)
    if definition is None or encoding not in ENCODINGS:
        raise TiktokenFileError(f"unknown tiktoken encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    try:
        definition()
    except _Wanted as wanted:
        if not wanted.expected_hash:
            raise TiktokenFileError(f"tiktoken publishes no hash for {encoding!r}") from None
        return wanted.url, wanted.expected_hash
    raise TiktokenFileError(f"tiktoken's definition of {encoding!r} loads no ranks file")


def candidates(encoding: str, url: str) -> list[Path]:
    """Where a local copy of `encoding`'s file may be, in the order they are tried."""
    by_url = hashlib.sha1(url.encode()).hexdigest()  # tiktoken's own cache key (not a security use)
    # named as OpenAI names the file (o200k_harmony uses o200k_base.tiktoken)
    from toolquake.bfcl.corpus import cache_root

    found = [cache_root() / "tiktoken" / url.rsplit("/", 1)[-1]]
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / by_url)
    found.append(Path(tempfile.gettempdir()) / "data-gym-cache" / by_url)
    spec = importlib.util.find_spec("litellm")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            found.append(Path(root) / "litellm_core_utils" / "tokenizers" / by_url)
    return found


def parse_ranks(data: bytes) -> dict[bytes, int]:
    """A `.tiktoken` file: one `<base64 token> <rank>` per line."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def identify(data: bytes) -> str:
    """The encoding whose published hash this file has (the first of ENCODINGS that uses it)."""
    digest = _sha256(data)
    for encoding in ENCODINGS:
        try:
            if wanted_file(encoding)[1] == digest:
                return encoding
        except TiktokenFileError:
            continue
    raise TiktokenFileError(f"not one of OpenAI's encoding files (sha256 {digest[:16]}… matches none that "
                            f"tiktoken publishes for {', '.join(ENCODINGS)})")


def load(spec: str) -> tuple[Any, str, Path]:
    """(tiktoken.Encoding, encoding name, file used) for `spec`: an encoding name or a path to a
    `.tiktoken` file."""
    if spec in ENCODINGS:
        encoding = spec
        url, digest = wanted_file(encoding)
        places = candidates(encoding, url)
        path = next((p for p in places if p.is_file() and _sha256(p.read_bytes()) == digest), None)
        if path is None:
            looked = "; ".join(str(p) for p in places)
            raise TiktokenFileError(
                f"token_counter 'tiktoken:{encoding}': no local copy of its encoding file (looked in: {looked}). "
                f"toolquake never downloads it at run time: run `make tiktoken-files`, or fetch {url} "
                f"(sha256 {digest}) once and pass tiktoken:/path/{encoding}.tiktoken")
        data = path.read_bytes()
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise TiktokenFileError(f"token_counter 'tiktoken:': {spec!r} is neither a known encoding "
                                    f"({', '.join(ENCODINGS)}) nor an existing .tiktoken file")
        data = path.read_bytes()
        encoding = identify(data)
        # a file named after an encoding that shares it (o200k_harmony.tiktoken) is taken as that encoding
        if path.stem in ENCODINGS and path.stem != encoding and wanted_file(path.stem)[1] == _sha256(data):
            encoding = path.stem
    ranks = parse_ranks(data)

    def local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        return ranks

    import tiktoken

    params = _definitions(local)[encoding]()
    return tiktoken.Encoding(**params), encoding, path
