"""tool_search: keeps the `k` tools most related to the conversation, the tools it already called always.

Relatedness is that of each tool's signature (`bfcl.embeddings.signature`: name, description, parameters) to the
conversation's query: the last user message first, then the text of the recent `turns` turns (each message cut
short, the whole bounded). `method = "bm25"` scores the signatures with a lexical BM25 (`_lexical`) against the
whole query, each signature's term statistics kept in an LRU keyed by signature, bounded in bytes.
`method = "embeddings"` takes the cosine of the signature's sentence embedding (all-MiniLM-L6-v2, the embedding
every other step uses: the tool pool's row when the pool is loaded in this process and holds that tool, else
embedded once and kept like the statistics) to the embedding of the last user message — its first QUERY_TOKENS
tokens, by the model's int8 copy (`Embedder.embed_query`), kept in an LRU keyed by the digest of what was embedded
(an agent's steps within a turn repeat the last user message: only the turn's first step pays for the model) —
and adds TURNS_WEIGHT times the BM25 of the recent turns' text and of what the model does not read of a long last
user message (scaled to the best tool's): the turns change every step, and a model pass over them would cost each
step 10 ms and more. `"auto"` (the default) uses embeddings when the embeddings extra is installed, else BM25.

Kept, in the request's order: every tool an assistant message of the conversation already called (its agent may
call it again), the tool `tool_choice` names (in one of the k places), then the best-scoring others until k places
are taken — never more than k + the tools already called. A request with no more tools than that is left as it
came. Reported (`ctx.report`): `kept`, `dropped` (names of the tools left out), `k`, `method` (what was used).
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from toolquake.bfcl.embeddings import CHARS_PER_TOKEN, signature
from toolquake.bfcl.lru import ByteLRU, text_bytes
from toolquake.perturbers.format_rewrite import _forced_name
from toolquake.perturbers.helpers.toolkit.tool_pool import SERVICE as POOL_SERVICE
from toolquake.perturbers.helpers.toolkit.tool_pool import get_shared_embedder, tool_name
from toolquake.perturbers.toolkit_expansion import last_user_text
from toolquake.remedies import register
from toolquake.remedies._lexical import Doc, Index, scores, terms
from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy, Services

METHODS = ("auto", "embeddings", "bm25")
#: characters of one earlier message that go into the query, and of the whole query
MESSAGE_CHARS = 500
QUERY_CHARS = 2000
#: the tokens of the last user message the model reads (its cost grows with them: ~3 ms at 3 tokens, ~5 at 32)
QUERY_TOKENS = 32
#: characters of English prose per token, about: a last user message's text past QUERY_TOKENS of them joins the
#: recent turns' lexical part (the model does not read it)
PROSE_CHARS_PER_TOKEN = 4
#: the weight of the recent turns' BM25 (scaled: the best tool's 1) beside the last user message's cosine
TURNS_WEIGHT = 0.25
#: the query embeddings kept (16-byte digest and 384 float32 each: about 2 KB), per process, in bytes
QUERY_CACHE_BYTES = 2 << 20
#: each of its four caches (signature → term statistics or vector, toolkit → index or matrix), per process, in bytes
CACHE_BYTES = 16 << 20
_EMBEDDER = "tool_search:embedder"
_VECTORS = "tool_search:vectors"
_DOCS = "tool_search:docs"
_TOOLKITS = "tool_search:toolkits"
_MATRICES = "tool_search:matrices"
_QUERIES = "tool_search:queries"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def query_text(messages: list[Any], turns: int) -> str:
    """The last user message, then the other messages of the last `turns` turns (a turn opens at a user message),
    newest first: their text and the names and arguments of the calls they hold, each cut to MESSAGE_CHARS; the
    whole cut to QUERY_CHARS."""
    return " ".join(query_parts(messages, turns))[:QUERY_CHARS]


def query_parts(messages: list[Any], turns: int) -> list[str]:
    """`query_text`'s parts: the last user message first, then each other message's text, these together bounded
    on their own (a long last user message leaves the recent turns their own QUERY_CHARS)."""
    messages = [m for m in messages if isinstance(m, dict)]
    parts = [last_user_text(messages)[:QUERY_CHARS]]
    size = 0
    seen_users = 0
    last_user_skipped = False
    for msg in reversed(messages):
        if size >= QUERY_CHARS:
            break
        role = msg.get("role")
        if role == "user":
            seen_users += 1
            if not last_user_skipped:  # the last user message is already first
                last_user_skipped = True
                continue
            if seen_users > turns:
                break
        text = _text(msg.get("content"))
        calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                text += f" {fn.get('name', '')} {str(fn.get('arguments', ''))[:MESSAGE_CHARS]}"
        text = text.strip()[:MESSAGE_CHARS]
        if text:
            parts.append(text)
            size += len(text) + 1
    return parts


def _toolkit_key(signatures: list[str]) -> bytes:
    """A toolkit's cache key: the digest of its signatures in order (not the signatures: 200 KB at 500 tools)."""
    digest = hashlib.blake2b(digest_size=16)
    for sig in signatures:  # each length first: no two toolkits give the same bytes
        data = sig.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def _signature(tool: Any) -> str:
    """The tool's signature; for a tool of another shape (a client's odd JSON), its name alone or nothing."""
    try:
        return signature(tool)
    except (AttributeError, TypeError):
        return tool_name(tool) if isinstance(tool, dict) else ""


def called_names(messages: list[Any]) -> set[str]:
    """Names of the tools the assistant messages of the conversation called."""
    names: set[str] = set()
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") != "assistant" or not isinstance(msg.get("tool_calls"), list):
            continue
        for call in msg["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                names.add(fn["name"])
    return names


def _available_embedder(services: Services) -> Any:
    """The shared embedder, or None when the embeddings extra is not installed (asked once per process)."""
    from toolquake.bfcl.embeddings import EmbeddingsUnavailable

    def probe() -> Any:
        try:
            return get_shared_embedder(services)
        except EmbeddingsUnavailable:
            return None

    return services.get(_EMBEDDER, probe)


@register
class ToolSearch(Remedy):
    """The k tools most related to the conversation, plus those it already called; the rest left out."""

    name = "tool_search"
    blocking: ClassVar[bool] = True  # the query's embedding is CPU work
    k: int = 8
    #: "embeddings", "bm25", or "auto": embeddings when the embeddings extra is installed, else BM25
    method: str = "auto"
    #: the recent turns whose text joins the last user message in the query (1: the current turn only)
    turns: int = 2

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("k must be at least 1")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)} (got {self.method!r})")
        if self.turns < 1:
            raise ValueError("turns must be at least 1")

    def setup(self, services: Services) -> None:
        if self.method == "embeddings":
            get_shared_embedder(services)  # EmbeddingsUnavailable names the extra to install
        elif self.method == "auto":
            _available_embedder(services)

    def dropped_tools(self, report: dict[str, Any]) -> list[str]:
        return list(report.get("dropped") or [])

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        tools = request.tools if isinstance(request.body.get("tools"), list) else []
        messages = request.messages if isinstance(request.body.get("messages"), list) else []
        called = called_names(messages)
        names = [tool_name(t) for t in tools]
        must = [i for i, n in enumerate(names) if n and n in called]
        embedder = self._embedder(ctx.services)
        ctx.report.update(k=self.k, method="bm25" if embedder is None else "embeddings")
        if len(tools) <= self.k + len(must):
            ctx.report.update(kept=len(tools), dropped=[])
            return request
        keep = set(must)
        slots = self.k
        forced = _forced_name(request.body.get("tool_choice"))
        if forced is not None and forced not in called:
            named = next((i for i, n in enumerate(names) if n == forced), None)
            if named is not None:
                keep.add(named)
                slots -= 1
        parts = query_parts(messages, self.turns)
        signatures = [_signature(t) for t in tools]
        if embedder is None:
            scores = self._bm25(signatures, " ".join(parts)[:QUERY_CHARS], ctx)
        else:
            recent = " ".join(parts[1:])[:QUERY_CHARS]
            scores = self._cosines(tools, signatures, parts[0] if parts[0].strip() else recent, embedder, ctx)
            # the recent turns, and what the model does not read of a long last user message, lexically
            rest = " ".join([parts[0][QUERY_TOKENS * PROSE_CHARS_PER_TOKEN:], *parts[1:]])[:QUERY_CHARS]
            if rest.strip():
                lexical = self._bm25(signatures, rest, ctx)
                top = max(lexical)
                if top > 0:
                    scores = [c + TURNS_WEIGHT * b / top for c, b in zip(scores, lexical)]
        ranked = sorted((i for i in range(len(tools)) if i not in keep), key=lambda i: -scores[i])
        keep.update(ranked[:max(0, slots)])
        ctx.report.update(kept=len(keep),
                          dropped=[names[i] for i in range(len(tools)) if i not in keep])
        return request.replace(tools=[tools[i] for i in range(len(tools)) if i in keep])

    def _embedder(self, services: Services) -> Any:
        """The embedder this search scores with, or None for BM25 (`auto` without the embeddings extra)."""
        if self.method == "embeddings":
            return get_shared_embedder(services)
        return _available_embedder(services) if self.method == "auto" else None

    @staticmethod
    def _bm25(signatures: list[str], query: str, ctx: PerturbContext) -> list[float]:
        """BM25 of each signature for the query. A toolkit seen before (an agent sends the same tools every turn)
        gets an index, kept and reused whole; a toolkit seen once (a padded catalog, new for each case) is scored
        doc by doc, cheaper than indexing it. Each signature's statistics are kept either way."""
        toolkits: ByteLRU[bytes, Any] = ctx.services.get(_TOOLKITS, lambda: ByteLRU(max_bytes=CACHE_BYTES))
        key = _toolkit_key(signatures)
        index = toolkits.get(key)
        if isinstance(index, Index):
            return index.scores(terms(query))
        cache: ByteLRU[str, Doc] = ctx.services.get(_DOCS, lambda: ByteLRU(max_bytes=CACHE_BYTES))
        docs = []
        for sig in signatures:
            doc = cache.get(sig)
            if doc is None:
                doc = Doc.of(sig)
                cache.put(sig, doc, text_bytes(sig) + doc.nbytes())
            docs.append(doc)
        if index is None:  # seen once: remembered by its digest alone
            toolkits.put(key, True, len(key))
            return scores(docs, terms(query))
        index = Index(docs)
        toolkits.put(key, index, len(key) + index.nbytes())
        return index.scores(terms(query))

    @staticmethod
    def _cosines(tools: list[Any], signatures: list[str], query: str, embedder: Any,
                 ctx: PerturbContext) -> list[float]:
        """Cosine of each signature's embedding to the query's (`_query_vector`): the matrix of a toolkit seen before
        is reused whole, else each tool's vector comes from the cache, the pool, or the model (then kept)."""
        import numpy as np

        toolkits: ByteLRU[bytes, Any] = ctx.services.get(_MATRICES, lambda: ByteLRU(max_bytes=CACHE_BYTES))
        key = _toolkit_key(signatures)
        matrix = toolkits.get(key)
        if matrix is None:
            matrix = np.stack(ToolSearch._vectors(tools, signatures, embedder, ctx))
            toolkits.put(key, matrix, len(key) + matrix.nbytes)
        return (matrix @ ToolSearch._query_vector(query, embedder, ctx)).tolist()

    @staticmethod
    def _query_vector(query: str, embedder: Any, ctx: PerturbContext) -> Any:
        """The query's embedding (its first QUERY_TOKENS tokens, `Embedder.embed_query`), kept by the digest of the
        text embedded (cut to what those tokens can span: the digest's work is bounded too)."""
        text = query[:QUERY_TOKENS * CHARS_PER_TOKEN]
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        cache: ByteLRU[bytes, Any] = ctx.services.get(_QUERIES, lambda: ByteLRU(max_bytes=QUERY_CACHE_BYTES))
        vector = cache.get(key)
        if vector is None:
            vector = embedder.embed_query(text, max_tokens=QUERY_TOKENS)
            cache.put(key, vector, len(key) + vector.nbytes)
        return vector

    @staticmethod
    def _vectors(tools: list[Any], signatures: list[str], embedder: Any, ctx: PerturbContext) -> list[Any]:
        cache: ByteLRU[str, Any] = ctx.services.get(_VECTORS, lambda: ByteLRU(max_bytes=CACHE_BYTES))
        pool = ctx.services.extra.get(POOL_SERVICE)  # reused when a perturber of this process loaded it
        vectors: list[Any] = [cache.get(sig) for sig in signatures]
        missing = [i for i, v in enumerate(vectors) if v is None]
        if pool is not None and missing:
            left = []
            for i in missing:
                j = pool.index.get(tool_name(tools[i])) if isinstance(tools[i], dict) else None
                if j is not None and signature(pool.tools[j]) == signatures[i]:
                    vectors[i] = pool.embeddings[j]
                    cache.put(signatures[i], vectors[i], text_bytes(signatures[i]) + vectors[i].nbytes)
                else:
                    left.append(i)
            missing = left
        if missing:
            found = embedder.embed([signatures[i] for i in missing])
            for row, i in enumerate(missing):
                vectors[i] = found[row].copy()  # a row of its own: a view would keep the whole batch alive
                cache.put(signatures[i], vectors[i], text_bytes(signatures[i]) + vectors[i].nbytes)
        return vectors
