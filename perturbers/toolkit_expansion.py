"""toolkit_expansion: adds `k` tools related to, but not equivalent to, the request's tools (seed 001 §2.2)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from typing import TYPE_CHECKING, Any, ClassVar

from toolquake.bfcl.embeddings import signature
from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, NumericAxis, PerturbContext, Perturber, Services
from toolquake.perturbers.helpers.generator import DiskCache, generator, toolquake_cache
from toolquake.perturbers.helpers.tokens import counter_label
from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool, get_shared_embedder, tool_name
from toolquake.perturbers.helpers.toolkit.twins import twin_flags

if TYPE_CHECKING:
    import numpy as np

    from toolquake.bfcl.embeddings import Embedder

SOURCES = ("retrieval", "generate", "auto")
#: where `generator_url` / `generator_model` come from when a profile leaves them empty
ENV_GENERATOR_URL = "TOOLQUAKE_GENERATOR_URL"
ENV_GENERATOR_MODEL = "TOOLQUAKE_GENERATOR_MODEL"
# bump when a prompt or the request parameters change: cached generations are keyed by it
PROMPT_VERSION = "seed001-7.2/v1"

# seed 001, appendix 7.2: the prompt for "closely related but different" requests, with its example
VARIANT_PROMPT = (
    "You are a helpful assistant introduced with the following user query. Create a very similar query that "
    "refers to a very similar user need and is likely to be implemented in an enterprise as part of the same "
    "project. The new query should introduce one or two additional distinct parameter types. It should differ "
    "from the original query in a sense that a function that can be used to fulfill the original query is not "
    "fully appropriate for the new one and vise versa. As an example, generating 'Book a single room for two "
    "nights at the Hilton Hotel in Chicago' per the original query 'Book a double room for three nights at the "
    "Marriott hotel near OHare Airport in Chicago', is not sufficient since both queries can be answered using "
    "the same function call, invoked with different parameters. The query should contain all information needed "
    "for its computation. For instance, 'What is the capital of Brazil?' is a good query, while 'What is the "
    "capital of a country provided by user?' is not since one cannot generate a function call and populate its "
    "arguments using the info in the query alone. Output the newly generated query only, without explanation or "
    "interpretation. Consider the examples below:")
VARIANT_EXAMPLE = ("I need the schedules of matches happening on February 28, 2024.",
                   "I need the schedules of the college league matches happening during the winter 2024 season.")
# step 2 (seed 001 §2.2 (2)): a definition for each new request, in the style of the originals
TOOL_PROMPT = (
    "You write function definitions for a function-calling API. Given a user request, write ONE function "
    "definition that an assistant could call to fulfil exactly that request. Follow the example definitions: "
    "the same JSON format, the same naming conventions, the same style and level of detail in the function and "
    "parameter descriptions. Output only the JSON object of the new function, without explanation.")


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


@register
class ToolkitExpansion(Perturber):
    """Adds `k` tools that are related but not equivalent to the request's tools, at random positions:
    retrieved from the tool pool (`source="retrieval"`: drawn from the `band` of relatedness) or written by
    a generator model (`source="generate"`, seed 001's two-step pipeline, cached by request); `"auto"`
    generates when a generator is configured (`generator_url` or $TOOLQUAKE_GENERATOR_URL) and retrieves
    otherwise. A candidate whose signature has cosine ≥ `max_similarity` to an original tool, that does
    the same job as one (helpers/toolkit/twins.py), or whose name is already present, is skipped."""

    name = "toolkit_expansion"
    experiment = "related_tools"
    #: retrieval draws the candidates in one seeded order and inserts each at a seeded position in turn, so the
    #: tools added for k + 1 are those for k plus one (generated tools are cached per k: not swept)
    numeric_axes: ClassVar[dict[str, NumericAxis]] = {
        "related": NumericAxis("k", "related tools added", low=1, default_min=0, default_max=20,
                               fixed={"source": "retrieval"}),
    }
    blocking: ClassVar[bool] = True  # embeddings on CPU, and the generator's HTTP calls
    #: a host to send prompts to, a directory to write to, an environment variable to send as a key: the operator's
    operator_only: ClassVar[frozenset[str]] = frozenset({"generator_url", "cache_dir", "api_key_env"})
    k: int = 3
    source: str = "retrieval"
    max_similarity: float = 0.8
    #: retrieval: the cosine (to the nearest original's signature) of the tools drawn, [low, high)
    band: tuple[float, float] = (0.5, 0.75)
    #: source="generate": the generator's OpenAI API base URL, e.g. http://127.0.0.1:8000/v1;
    #: empty: $TOOLQUAKE_GENERATOR_URL
    generator_url: str = ""
    #: the generator's model name; empty: $TOOLQUAKE_GENERATOR_MODEL, else the model the request names
    generator_model: str = ""
    #: the cache of generated tools (share it between replicas); empty: $TOOLQUAKE_CACHE/generated_tools
    cache_dir: str = ""
    #: seconds per generator call
    timeout_s: float = 120.0
    #: environment variable holding the generator's API key (sent as a Bearer token when set)
    api_key_env: str = "TOOLQUAKE_GENERATOR_API_KEY"

    def __post_init__(self) -> None:
        # resolved when the profile is built, so that the arm's recorded parameters say what was used
        self.generator_url = self.generator_url or os.environ.get(ENV_GENERATOR_URL, "")
        self.generator_model = self.generator_model or os.environ.get(ENV_GENERATOR_MODEL, "")
        if self.source == "auto":
            self.source = "generate" if self.generator_url else "retrieval"
        if self.k < 1:
            raise ValueError("k must be at least 1")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}")
        if not 0.0 < self.max_similarity <= 1.0:
            raise ValueError("max_similarity must be in (0, 1]")
        if len(self.band) != 2 or not 0.0 <= self.band[0] < self.band[1] <= self.max_similarity:
            raise ValueError("band must be [low, high] with 0 <= low < high <= max_similarity")
        if self.source == "generate" and not self.generator_url.startswith(("http://", "https://")):
            raise ValueError("source='generate' needs generator_url (or $TOOLQUAKE_GENERATOR_URL), the "
                             "generator's OpenAI API base URL (e.g. http://127.0.0.1:8000/v1)")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def generates_text(self) -> bool:
        return self.source == "generate"

    def setup(self, services: Services) -> None:
        get_shared_embedder(services)  # the embedding model (and, for retrieval, the pool) loaded once
        if self.source == "retrieval":
            get_pool(services)

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        originals = list(request.tools)
        if not originals:
            ctx.report["skipped"] = "no tools"
            return request
        embedder = get_shared_embedder(ctx.services)
        user = last_user_text(request.messages)
        if self.source == "retrieval":
            added, sims = self._retrieve(originals, user, ctx, embedder)
        else:
            added, sims = self._generated(request, user, ctx, embedder)
        tools = list(originals)
        for tool in added:
            tools.insert(ctx.rng.randint(0, len(tools)), tool)
        names = {tool_name(t) for t in added}
        counter = ctx.services.token_counter
        ctx.report.update({
            "source": self.source, "added": [tool_name(t) for t in added],
            "positions": [i for i, t in enumerate(tools) if tool_name(t) in names],
            "max_cosine_to_original": [round(s, 4) for s in sims],
            "tools_before": len(originals), "tools_after": len(tools),
        })
        if counter is not None and added:
            ctx.report["token_counter"] = counter_label(counter)
            try:
                ctx.report["tokens_added"] = sum(counter.count_tool(t) for t in added)
            except Exception:  # a count is a report, not part of the perturbation: never fail for it
                ctx.report["tokens_added"] = None
        return request.replace(tools=tools) if added else request

    # -- retrieval -------------------------------------------------------------------------------

    def _retrieve(self, originals: list[dict[str, Any]], user: str, ctx: PerturbContext,
                  embedder: Embedder) -> tuple[list[dict[str, Any]], list[float]]:
        """Pool tools drawn at random from the band of relatedness (cosine to the nearest original's
        signature in `band`), then, when the band runs short, the nearest ones below it; never an
        equivalent or a twin of an original, a name already present, or a near-copy of one already chosen.
        The draw is seeded by the request's tools and user message: the same request gets the same tools."""
        import numpy as np

        pool = get_pool(ctx.services)
        orig = pool.embed_tools(originals, embedder)
        to_orig = (pool.embeddings @ orig.T).max(axis=1)
        excluded = pool.excluded(originals, orig, self.max_similarity)
        low, high = self.band
        in_band = np.flatnonzero(~excluded & (to_orig >= low) & (to_orig < high))
        below = np.flatnonzero(~excluded & (to_orig < low))
        draw = random.Random(request_key(originals, user))
        order = [int(j) for j in in_band]
        draw.shuffle(order)
        order += [int(j) for j in below[np.argsort(-to_orig[below], kind="stable")]]
        chosen: list[int] = []
        twins = 0
        for start in range(0, len(order), 4 * self.k):  # twins are judged in small batches, as far as needed
            batch = order[start:start + 4 * self.k]
            flags = twin_flags([pool.tools[j] for j in batch], originals, embedder)
            for j, twin in zip(batch, flags):
                if len(chosen) == self.k:
                    break
                if twin:
                    twins += 1
                    continue
                if chosen and float((pool.embeddings[chosen] @ pool.embeddings[j]).max()) >= self.max_similarity:
                    continue
                chosen.append(j)
            if len(chosen) == self.k:
                break
        ctx.report.update({"band": [low, high], "band_candidates": int(in_band.size), "twins_skipped": twins,
                           "below_band": sum(1 for j in chosen if to_orig[j] < low)})
        return [pool.tools[j] for j in chosen], [float(to_orig[j]) for j in chosen]

    # -- generation ------------------------------------------------------------------------------

    def _generated(self, request: ChatRequest, user: str, ctx: PerturbContext,
                   embedder: Embedder) -> tuple[list[dict[str, Any]], list[float]]:
        """Generated tools for this request: from the cache when this request was expanded before,
        else from the generator (then cached); filtered like retrieved ones either way."""
        if not user.strip():
            raise ValueError("source='generate' needs a user message to vary")
        originals = list(request.tools)
        model = self.generator_model or request.model
        if not model:
            raise ValueError("no generator_model and the request names no model")
        orig = embedder.embed([signature(t) for t in originals])
        present = {tool_name(t) for t in originals}
        cache = DiskCache(self.cache_dir or toolquake_cache() / "generated_tools")
        key = cache.key(PROMPT_VERSION, model, self.k, originals, user)
        entry = cache.get(key)
        ctx.report["cached"] = entry is not None
        if entry is None:
            client = generator(ctx.services, self.generator_url, self.timeout_s)
            api_key = os.environ.get(self.api_key_env) or None
            candidates: list[dict[str, Any]] = []
            variants: list[str] = []
            for attempt in range(2 * self.k + 1):
                variant = first_line(client.chat(model, variant_prompt(user, variants), api_key=api_key,
                                                 temperature=0.7, seed=attempt, max_tokens=200))
                if not variant or variant in variants or variant == user.strip():
                    continue
                variants.append(variant)
                tool = parse_tool(client.chat(model, tool_prompt(originals, variant), api_key=api_key,
                                              temperature=0.2, seed=attempt, max_tokens=800))
                if tool is None:
                    continue
                candidates.append({"request": variant, "tool": tool})
                if len(self._select(candidates, originals, orig, present, embedder)[0]) == self.k:
                    break
            entry = {"version": PROMPT_VERSION, "model": model, "original": user, "candidates": candidates}
            cache.put(key, entry)
        return self._select(entry["candidates"], originals, orig, present, embedder)

    def _select(self, candidates: list[dict[str, Any]], originals: list[dict[str, Any]], orig: np.ndarray,
                present: set[str], embedder: Embedder) -> tuple[list[dict[str, Any]], list[float]]:
        """The first `k` candidates that are neither equivalent to an original (signature cosine or twin) nor
        named like a present tool."""
        chosen: list[dict[str, Any]] = []
        sims: list[float] = []
        names = set(present)
        tools = [c["tool"] for c in candidates]
        twins = twin_flags(tools, originals, embedder)
        for tool, twin in zip(tools, twins):
            if len(chosen) == self.k or twin or tool_name(tool) in names:
                continue
            sim = float((orig @ embedder.embed([signature(tool)])[0]).max())
            if sim >= self.max_similarity:
                continue
            chosen.append(tool)
            sims.append(sim)
            names.add(tool_name(tool))
        return chosen, sims


def request_key(originals: list[dict[str, Any]], user: str) -> int:
    """A seed from the request's tool names and user message (not its perturbation seed): every arm and every
    model that sends this request gets the same tools."""
    text = json.dumps([sorted(tool_name(t) for t in originals), user])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def variant_prompt(user: str, earlier: list[str]) -> list[dict[str, str]]:
    """Step 1 (seed 001 §7.2): a closely related but different request; earlier answers are listed
    so that each attempt asks for a new one."""
    query = user
    if earlier:
        query += "\n\nAlready written (write a different one):\n" + "\n".join(f"- {v}" for v in earlier)
    return [{"role": "system", "content": VARIANT_PROMPT},
            {"role": "user", "content": VARIANT_EXAMPLE[0]},
            {"role": "assistant", "content": VARIANT_EXAMPLE[1]},
            {"role": "user", "content": query}]


def tool_prompt(originals: list[dict[str, Any]], variant: str) -> list[dict[str, str]]:
    """Step 2: one definition for the new request, the request's own tools as the style examples."""
    examples = json.dumps([t.get("function", t) for t in originals], indent=2)
    return [{"role": "system", "content": TOOL_PROMPT},
            {"role": "user", "content": f"Example function definitions:\n{examples}\n\n"
                                        f"Request: {variant}\nFunction definition:"}]


def first_line(answer: str) -> str:
    lines = [ln.strip().strip('"').strip() for ln in answer.strip().splitlines()]
    return next((ln for ln in lines if ln), "")


_FENCE = re.compile(r"```(?:json)?")


def parse_tool(text: str) -> dict[str, Any] | None:
    """The first JSON object in a generator's answer as an OpenAI tool, or None when there is none
    usable (no name). Accepts a bare function definition or an OpenAI tool, BFCL or JSON-schema types."""
    from toolquake.bfcl.convert import to_openai_tools

    text = _FENCE.sub("", text)
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        props = {str(k): (v if isinstance(v, dict) else {"type": "string"}) for k, v in props.items()}
        required = [r for r in params.get("required") or [] if isinstance(r, str) and r in props]
        doc = {"name": re.sub(r"[^A-Za-z0-9_.-]", "_", name.strip())[:64],
               "description": str(fn.get("description") or ""),
               "parameters": {"type": "dict", "properties": props, "required": required}}
        tools, _ = to_openai_tools([doc])
        return tools[0]
    return None
