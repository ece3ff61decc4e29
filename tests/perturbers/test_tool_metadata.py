"""tool_metadata: each kind applied directly to real BFCL cases (the right tool found from the ground truth,
names and parameters never changed, deterministic), and through the real proxy (`toolquake serve` + the fake
upstream, `openai` SDK) on chat and Responses, streamed and not: the upstream gets exactly what the perturber
computes for the conversation's seed, every turn of one conversation gets the same, and a call to the twin is
counted as a call to an added tool.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.support import metric_value, recorded
from tests.support.perturbers import bfcl, needs_corpus
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.tool_metadata import KINDS, first_sentence, paraphrase
from toolquake.perturbers.tool_removal import expected_functions

pytestmark = needs_corpus

CASES = ["multiple_98", "multiple_103", "live_multiple_5-3-0"]


def apply(kind: str, body: dict[str, Any], case: Any = None, seed: int = 7) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:tool_metadata"), services=Services(),
                         case=case)
    out = build("tool_metadata", {"kind": kind}).apply(ChatRequest(body), ctx)
    return out.body, ctx.report


def fns(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in body.get("tools") or []}


def right_name(case: Any) -> str:
    (name,) = expected_functions(case)
    return name.replace(".", "_")


@pytest.mark.parametrize("case_id", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_names_and_parameters_of_the_offered_tools_never_change(case_id: str, kind: str) -> None:
    case, body = bfcl(case_id)
    pristine = copy.deepcopy(body)
    out, report = apply(kind, body, case)
    assert body == pristine  # the input is untouched
    before, after = fns(pristine), fns(out)
    assert set(before) <= set(after)
    for name, fn in before.items():
        assert after[name]["parameters"] == fn["parameters"]
    assert [n for n in after if n in before] == list(before)  # the offered tools keep their order
    assert report["target"] == [right_name(case)] and report["target_from"] == "case"
    assert report["distractors"] == len(before) - 1


@pytest.mark.parametrize("case_id", CASES)
def test_promote_adds_a_claim_to_one_distractor(case_id: str) -> None:
    case, body = bfcl(case_id)
    out, report = apply("promote", body, case)
    before, after = fns(body), fns(out)
    changed = [n for n in before if after[n]["description"] != before[n]["description"]]
    assert changed == [report["changed"][0]["tool"]] and changed[0] != right_name(case)
    text = after[changed[0]]["description"]
    assert text.startswith(before[changed[0]]["description"])
    claim = text[len(before[changed[0]]["description"]):]
    assert any(w in claim for w in ("most reliable", "Recommended", "best way"))
    assert first_sentence(before[right_name(case)]["description"]).rstrip(".") in claim


@pytest.mark.parametrize("case_id", CASES)
def test_mislead_describes_a_distractor_as_doing_the_right_tools_job(case_id: str) -> None:
    case, body = bfcl(case_id)
    out, report = apply("mislead", body, case)
    before, after = fns(body), fns(out)
    changed = [n for n in before if after[n]["description"] != before[n]["description"]]
    assert changed == [report["changed"][0]["tool"]] and changed[0] != right_name(case)
    job = first_sentence(before[right_name(case)]["description"]).rstrip(".")
    text = after[changed[0]]["description"]
    assert job[1:] in text and job[:1].lower() in text.lower()
    assert first_sentence(before[changed[0]]["description"]) not in text  # its own job is gone


@pytest.mark.parametrize("case_id", CASES)
def test_namespace_twin_adds_a_copy_of_a_distractor_under_another_namespace(case_id: str) -> None:
    case, body = bfcl(case_id)
    out, report = apply("namespace_twin", body, case)
    before, after = fns(body), fns(out)
    (added,) = set(after) - set(before)
    assert report["added"] == [added]
    ns, _, base = added.partition("__")
    assert ns and base == report["twin_of"] and base in before and base != right_name(case)
    assert {k: v for k, v in after[added].items() if k != "name"} == {
        k: v for k, v in before[base].items() if k != "name"}
    names = list(after)
    assert names.index(added) == names.index(base) + 1
    assert all(after[n] == before[n] for n in before)  # no existing tool touched


@pytest.mark.parametrize("case_id", CASES)
def test_paraphrase_target_shortens_only_the_right_tool(case_id: str) -> None:
    case, body = bfcl(case_id)
    out, report = apply("paraphrase_target", body, case)
    before, after = fns(body), fns(out)
    target = right_name(case)
    assert [c["tool"] for c in report["changed"]] == [target]
    new, old = after[target]["description"], before[target]["description"]
    assert new and new != old and len(new) < len(old)
    assert all(after[n] == before[n] for n in before if n != target)


def test_paraphrase_is_deterministic_and_always_changes_a_description() -> None:
    samples = ["Calculate the area of a triangle given its base and height. Note that it is Python 3.",
               "Weather for a city", "Compute the mean (average) of numbers.", "Plain words only here"]
    for text in samples:
        out = paraphrase(text)
        assert out == paraphrase(text) and out != text and len(out) <= len(text)


def test_without_a_case_the_right_tool_is_drawn_from_the_seed() -> None:
    _, body = bfcl("multiple_103")
    targets = set()
    for seed in range(20):
        out, report = apply("mislead", body, None, seed=seed)
        assert report["target_from"] == "random"
        assert (out, report) == apply("mislead", body, None, seed=seed)  # same seed, same rewrite
        targets.add(report["target"][0])
    assert len(targets) > 1


def test_a_single_tool_leaves_nothing_to_promote() -> None:
    case, body = bfcl("simple_python_0")
    out, report = apply("promote", body, case)
    assert out is body or out == body
    assert "skipped" in report and report["distractors"] == 0


@pytest.mark.parametrize("params", [{"kind": "nope"}, {"kind": "promote", "x": 1}])
def test_bad_parameters_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017 - msgspec refuses unknown keys with its own error type
        build("tool_metadata", params)


# --- through the proxy -----------------------------------------------------------------------------------

CONFIG = """
[profiles.meta-promote]
perturbers = [{ name = "tool_metadata", params = { kind = "promote" } }]

[profiles.meta-mislead]
perturbers = [{ name = "tool_metadata", params = { kind = "mislead" } }]

[profiles.meta-namespace-twin]
injected_calls = "pass"
perturbers = [{ name = "tool_metadata", params = { kind = "namespace_twin" } }]

[profiles.meta-paraphrase-target]
perturbers = [{ name = "tool_metadata", params = { kind = "paraphrase_target" } }]
"""
PROFILE = {kind: "meta-" + kind.replace("_", "-") for kind in KINDS}
CASE = "multiple_104"


@pytest.fixture(scope="module")
def tq(fake_upstream):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG)
    yield proc
    proc.stop()


def expected_tools(kind: str, body: dict[str, Any], case: Any) -> list[dict[str, Any]]:
    """What the perturber makes of the tools under the seed the proxy gives this conversation."""
    from toolquake.proxy.server.pipeline import perturbation_seed_for

    request = ChatRequest(body)
    seed = perturbation_seed_for(None, request.encode(), request=request)
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:tool_metadata"), services=Services(),
                         case=case)
    return build("tool_metadata", {"kind": kind}).apply(request, ctx).tools


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in tools]


def send(proxy, kind: str, tag: str, body: dict[str, Any], api: str, stream: bool, **headers: str) -> Any:
    c = openai.OpenAI(base_url=f"{proxy.url}/p/{PROFILE[kind]}/v1", api_key="sk-test",
                      default_headers={"x-test-tag": tag, "x-toolquake-case": CASE, **headers})
    if api == "chat":
        kw = dict(model="fake-model", messages=body["messages"], tools=body["tools"])
        if stream:
            return list(c.chat.completions.create(stream=True, **kw))
        return c.chat.completions.create(**kw)
    kw = dict(model="fake-model", input=body["messages"], tools=responses_tools(body["tools"]))
    if stream:
        return list(c.responses.create(stream=True, **kw))[-1].response
    return c.responses.create(**kw)


def sent_tools(fake, tag: str, api: str = "") -> list[list[dict[str, Any]]]:
    bodies = [json.loads(r["body"]) for r in recorded(fake, tag) if r["method"] == "POST"]
    return [b["tools"] for b in bodies]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_upstream_gets_the_rewritten_tools(tq, fake_upstream, kind: str, api: str, stream: bool) -> None:
    case, body = bfcl(CASE)
    want = expected_tools(kind, body, case)
    assert want != body["tools"]
    tag = uuid.uuid4().hex
    send(tq, kind, tag, body, api, stream)
    (got,) = sent_tools(fake_upstream, tag, api)
    assert got == (want if api == "chat" else responses_tools(want))


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("kind", ["promote", "namespace_twin"])
def test_two_turns_of_one_conversation_get_the_same_rewrite(tq, fake_upstream, kind: str, api: str) -> None:
    case, body = bfcl(CASE)
    tag = uuid.uuid4().hex
    first = send(tq, kind, tag, body, api, False)
    if api == "chat":
        call = first.choices[0].message.tool_calls[0]
        later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": None,
                                                          "tool_calls": [call.model_dump()]},
                                      {"role": "tool", "tool_call_id": call.id, "content": "42 km"}]}
    else:
        call = first.output[0]
        later = {**body, "messages": [*body["messages"], {"type": "function_call", "call_id": call.call_id,
                                                          "name": call.name, "arguments": call.arguments},
                                      {"type": "function_call_output", "call_id": call.call_id, "output": "42 km"}]}
    send(tq, kind, tag, later, api, True)
    turn1, turn2 = sent_tools(fake_upstream, tag, api)
    assert turn1 == turn2 and turn1 != (body["tools"] if api == "chat" else responses_tools(body["tools"]))


def test_a_call_to_the_twin_is_counted_as_a_call_to_an_added_tool(tq, fake_upstream) -> None:
    case, body = bfcl(CASE)
    twin = next(t["function"]["name"] for t in expected_tools("namespace_twin", body, case) if "__" in
                t["function"]["name"])
    metrics = lambda: httpx.get(f"{tq.url}/metrics").text  # noqa: E731
    before = metric_value(metrics(), "toolquake_injected_tool_calls_total", profile="meta-namespace-twin",
                          perturber="tool_metadata")
    answer = json.dumps({"calls": [{"name": twin, "arguments": {}}]})
    got = send(tq, "namespace_twin", uuid.uuid4().hex, body, "chat", False, **{"x-fake-answer": answer})
    assert [tc.function.name for tc in got.choices[0].message.tool_calls] == [twin]  # injected_calls = "pass"
    after = metric_value(metrics(), "toolquake_injected_tool_calls_total", profile="meta-namespace-twin",
                         perturber="tool_metadata")
    assert after == before + 1
