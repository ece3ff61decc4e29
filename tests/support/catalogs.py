"""BFCL `multiple` cases padded with corpus tools to a catalog of N tools: the requests tool_search is tested and
benchmarked on (tests/remedies/test_tool_search.py, tests/bench/remedies.py)."""

from __future__ import annotations

import functools
import random
from typing import Any


@functools.cache
def corpus_tools() -> tuple[dict[str, Any], ...]:
    """Every unique function of the single-turn corpus as an OpenAI tool (the pool's tools, without embeddings)."""
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.perturbers.helpers.toolkit.tool_pool import corpus_functions

    tools, seen = [], set()
    for doc in corpus_functions()[1]:
        converted = to_openai_tools([doc])[0][0]
        if converted["function"]["name"] not in seen:
            seen.add(converted["function"]["name"])
            tools.append(converted)
    return tuple(tools)


def padded_cases(count: int, size: int = 500, model: str = "m") -> list[tuple[dict[str, Any], set[str]]]:
    """(request padded with corpus tools to `size` tools, the case's own tools in the middle; the tools its ground
    truth calls) for the first `count` cases of BFCL `multiple` (the padding seeded by the case's position)."""
    from toolquake.bfcl.corpus import case_request, load_category

    out = []
    universe = corpus_tools()
    for i, case in enumerate(load_category("multiple")[:count]):
        body = case_request(case, model=model)
        own = {t["function"]["name"] for t in body["tools"]}
        pad = [t for t in random.Random(i).sample(universe, size + 20) if t["function"]["name"] not in own]
        pad = pad[:size - len(body["tools"])]
        needed = {name.replace(".", "_") for call in case.ground_truth for name in call}
        out.append(({**body, "tools": pad[:len(pad) // 2] + body["tools"] + pad[len(pad) // 2:]}, needed))
    return out
