"""Token counting for budgets: one interface, three sources.

`[server] token_counter` chooses the source:

- `estimate`: a documented local estimate (no dependency, no network);
- `upstream`: the backend's own tokenizer: vLLM's `POST /tokenize` at the server root with
  `{model, messages, tools}` (its chat template applied), falling back to llama.cpp's
  `POST /extras/tokenize/count` with the request rendered as text;
- `tokenizer:/path/tokenizer.json`: a local Hugging Face `tokenizer.json` through the `tokenizers`
  library (tokenizers extra), applied to the request rendered as text;
- `tiktoken:<encoding>` or `tiktoken:/path/file.tiktoken`: one of OpenAI's published encodings (e.g.
  `o200k_base` for GPT-4o, `cl100k_base` for GPT-4) through the `tiktoken` library (tokenizers extra),
  applied to the request rendered as text. Nothing is downloaded: the encoding file is read from the path
  given, else from `$TOOLQUAKE_CACHE/tiktoken/<encoding>.tiktoken` (`make tiktoken-files` puts OpenAI's
  files there), tiktoken's own cache, or the copies the `litellm` package ships; every file is checked
  against the SHA-256 that tiktoken itself publishes for that encoding (see `tiktoken_encoding`);
- `auto`: `upstream` when the backend answers a probe count (vLLM, llama.cpp, the embedded backend), else
  `estimate` with a warning logged and `fallback` set on the counter saying why (replay's default: seed
  003's budgets are meant in the model's own tokens).

Every counter says which source it is (`source`, a short kind for metric labels) and what exactly it
counts with (`label`, e.g. `tiktoken:o200k_base`, for reports), and carries a `key` that names it exactly
(used to cache counts of pool tools). `count_tool` is the cost of one more tool in a request's `tools`
list; for the estimate it is exact (the estimate is additive over JSON), for the other sources it is the
tokenizer's count of the tool's JSON, and callers that need an exact total check it with `count_request`.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol

import msgspec

_encode = msgspec.json.encode


class TokenCountError(RuntimeError):
    """The configured source could not count (backend without a tokenize endpoint, bad file...)."""


class TokenCounter(Protocol):
    source: str
    key: str

    def count_text(self, text: str) -> int: ...

    def count_request(self, body: dict[str, Any]) -> int: ...

    def count_tool(self, tool: dict[str, Any]) -> int: ...


def tool_json(tool: dict[str, Any]) -> str:
    return _encode(tool).decode()


def render_request(body: dict[str, Any]) -> str:
    """A request as plain text for tokenizers without a chat template: one block per message
    (role, content, tool calls as JSON), then the tools as JSON."""
    parts: list[str] = []
    for msg in body.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        text = content if isinstance(content, str) else ("" if content is None else _encode(content).decode())
        if msg.get("tool_calls"):
            text += "\n" + _encode(msg["tool_calls"]).decode()
        parts.append(f"{msg.get('role', 'user')}\n{text}")
    tools = body.get("tools") or []
    if tools:
        parts.append("tools\n" + _encode(tools).decode())
    return "\n\n".join(parts)


# chat templates wrap each message in a few special tokens (ChatML: `<|im_start|>role\n` … `<|im_end|>\n`)
MESSAGE_OVERHEAD = 4

# words, numbers and single punctuation marks: BPE vocabularies split text into pieces of about
# this grain; long words cost about one token per 4 characters. One match per token of the estimate: a word
# piece of 1-4 letters, a 1-3 digit group or a mark (a run of L letters holds ceil(L / 4) of them).
_TOKEN = re.compile(r"[A-Za-z]{1,4}|\d{1,3}|[^\sA-Za-z\d]")
#: characters counted per call, about (one call holds the interpreter, and with it the event loop): a text is
#: cut only before a space or a mark, where no piece continues, so the count is the same
_COUNT_SLICE = 8 * 1024
_CUT = re.compile(r"[^A-Za-z\d]")


class EstimateCounter:
    """A documented local estimate: one token per word piece of at most 4 letters, per 1-3 digit
    group, and per punctuation mark; whitespace is free. It over-counts: measured against
    SmolLM2-135M's BPE tokenizer (llama.cpp, 300 random BFCL cases), 1.17x on user queries and 1.50x
    on OpenAI tool JSON (real tokenizers merge `": "`, `"}` and the like into one token). Budgets
    reached with it are therefore smaller in real tokens; use `upstream` or `tokenizer:` when the
    exact figure matters.

    The estimate of a request is that of the JSON of `[messages, tools]`; since JSON objects are
    delimited by punctuation, it is additive: one more tool costs `count_tool(tool)` exactly."""

    source = "estimate"
    key = label = "estimate"
    #: why this estimate stands in for the backend's tokenizer (token_counter 'auto'), else None
    fallback: str | None = None

    def count_text(self, text: str) -> int:
        total = start = 0
        while len(text) - start > _COUNT_SLICE and (cut := _CUT.search(text, start + _COUNT_SLICE)) is not None:
            total += len(_TOKEN.findall(text, start, cut.start()))
            start = cut.start()
        return total + len(_TOKEN.findall(text, start))

    def count_request(self, body: dict[str, Any]) -> int:
        parts = [body.get("messages") or [], body.get("tools") or []]
        return self.count_text(_encode(parts).decode())

    def count_tool(self, tool: dict[str, Any]) -> int:
        # the tool's JSON plus the comma that separates it from its neighbour
        return self.count_text(tool_json(tool)) + 1


class _LocalCounter:
    """A local vocabulary applied to `render_request(body)`, plus `MESSAGE_OVERHEAD` tokens per message for
    the chat template's special tokens (subclasses define `count_text`)."""

    def count_text(self, text: str) -> int:
        raise NotImplementedError

    def count_texts(self, texts: list[str]) -> list[int]:
        return [self.count_text(t) for t in texts]

    def count_request(self, body: dict[str, Any]) -> int:
        n_messages = sum(1 for m in body.get("messages") or [] if isinstance(m, dict))
        return self.count_text(render_request(body)) + MESSAGE_OVERHEAD * n_messages

    def count_tool(self, tool: dict[str, Any]) -> int:
        return self.count_text(tool_json(tool)) + 1


class TiktokenCounter(_LocalCounter):
    """One of OpenAI's encodings through `tiktoken`, from a local file (see tiktoken_files: never downloaded,
    checked against tiktoken's published hash). OpenAI renders tools in its own undisclosed layout: their JSON
    stands in for it, so counts are the model's vocabulary over an approximate layout. Special-token text in
    a request (`<|endoftext|>`) is counted as plain text, never as a control token."""

    source = "tiktoken"

    def __init__(self, spec: str) -> None:
        from toolquake.perturbers.helpers.tiktoken_files import load

        self._enc, self.encoding, self.path = load(spec)
        self.key = self.label = f"tiktoken:{self.encoding}"

    def count_text(self, text: str) -> int:
        return len(self._enc.encode_ordinary(text))

    def count_texts(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._enc.encode_ordinary_batch(texts)]


class TokenizerCounter(_LocalCounter):
    """A local `tokenizer.json` (the model's own vocabulary) applied to `render_request(body)`, plus
    `MESSAGE_OVERHEAD` tokens per message for the chat template's special tokens."""

    source = "tokenizer"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"token_counter: tokenizer file not found: {p}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("token_counter 'tokenizer:' needs the `tokenizers` package: "
                             "pip install 'toolquake[tokenizers]' (or pip install tokenizers)") from None
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise ValueError(f"token_counter: cannot load {p}: {exc}") from None
        # a tokenizer with max-length truncation would cap every count: counting needs the full length
        self._tok.no_truncation()
        self._tok.no_padding()
        digest = hashlib.blake2b(p.read_bytes(), digest_size=6).hexdigest()
        self.path = p
        self.key = f"tokenizer:{digest}"
        self.label = f"tokenizer:{p}"

    def count_text(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def count_texts(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]


class UpstreamCounter:
    """The backend's tokenizer over HTTP (synchronous: perturbers that count are `blocking` and run
    in a worker thread). vLLM's `/tokenize` is tried first; when the backend does not serve it, llama.cpp's
    `/extras/tokenize/count`; the first that works is remembered."""

    source = "upstream"

    def __init__(self, upstream: str, *, timeout: float = 30.0, model: str | None = None) -> None:
        import httpx

        base = upstream.rstrip("/")
        self.root = base[: -len("/v1")] if base.endswith("/v1") else base
        self.key = f"upstream:{self.root}"
        self.label = "upstream"
        #: the model named in the last counted request (vLLM and llama.cpp accept none for their only model)
        self.model = model
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self._mode: str | None = None
        self._lock = threading.Lock()

    def _post(self, path: str, payload: dict[str, Any]) -> int | None:
        """The count, or None when this endpoint is not there (404/405/501); errors otherwise."""
        import httpx

        try:
            r = self._client.post(f"{self.root}{path}", content=_encode(payload),
                                  headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise TokenCountError(f"token_counter 'upstream': {self.root}{path} unreachable "
                                  f"({type(exc).__name__})") from None
        if r.status_code in (404, 405, 501):
            return None
        if r.status_code != 200:
            raise TokenCountError(f"token_counter 'upstream': {path} answered {r.status_code}: {r.text[:200]}")
        try:
            count = msgspec.json.decode(r.content).get("count")
        except (msgspec.DecodeError, AttributeError):
            count = None
        if not isinstance(count, int):
            raise TokenCountError(f"token_counter 'upstream': {path} did not return a count")
        return count

    def _count(self, vllm: dict[str, Any], llamacpp: dict[str, Any]) -> int:
        model = vllm.get("model") or self.model
        if model:
            vllm["model"] = llamacpp["model"] = model
        if self._mode in (None, "vllm"):
            n = self._post("/tokenize", vllm)
            if n is not None:
                self._mode = "vllm"
                return n
        if self._mode in (None, "llamacpp"):
            n = self._post("/extras/tokenize/count", llamacpp)
            if n is not None:
                self._mode = "llamacpp"
                return n
        raise TokenCountError(f"token_counter 'upstream': {self.root} serves neither /tokenize (vLLM) nor "
                              "/extras/tokenize/count (llama.cpp); use token_counter = 'estimate' or "
                              "'tokenizer:/path/tokenizer.json'")

    def count_text(self, text: str) -> int:
        return self._count({"prompt": text, "add_special_tokens": False}, {"input": text})

    def count_request(self, body: dict[str, Any]) -> int:
        if body.get("model"):
            self.model = body["model"]
        vllm: dict[str, Any] = {"messages": body.get("messages") or []}
        if body.get("tools"):
            vllm["tools"] = body["tools"]
        n_messages = len(body.get("messages") or [])
        n = self._count(vllm, {"input": render_request(body)})
        # the llama.cpp fallback counts plain text: add what its chat template would add
        return n + (MESSAGE_OVERHEAD * n_messages if self._mode == "llamacpp" else 0)

    def count_tool(self, tool: dict[str, Any]) -> int:
        return self.count_text(tool_json(tool)) + 1

    def close(self) -> None:
        self._client.close()


def auto_counter(upstream: str) -> TokenCounter:
    """The backend's tokenizer when it answers a probe count, else the estimate, loudly: a warning is logged
    and the returned counter's `fallback` says why (callers print it; reports name `source`)."""
    counter = UpstreamCounter(upstream)
    try:
        counter.count_text("probe")
        return counter
    except TokenCountError as exc:
        counter.close()
        import logging

        estimate = EstimateCounter()
        estimate.fallback = (f"the backend at {upstream} offers no tokenizer ({exc}); token budgets are counted "
                             "with the estimate, which over-counts real tokens 1.17-1.5x")
        logging.getLogger("toolquake.tokens").warning("token_counter auto: %s", estimate.fallback)
        return estimate


def make_counter(spec: str, upstream: str | None = None) -> TokenCounter:
    """The counter named by `[server] token_counter`: 'estimate', 'upstream' (needs `upstream`, the
    backend's API base URL), 'auto' (upstream when the backend can count, else the estimate),
    'tiktoken:<encoding or /path/file.tiktoken>' or 'tokenizer:/path/tokenizer.json'."""
    if spec == "estimate":
        return EstimateCounter()
    if spec == "auto":
        if not upstream:
            raise ValueError("token_counter 'auto' needs the upstream URL ([server] upstream)")
        return auto_counter(upstream)
    if spec == "upstream":
        if not upstream:
            raise ValueError("token_counter 'upstream' needs the upstream URL ([server] upstream)")
        return UpstreamCounter(upstream)
    if spec.startswith("tokenizer:"):
        return TokenizerCounter(spec[len("tokenizer:"):])
    if spec.startswith("tiktoken:"):
        return TiktokenCounter(spec[len("tiktoken:"):])
    raise ValueError(f"unknown token_counter {spec!r} (use 'estimate', 'upstream', 'auto', "
                     "'tiktoken:<encoding or /path/file.tiktoken>' or 'tokenizer:/path/tokenizer.json')")


def counter_label(counter: Any) -> str:
    """What a counter counts with, for reports (`tiktoken:o200k_base`, `upstream`, `estimate`...)."""
    return str(getattr(counter, "label", None) or getattr(counter, "source", "unknown"))
