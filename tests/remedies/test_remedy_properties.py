"""Properties of every remedy on arbitrary request shapes (hypothesis): none raises where it was not designed to,
tool_search and response_trim never make the request larger, none changes the request it was given; and each is
linear in hostile text wherever a client puts it."""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.hostile import FIELDS, LARGE, MS_PER_KIB, SMALL, UNITS, hostile, ordinary, request_with
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.tokens import EstimateCounter
from toolquake.remedies import build, registry

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=40))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)
WORDS = st.text(alphabet=st.sampled_from("ab cd\n[]{}\",:0s"), max_size=300)
NAMES = st.one_of(st.sampled_from(["f", "g", "get_weather", "h.i"]), st.text(max_size=6), JSONISH)
TOOL = st.one_of(
    JSONISH,
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": NAMES}, optional={"description": st.one_of(WORDS, JSONISH), "parameters": JSONISH})}),
)
CALL = st.one_of(JSONISH, st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"),
                                                 "function": st.fixed_dictionaries({"name": NAMES},
                                                                                   optional={"arguments": JSONISH})}))
MESSAGE = st.one_of(
    JSONISH,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "function", "system", 3])},
                          optional={"content": st.one_of(WORDS, JSONISH, st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": WORDS}), max_size=2)),
                              "tool_calls": st.one_of(st.lists(CALL, max_size=3), JSONISH),
                              "tool_call_id": st.text(max_size=4), "name": NAMES}),
)
BODY = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(st.lists(MESSAGE, max_size=6), JSONISH),
    "tools": st.one_of(st.lists(TOOL, max_size=12), JSONISH),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), JSONISH,
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": NAMES})})),
})
REMEDIES = {"tool_search": {"k": 2, "method": "bm25"}, "response_trim": {"budget_tokens": 5},
            "format_choice": {"config": "fmt-13-vxml-tag-python"}}
#: the remedies that only ever take things out of a request (format_choice renders the tools into the prompt)
SHRINKING = ("tool_search", "response_trim")


def test_every_registered_remedy_is_checked_here():
    """Every remedy the package ships (tests may register their own through `[server] plugins`: not these)."""
    shipped = {name for name, cls in registry().items() if cls.__module__.startswith("toolquake.remedies.")}
    assert shipped == set(REMEDIES)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODY)
def test_remedies_never_raise_and_never_grow_the_request(body: dict[str, Any]):
    counter = EstimateCounter()
    for name, params in REMEDIES.items():
        given_body = copy.deepcopy(body)
        ctx = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=Services(token_counter=counter))
        out = build(name, params).apply(ChatRequest(given_body), ctx)
        assert given_body == body, f"{name} changed the request it was given"
        if name in SHRINKING:
            assert counter.count_request(out.body) <= counter.count_request(body), name
        if name == "tool_search" and isinstance(body.get("tools"), list):
            kept = out.body.get("tools") or []
            assert len(kept) == ctx.report["kept"] and len(kept) + len(ctx.report["dropped"]) == len(body["tools"])


HOSTILE_STEPS = {"tool_search": {"k": 1, "method": "bm25"}, "response_trim": {"budget_tokens": 50},
                 "format_choice": {"config": "fmt-13-vxml-tag-python"}}


def _cpu(name: str, body: dict[str, Any]) -> float:
    ctx = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=Services(token_counter=EstimateCounter()))
    remedy = build(name, HOSTILE_STEPS[name])
    start = time.process_time()
    remedy.apply(ChatRequest(body), ctx)
    return time.process_time() - start


def _with_more_tools(body: dict[str, Any]) -> dict[str, Any]:
    """The adversarial request with six more tools, so that tool_search has tools to leave out and scores them."""
    extra = [{"type": "function", "function": {"name": f"other_{i}", "description": f"Another tool, number {i}."}}
             for i in range(6)]
    return {**body, "tools": body["tools"] + extra}


@pytest.mark.parametrize("name", HOSTILE_STEPS)
def test_remedies_are_linear_in_hostile_text(name: str) -> None:
    """The perturbers' adversarial check (tests/perturbers/test_adversarial_perturbers.py: its hostile units, in
    every place a client controls, 64 KiB and 512 KiB, less ordinary prose of the same size) on each remedy."""
    def body(field: str, text: str) -> dict[str, Any]:
        return _with_more_tools(request_with(field, text))

    _cpu(name, body("user", "warm up"))

    @settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(FIELDS), unit=st.sampled_from(UNITS))
    def check(field: str, unit: str) -> None:
        where = f"{name} with {unit!r} repeated in the {field}"
        t_small = max(0.0, _cpu(name, body(field, hostile(unit, SMALL))) - _cpu(name, body(field, ordinary(SMALL))))
        assert t_small * 1000 <= MS_PER_KIB * SMALL / 1024, f"{where}: {t_small:.2f} s CPU for 64 KiB"
        t_large = max(0.0, _cpu(name, body(field, hostile(unit, LARGE))) - _cpu(name, body(field, ordinary(LARGE))))
        assert t_large * 1000 <= MS_PER_KIB * LARGE / 1024, f"{where}: {t_large:.2f} s CPU for 512 KiB"
        assert t_large <= 3 * 8 * t_small + 0.5, f"{where}: 64 KiB {t_small:.3f} s, 512 KiB {t_large:.3f} s CPU"

    check()
