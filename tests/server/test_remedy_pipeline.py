"""Remedies in the pipeline, in-process (the logic; the server's behaviour is tests/server/test_remedies_served.py):
they run after every perturbation step, seeded apart, fail-open, restored first, recorded and counted as remedies,
and a needed tool one left out is named when the case is known."""

from __future__ import annotations

import pytest

import tests.plugins.remedies  # noqa: F401  (registers the test remedies)
from tests.support.server import Tagger as _Tagger  # registers test_hot_path_tagger
from toolquake.bfcl.corpus import Case
from toolquake.perturbers import ChatRequest, Services
from toolquake.proxy.server.config import ConfigError, PerturberSpec, ProfileSpec, RemedySpec, validate_profiles
from toolquake.proxy.server.metrics import Metrics
from toolquake.proxy.server.pipeline import PerturbationFailed, restore, run_profile
from toolquake.proxy.server.profiles import build_profile
from toolquake.proxy.tracing.tracer import perturbation_attributes
from toolquake.remedies import Remedy, register

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}} for i in range(4)]
REQUEST = ChatRequest({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
REVERSE = PerturberSpec(name="tool_order", params={"mode": "reverse"})


@register
class _RemedyTagger(Remedy):
    """The perturbers' test tagger as a remedy: changes nothing, tags the answer it restores."""

    name = "test_remedy_tagger"
    rewrites_response = True
    tag: str = ""
    apply = _Tagger.apply
    restore = _Tagger.restore


def _profile(*remedies: tuple[str, dict], perturbers: tuple[PerturberSpec, ...] = (), strict: bool = False,
             mode: str = "perturb"):
    spec = ProfileSpec(mode=mode, perturbers=list(perturbers), strict=strict,
                       remedies=[RemedySpec(name=n, params=p) for n, p in remedies])
    return build_profile("t", spec)


def _names(request: ChatRequest) -> list[str]:
    return [t["function"]["name"] for t in request.tools]


def test_a_profile_of_remedies_only_perturbs_and_is_active():
    only = _profile(("test_keep_tools", {"k": 2}))
    assert only.perturbs and only.active and not only.steps
    assert [r.name for r in only.all_steps()] == ["test_keep_tools"]
    shadow = _profile(("test_keep_tools", {}), mode="shadow")
    assert shadow.active and not shadow.perturbs
    assert not _profile().perturbs


async def test_remedies_run_after_the_perturbations_and_are_recorded_as_remedies():
    profile = _profile(("test_keep_tools", {"k": 1}), perturbers=(REVERSE,))
    outcome = await run_profile(profile, REQUEST, 3, Services())
    assert _names(outcome.request) == ["tool_3"] and outcome.changed
    assert [(a.name, a.kind) for a in outcome.applied] == [("tool_order", ""), ("test_keep_tools", "remedy")]
    assert [a.name for a in outcome.perturbations] == ["tool_order"]
    assert [a.name for a in outcome.remedies] == ["test_keep_tools"]
    assert outcome.injected == {}
    stored = outcome.applied[1].stored()
    assert stored["kind"] == "remedy" and stored["params"] == {"k": 1, "from_end": False}
    assert stored["report"]["dropped"] == ["tool_2", "tool_1", "tool_0"]
    assert "kind" not in outcome.applied[0].stored()
    assert "dropped_needed" not in stored["report"]  # no case: nothing known of what was needed


async def test_a_remedy_draws_the_same_whatever_the_perturbations_before_it():
    alone = await run_profile(_profile(("test_keep_tools", {})), REQUEST, 11, Services())
    after = await run_profile(_profile(("test_keep_tools", {}), perturbers=(REVERSE,)), REQUEST, 11, Services())
    other_seed = await run_profile(_profile(("test_keep_tools", {})), REQUEST, 12, Services())
    assert alone.applied[0].report["draw"] == after.applied[1].report["draw"]
    assert alone.applied[0].report["draw"] != other_seed.applied[0].report["draw"]


async def test_a_raising_remedy_is_skipped_and_counted_apart_from_the_perturbers():
    profile = _profile(("test_remedy_raises", {}), ("test_keep_tools", {"k": 2}), perturbers=(REVERSE,))
    outcome = await run_profile(profile, REQUEST, 1, Services())
    assert outcome.remedies_failed == ["test_remedy_raises"] and outcome.failed == []
    assert _names(outcome.request) == ["tool_3", "tool_2"]
    metrics = Metrics()
    metrics.count_outcome(outcome, "estimate", "t")
    text = metrics.exposition().decode()
    assert 'toolquake_remedy_failures_total{profile="t",remedy="test_remedy_raises"} 1.0' in text
    assert 'toolquake_remedies_total{profile="t",remedy="test_keep_tools"} 1.0' in text
    assert 'toolquake_perturbations_total{perturber="tool_order"} 1.0' in text
    assert 'perturber="test_keep_tools"' not in text and 'perturber="test_remedy_raises"' not in text


async def test_a_strict_profile_fails_on_a_raising_remedy():
    with pytest.raises(PerturbationFailed) as info:
        await run_profile(_profile(("test_remedy_raises", {}), strict=True), REQUEST, 1, Services())
    assert (info.value.perturber, info.value.kind) == ("test_remedy_raises", "remedy")
    assert str(info.value).startswith("remedy 'test_remedy_raises' failed")


async def test_restore_undoes_the_remedies_first():
    profile = _profile(("test_remedy_tagger", {"tag": "remedy"}),
                       perturbers=(PerturberSpec(name="test_hot_path_tagger", params={"tag": "perturber"}),))
    outcome = await run_profile(profile, REQUEST, 1, Services())
    restored, failed = restore(outcome, {"trail": ["upstream"]})
    assert restored["trail"] == ["upstream", "remedy", "perturber"] and failed == []


async def test_a_needed_tool_left_out_is_named_when_the_case_is_known():
    # BFCL's dotted name: the request holds it as the OpenAI name (dots become underscores)
    case = Case(id="c", category="multiple", turns=[], functions=[], ground_truth=[{"tool.3": {}}, {"tool_1": {}}])
    tools = [{"type": "function", "function": {"name": n}} for n in ("tool_1", "tool_2", "tool_3")]
    request = REQUEST.replace(tools=tools)
    outcome = await run_profile(_profile(("test_keep_tools", {"k": 1})), request, 1, Services(), case)
    assert outcome.applied[0].report["dropped_needed"] == ["tool_3"]
    kept = await run_profile(_profile(("test_keep_tools", {"k": 3})), request, 1, Services(), case)
    assert kept.applied[0].report["dropped_needed"] == []
    metrics = Metrics()
    metrics.count_outcome(outcome, "estimate", "t")
    attrs = perturbation_attributes(outcome)
    assert attrs["toolquake.remedies"] == ["test_keep_tools"] and attrs["toolquake.perturbers"] == []
    assert attrs["toolquake.remedy.test_keep_tools.dropped_needed"] == 1
    assert 'toolquake_remedy_dropped_needed_total{profile="t",remedy="test_keep_tools"} 1.0' in \
        metrics.exposition().decode()


@pytest.mark.parametrize(("remedies", "message"), [
    ([RemedySpec(name="no_such_remedy")], "remedies[0]: unknown remedy 'no_such_remedy'"),
    ([RemedySpec(name="test_keep_tools", params={"k": "eight"})], "remedies[0]: remedy 'test_keep_tools'"),
    ([RemedySpec(name="test_keep_tools", params={"kk": 1})], "remedies[0]: remedy 'test_keep_tools'"),
])
def test_a_profile_with_an_unknown_remedy_or_bad_parameters_does_not_load(remedies, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_profiles({"p": ProfileSpec(remedies=remedies)})


def test_off_holds_no_remedies():
    with pytest.raises(ConfigError, match="reserved"):
        validate_profiles({"off": ProfileSpec(mode="off", remedies=[RemedySpec(name="test_keep_tools")])})
