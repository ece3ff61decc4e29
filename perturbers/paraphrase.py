"""paraphrase: the last user message rephrased by a generator model, kept only if its values are exactly the same
(or, with `rejected = "send"`, sent anyway and labelled: the drop over all cases, as seed 001's Table 2 gives it)."""

from __future__ import annotations

import os
from typing import ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import NOT_PERTURBED, ChatRequest, PerturbContext, Perturber
from toolquake.perturbers.helpers.generator import DiskCache, generator, toolquake_cache
from toolquake.perturbers.helpers.protected import added_numbers, missing_from

# seed 001, appendix 7.1: the prompt for strictly meaning-preserving request rephrasing
SYSTEM_PROMPT = (
    "You are a helpful assistant helping rephrasing user requests, while accurately preserving their meaning, "
    "including numbers and names if exist. Do not answer the requirement, just produce another one that is "
    "identical in meaning but is phrased differently. Produce ONLY the rephrased requirement, without further "
    "thoughts or explanations. Consider the example below:"
)
EXAMPLE_REQUEST = ("Can I find the dimensions and properties of a triangle, if it is known that its three sides "
                   "are 5 units, 4 units and 3 units long?")
EXAMPLE_REPHRASING = "What are the dimensions and properties of a triangle whose three sides are 5, 4 and 3 units long?"
# bump when the prompt or the request parameters change: cached answers are keyed by it
PROMPT_VERSION = "seed001-7.1/v1"
#: the rephraser when a profile names none: $TOOLQUAKE_GENERATOR_URL / $TOOLQUAKE_GENERATOR_MODEL (a fixed
#: model, the same text for every model compared), else the default upstream and the request's own model
ENV_GENERATOR_URL = "TOOLQUAKE_GENERATOR_URL"
ENV_GENERATOR_MODEL = "TOOLQUAKE_GENERATOR_MODEL"
DEFAULT_GENERATOR_URL = "http://127.0.0.1:8000/v1"


def prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": EXAMPLE_REQUEST},
            {"role": "assistant", "content": EXAMPLE_REPHRASING},
            {"role": "user", "content": text}]


def clean(answer: str, original: str) -> str:
    """The rephrasing without surrounding whitespace or quotes the original did not have."""
    text = answer.strip()
    for q in ('"', "“", "'"):
        close = "”" if q == "“" else q
        if len(text) > 1 and text.startswith(q) and text.endswith(close) and not original.strip().startswith(q):
            text = text[1:-1].strip()
    return text


@register
class Paraphrase(Perturber):
    """Rephrase the last user message with seed 001's prompt at temperature 0 (cached on disk); a rephrasing
    that loses or adds a value is rejected and the request reported as not perturbed — or, with `rejected =
    "send"`, sent anyway and reported `paraphrase = "rejected, sent"` (a reformatted number such as "$200,000" →
    "200K" is what the value check rejects most, and what most often breaks exact matching: leaving those out
    biases the drop down)."""

    name = "paraphrase"
    #: seed 001's rephrased query: the report's rephraser and rephrasing-drop tables read its arms
    experiment = "rephrasing"
    blocking: ClassVar[bool] = True
    #: a host to send prompts to, a directory to write to, an environment variable to send as a key: the operator's
    operator_only: ClassVar[frozenset[str]] = frozenset({"generator_url", "cache_dir", "api_key_env"})
    #: the generator's OpenAI API base URL; empty: $TOOLQUAKE_GENERATOR_URL, else http://127.0.0.1:8000/v1
    generator_url: str = ""
    #: the generator's model name; empty: $TOOLQUAKE_GENERATOR_MODEL, else the model the request names
    generator_model: str = ""
    #: the cache directory (share it between replicas); empty: $TOOLQUAKE_CACHE/paraphrase
    cache_dir: str = ""
    timeout_s: float = 60.0
    #: environment variable holding the generator's API key (sent as a Bearer token when set)
    api_key_env: str = "TOOLQUAKE_GENERATOR_API_KEY"
    #: a rephrasing the value check rejects: "keep" the original (the pair is not perturbed), or "send" it anyway
    rejected: str = "keep"

    def __post_init__(self) -> None:
        if self.rejected not in ("keep", "send"):
            raise ValueError(f"rejected must be 'keep' or 'send', got {self.rejected!r}")
        # resolved when the profile is built: the arm's recorded parameters name the rephraser used
        self.generator_url = self.generator_url or os.environ.get(ENV_GENERATOR_URL) or DEFAULT_GENERATOR_URL
        self.generator_model = self.generator_model or os.environ.get(ENV_GENERATOR_MODEL, "")
        if not self.generator_url.startswith(("http://", "https://")):
            raise ValueError(f"generator_url must be an http(s) URL, got {self.generator_url!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def generates_text(self) -> bool:
        return True

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        index = request.last_user_index()
        original = request.messages[index].get("content") if index is not None else None
        if not isinstance(original, str) or not original.strip():
            ctx.report.update(paraphrase="skipped", reason="no text in the last user message")
            ctx.report[NOT_PERTURBED] = "no text to rephrase"
            return request
        model = self.generator_model or request.model
        if not model:
            raise ValueError("no generator_model and the request names no model")
        # who rephrased: a fixed generator model, or (none configured) the model under test itself
        ctx.report["rephraser"] = model if self.generator_model else f"self:{model}"
        cache = DiskCache(self.cache_dir or toolquake_cache() / "paraphrase")
        key = cache.key(PROMPT_VERSION, model, original)
        entry = cache.get(key)
        ctx.report["cached"] = entry is not None
        if entry is None:
            answer = generator(ctx.services, self.generator_url, self.timeout_s).chat(
                model, prompt(original), api_key=os.environ.get(self.api_key_env) or None,
                temperature=0, max_tokens=64 + len(original) // 2)
            entry = {"version": PROMPT_VERSION, "model": model, "original": original, "answer": answer}
            cache.put(key, entry)
        rewritten = clean(entry["answer"], original)
        lost = missing_from(original, rewritten) + [f"new {n}" for n in added_numbers(original, rewritten)]
        if not rewritten or (lost and self.rejected == "keep"):
            ctx.report.update(paraphrase="rejected", rejected_for=lost or ["empty answer"], tokens_added=0)
            ctx.report[NOT_PERTURBED] = "rephrasing rejected"
            return request
        if lost:  # rejected by the value check, sent anyway (rejected = "send"): labelled
            ctx.report.update(paraphrase="rejected, sent", rejected_for=lost)
        if rewritten == original.strip():
            ctx.report.update(paraphrase="unchanged", tokens_added=0)
            ctx.report[NOT_PERTURBED] = "rephrasing identical to the original"
            return request
        counter = ctx.services.token_counter
        ctx.report.setdefault("paraphrase", "accepted")
        if counter is not None:
            ctx.report["tokens_added"] = counter.count_text(rewritten) - counter.count_text(original)
        messages = list(request.messages)
        messages[index] = {**messages[index], "content": rewritten}
        return request.replace(messages=messages)
