"""catalog_padding: pads the toolkit with random pool tools up to a token budget, the request's own tools at
fraction α (seed 003 §4.1)."""

from __future__ import annotations

from typing import Any, ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, NumericAxis, PerturbContext, Perturber, Services
from toolquake.perturbers.helpers.lengthening.budget import fit
from toolquake.perturbers.helpers.tokens import EstimateCounter, counter_label
from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool, get_shared_embedder, tool_name


@register
class CatalogPadding(Perturber):
    """Distractors drawn at random from the tool pool (never a tool already present, never one whose
    signature has cosine ≥ `max_similarity` to an original) until the whole request reaches
    `budget_tokens` by the configured token counter — or, with `tools` > 0, until the request holds `tools`
    tools — the original tools going, in their order, after a fraction `position` of the distractors.

    The distractors are a seeded permutation of the pool taken from its start, so a larger budget (or `tools`)
    keeps every distractor of a smaller one, in the same order, and adds more after them (`toolquake sweep`)."""

    name = "catalog_padding"
    experiment = "catalog_size"
    axes = ("budget_tokens", "position")
    numeric_axes: ClassVar[dict[str, NumericAxis]] = {
        "tools": NumericAxis("tools", "tools in the request", low=1, default_min=1, default_max=200),
        "catalog_tokens": NumericAxis("budget_tokens", "tokens in the request", default_min=1000,
                                      default_max=64000, default_step=1000),
    }
    blocking: ClassVar[bool] = True  # embeddings and (for the upstream counter) HTTP token counts
    budget_tokens: int = 32768
    position: float = 0.5
    max_similarity: float = 0.8
    #: when > 0: pad until the request holds this many tools (its own included), whatever the budget
    tools: int = 0

    def __post_init__(self) -> None:
        if self.tools < 0:
            raise ValueError("tools must be 0 (pad by budget_tokens) or positive")
        if self.budget_tokens < 1:
            raise ValueError("budget_tokens must be positive")
        if not 0.0 <= self.position <= 1.0:
            raise ValueError("position must be between 0 and 1")
        if not 0.0 < self.max_similarity <= 1.0:
            raise ValueError("max_similarity must be in (0, 1]")

    def setup(self, services: Services) -> None:
        get_shared_embedder(services)  # the pool and the model that screens out equivalent tools
        get_pool(services)

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        import numpy as np

        originals = list(request.tools)
        counter: Any = ctx.services.token_counter or EstimateCounter()
        ctx.report["token_counter"] = counter_label(counter)
        if not originals:  # no toolkit to hide: padding would turn a chat into a tool-calling request
            ctx.report["skipped"] = "no tools"
            return request
        # counted first: an upstream counter learns the request's model, which its pool costs are keyed by
        base = counter.count_request(request.body)
        pool = get_pool(ctx.services)
        embedder = get_shared_embedder(ctx.services)
        excluded = pool.excluded(originals, pool.embed_tools(originals, embedder), self.max_similarity)
        candidates = np.flatnonzero(~excluded)
        order = np.random.default_rng(ctx.rng.getrandbits(64)).permutation(candidates)

        def build(n: int) -> list[dict[str, Any]]:
            distractors = [pool.tools[i] for i in order[:n]]
            at = round(self.position * n)
            return distractors[:at] + originals + distractors[at:]

        if self.tools:
            n = min(max(0, self.tools - len(originals)), len(order))
            total = counter.count_request({**request.body, "tools": build(n)}) if n else base
        else:
            # how this counter's whole-request count compares with its per-tool costs, kept between requests
            learned = ctx.services.get(f"catalog_padding_ratio:{getattr(counter, 'key', counter.source)}", dict)
            result = fit(
                counter,
                self.budget_tokens,
                base,
                iter(pool.costs(counter)[order].tolist()),  # per-tool costs: only the budget needs them
                lambda n: counter.count_request({**request.body, "tools": build(n)}),
                learned=learned,
            )
            n, total = result.units, result.total
        at = round(self.position * n)
        ctx.report.update(
            {
                "tokens_before": base,
                "tokens_after": total,
                "tokens_added": total - base,
                "tools_before": len(originals),
                "tools_added": n,
                "tools_after": n + len(originals),
                "insert_index": at,
                "position": at / n if n else None,
                "original_tools": [tool_name(t) for t in originals],
            }
        )
        if n == 0:
            return request
        return request.replace(tools=build(n))

    def fills_token_budget(self) -> bool:
        return not self.tools  # `tools` > 0 pads to a number of tools, whatever the counter

    def params(self) -> dict[str, Any]:
        # `tools` left out while it is off: arms recorded before it existed keep their definition (a resume matches)
        params = super().params()
        if not self.tools:
            params.pop("tools", None)
        return params
