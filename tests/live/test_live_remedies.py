"""The report's remedies section from live verdicts (#49): `toolquake serve` (the proxy as its own process, live
scoring, a results store) in front of the fake upstream in its `--hidden-tools` mode — a model right on a case only
while the request holds at most the case's hidden number of tools and offers the tool its ground truth calls — the
`openai` SDK as client, BFCL `multiple` cases tied by `X-Toolquake-Case`. Each case goes through `off`, `padded`
(catalog_padding to 40 tools) and `search-padded` (the same padding, then tool_search with k = 8 by BM25); other
cases, sent with a catalog the client padded itself, through a shadow profile holding only the search. Then
`toolquake report --db` (json, md, html): every figure of the remedies section counted here from what the fake was
sent and answered; a replay of the same cases (same seed, same fake) gives the same section.

One proxy and one fake for the module; the tests only read what the fixture sent.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fake_upstream import LOST_TEXT
from tests.support import scraped, start_fake_upstream, start_proxy, wait_for
from tests.support.replay import replay
from tests.support.report import SAME, report
from toolquake.scorers.consistency import DISAGREE

pytestmark = [pytest.mark.processes, pytest.mark.needs_corpus, pytest.mark.needs_embeddings]

K = 8
PAD = 40
SEED = "7"
#: the first cases of `multiple` (replay's `--limit` takes the same): through off, padded and search-padded
N_MAIN = 12
#: a model that reads any number of tools (these cases survive the padding), and one that reads only the case's own
ROBUST, TIGHT = (1, 6), 4
#: the cases after them, each sent once to the shadow profile with a catalog of PAD tools the client padded itself
SHADOW = range(N_MAIN, N_MAIN + 6)
SHADOW_ROBUST = (N_MAIN + 2,)
#: a robust shadow case whose client catalog holds K decoys described by its question word for word: the search
#: keeps them and drops the needed tool, so the twin loses what the client's own answer had right
DECOYED = N_MAIN + 3
#: tool_search's parameters as the store records them: every one, defaults included
PARAMS = {"k": K, "method": "bm25", "turns": 2}
PROFILES = ("off", "padded", "search-padded")
SEARCH = f'{{ name = "tool_search", params = {{ k = {K}, method = "bm25" }} }}'
PROFILES_TOML = f"""
[profiles.padded]
perturbers = [{{ name = "catalog_padding", params = {{ tools = {PAD} }} }}]

[profiles.search-padded]
perturbers = [{{ name = "catalog_padding", params = {{ tools = {PAD} }} }}]
remedies = [{SEARCH}]

[profiles.search-shadow]
mode = "shadow"
sample_rate = 1.0
max_concurrent = 16
remedies = [{SEARCH}]
"""


def _names(body: dict) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


def _needed(case) -> set[str]:
    from toolquake.bfcl.convert import openai_name
    from toolquake.scorers.mutations import ground_truth_calls

    return {openai_name(c["name"]) for c in ground_truth_calls(case)}


def _hidden(cases: list, path) -> dict[str, int]:
    """The fake's hidden numbers: ROBUST and SHADOW_ROBUST any number of tools, TIGHT only its own, the rest K."""
    from toolquake.bfcl.convert import openai_name
    from toolquake.scorers.mutations import ground_truth_calls

    lines = []
    for i, case in enumerate(cases):
        calls = [{"name": openai_name(c["name"]), "arguments": c["arguments"]} for c in ground_truth_calls(case)]
        most = 100_000 if i in (*ROBUST, *SHADOW_ROBUST, DECOYED) else len(case.functions) if i == TIGHT else K
        lines.append({"match": case.turns[0][-1]["content"], "answer": {"calls": calls}, "max_tools": most})
    lines.sort(key=lambda e: -len(e["match"]))  # a message that contains another one is matched by its own entry
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {line["match"]: line["max_tools"] for line in lines}


def _client_catalog(case, others: list, decoys: int = 0) -> list[dict]:
    """The case's own tools in the middle of tools of other cases, PAD in all (a client with a large catalog);
    the first `decoys` of the others described by the case's question."""
    from toolquake.bfcl.convert import to_openai_tools

    own = to_openai_tools(case.functions)[0]
    taken = set(_names({"tools": own}))
    extra = [{"type": "function", "function": {"name": f"decoy_{j}", "description": case.turns[0][-1]["content"],
                                               "parameters": {"type": "object", "properties": {}}}}
             for j in range(decoys)]
    for other in others:
        for tool in to_openai_tools(other.functions)[0]:
            if tool["function"]["name"] not in taken and len(extra) < PAD - len(own):
                taken.add(tool["function"]["name"])
                extra.append(tool)
    half = len(extra) // 2
    return extra[:half] + own + extra[half:]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from toolquake.bfcl.corpus import case_request, load_category

    every = load_category("multiple")
    cases, others = every[:SHADOW.stop], every[60:80]
    tmp = tmp_path_factory.mktemp("live-remedies")
    most = _hidden(cases, tmp / "hidden.jsonl")
    (tmp / "profiles.toml").write_text(PROFILES_TOML)
    db = tmp / "live.sqlite"
    fake = start_fake_upstream("--hidden-tools", str(tmp / "hidden.jsonl"), "--usage-counts")
    proxy = start_proxy(fake.url, f'[server]\nmodel_allowlist = ["fake-model"]\n{PROFILES_TOML}\n'
                                  f'[scoring]\nstore = "{db}"\n')
    answers: dict[tuple[str, str], dict] = {}
    try:
        wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, timeout=60, what="the case index")
        for profile in PROFILES:
            client = openai.OpenAI(base_url=f"{proxy.url}/p/{profile}/v1", api_key="sk-live", max_retries=0)
            for case in cases[:N_MAIN]:
                body = case_request(case)
                answer = client.chat.completions.create(
                    model="fake-model", messages=body["messages"], tools=body["tools"],
                    extra_headers={"X-Toolquake-Case": case.id, "X-Toolquake-Seed": SEED,
                                   "X-Test-Tag": f"{profile}/{case.id}"})
                answers[(profile, case.id)] = answer.choices[0].message.model_dump(exclude_none=True)
        shadow = openai.OpenAI(base_url=f"{proxy.url}/p/search-shadow/v1", api_key="sk-live", max_retries=0)
        for i in SHADOW:
            body = case_request(cases[i])
            catalog = _client_catalog(cases[i], others, K if i == DECOYED else 0)
            answer = shadow.chat.completions.create(
                model="fake-model", messages=body["messages"], tools=catalog,
                extra_headers={"X-Toolquake-Case": cases[i].id, "X-Toolquake-Seed": SEED,
                               "X-Test-Tag": f"search-shadow/{cases[i].id}"})
            answers[("search-shadow", cases[i].id)] = answer.choices[0].message.model_dump(exclude_none=True)
        shadows = len(SHADOW)
        wait_for(lambda: scraped(proxy, "toolquake_consistency_total", profile="search-shadow") == shadows,
                 timeout=60, what="every shadow twin compared")
        # each main case under three profiles, each shadow case's original (under off) and its twin
        wait_for(lambda: scraped(proxy, "toolquake_scored_total") == len(PROFILES) * N_MAIN + 2 * shadows,
                 timeout=60, what="every answer scored")
        recorded = httpx.get(f"{fake.url}/_fake/requests", timeout=30).json()
        exposition = httpx.get(f"{proxy.url}/metrics").text
    finally:
        proxy.stop()
        fake.stop()
    sent: dict[tuple[str, str], list[dict]] = {}
    for r in recorded:
        if r["path"].endswith("/chat/completions"):
            profile, case_id = r["headers"]["x-test-tag"].split("/")
            sent.setdefault((profile, case_id), []).append(json.loads(r["body"]))
    yield {"cases": cases, "most": most, "db": db, "dir": tmp, "fake_sent": sent, "answers": answers,
           "exposition": exposition}


def _right(most: dict[str, int], case, body: dict) -> bool:
    """The fake's rule: the case's answer while the request holds at most its number of tools and offers the tool
    its ground truth calls."""
    limit = most[case.turns[0][-1]["content"]]
    return len(body["tools"]) <= limit and _needed(case) <= set(_names(body))


def by_hand(live) -> dict:
    """The remedies section's figures counted from what the fake was sent and answered."""
    from toolquake.perturbers.helpers.tokens import EstimateCounter

    cases, sent, answers = live["cases"][:N_MAIN], live["fake_sent"], live["answers"]
    right = {}
    for p in PROFILES:
        for c in cases:
            [body] = sent[(p, c.id)]
            message = answers[(p, c.id)]
            got = [tc["function"]["name"] for tc in message.get("tool_calls") or []]
            # what the client got is what the fake answered (tool_search restores nothing)
            assert (got == sorted(_needed(c))) is _right(live["most"], c, body)
            assert got or message["content"] == LOST_TEXT
            right[(p, c.id)] = bool(got)
    count = EstimateCounter().count_request
    off, pert, rem = ([right[(p, c.id)] for c in cases] for p in PROFILES)
    n = len(cases)
    searched = [sent[("search-padded", c.id)][0] for c in cases]
    return {"n": n, "off": sum(off) / n, "pert": sum(pert) / n, "rem": sum(rem) / n,
            "won": sum(1 for p, r in zip(pert, rem) if r and not p),
            "lost": sum(1 for p, r in zip(pert, rem) if p and not r),
            "share": (sum(rem) - sum(pert)) / (sum(off) - sum(pert)),
            "saved": sum(count(sent[("padded", c.id)][0]) - count(b) for c, b in zip(cases, searched)) / n,
            "dropped": sum(1 for c, b in zip(cases, searched) if not _needed(c) <= set(_names(b))),
            "sizes": {p: sorted({len(sent[(p, c.id)][0]["tools"]) for c in cases}) for p in PROFILES}}


def _entry(summary: dict, profile: str) -> dict:
    [entry] = [e for e in summary["remedies"] if e["profile"] == profile]
    return entry


def test_the_remedies_section_of_live_traffic_pairs_the_remedied_profile_with_its_twin_and_off(live):
    hand = by_hand(live)
    # what reached the model: the cases' own tools, PAD tools padded, at most K searched
    assert hand["sizes"]["padded"] == [PAD] and max(hand["sizes"]["search-padded"]) <= K
    assert max(hand["sizes"]["off"]) < K
    assert hand["off"] == 1.0 and hand["pert"] == len(ROBUST) / N_MAIN and hand["rem"] >= 0.75
    summary = json.loads(report("--db", str(live["db"]), "--format", "json").stdout)
    e = _entry(summary, "search-padded")
    assert (e["model"], e["twin"], e["baseline"], e["n"]) == ("live", "padded", "off", hand["n"])
    assert e["remedies"] == ["tool_search"] and e["remedy_params"] == [PARAMS]
    assert e["perturbation"] == ["catalog_padding"]
    assert e["accuracy_off"] == pytest.approx(hand["off"])
    assert e["accuracy_perturbed"] == pytest.approx(hand["pert"])
    assert e["accuracy_remedied"] == pytest.approx(hand["rem"])
    assert (e["cases_won"], e["cases_lost"]) == (hand["won"], hand["lost"])
    assert e["won_back"] == pytest.approx(hand["share"]) and e["won_back_ci"][0] <= hand["share"]
    assert e["significant"] is True
    # the proxy knew every case: the needed tools the search left out, counted per case
    assert (e["needed_dropped"], e["needed_dropped_known"]) == (hand["dropped"], hand["n"])
    # the fake counted each request's prompt tokens (--usage-counts): the padded request's minus the searched one's
    assert e["tokens_saved"] == pytest.approx(hand["saved"]) and e["tokens_saved_cases"] == hand["n"]
    assert hand["saved"] > 1000
    assert summary["arms"]["search-padded"]["remedies"] == [{"name": "tool_search", "params": PARAMS}]
    md = report("--db", str(live["db"]), "--no-plots").stdout
    assert "## Remedies: accuracy on the same cases" in md
    row = next(line for line in md.splitlines() if line.startswith("| live | tool_search | search-padded |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == ["padded", str(hand["n"])] and cells[8].startswith(f"{hand['share'] * 100:.0f} %")
    assert (cells[9], cells[10]) == (str(hand["won"]), str(hand["lost"]))
    assert cells[13] == f"{hand['dropped']}/{hand['n']}"
    html = report("--db", str(live["db"]), "--format", "html", "--no-plots").stdout
    assert "Remedies: accuracy on the same cases" in html and ">search-padded<" in html


def test_a_shadow_profile_of_the_remedy_alone_shows_its_consistency(live):
    cases, sent, most = live["cases"], live["fake_sent"], live["most"]
    original, twin = {}, {}
    for i in SHADOW:
        first, second = sent[("search-shadow", cases[i].id)]  # the client's request, then the remedied twin
        assert len(first["tools"]) == PAD and len(second["tools"]) <= K
        original[i], twin[i] = _right(most, cases[i], first), _right(most, cases[i], second)
        assert bool(live["answers"][("search-shadow", cases[i].id)].get("tool_calls")) is original[i]
    agree = sum(1 for i in SHADOW if original[i] == twin[i])
    assert 0 < agree < len(SHADOW)  # the robust case agrees, the searched twins that found the tool do not
    dropped = [i for i in SHADOW if not _needed(cases[i]) <= set(_names(sent[("search-shadow", cases[i].id)][1]))]
    assert dropped == [DECOYED] and original[DECOYED] and not twin[DECOYED]
    exposition = live["exposition"]
    assert f'toolquake_remedies_total{{profile="search-shadow",remedy="tool_search"}} {float(len(SHADOW))}' in \
        exposition
    summary = json.loads(report("--db", str(live["db"]), "--format", "json").stdout)
    c = summary["consistency"]["search-shadow"]
    assert c["n"] == len(SHADOW) and c["exact"] + c["semantic"] == agree and c["disagree"] == len(SHADOW) - agree
    # the twin paired with the client's own answer to the same request (stored under off): what the remedy changes
    e = _entry(summary, "search-shadow")
    assert (e["twin"], e["n"]) == ("off", len(SHADOW))
    assert e["accuracy_off"] == pytest.approx(sum(original.values()) / len(SHADOW))
    assert e["accuracy_remedied"] == pytest.approx(sum(twin.values()) / len(SHADOW))
    assert e["cases_won"] == sum(1 for i in SHADOW if twin[i] and not original[i]) and e["cases_lost"] == 1
    assert (e["needed_dropped"], e["needed_dropped_known"]) == (len(dropped), len(SHADOW))
    assert 'toolquake_remedy_dropped_needed_total{profile="search-shadow",remedy="tool_search"} 1.0' in exposition
    assert (f'toolquake_consistency_total{{agree="{DISAGREE}",model="fake-model",profile="search-shadow"}} '
            f'{float(len(SHADOW) - agree)}') in exposition
    md = report("--db", str(live["db"]), "--no-plots").stdout
    assert "| search-shadow |" in md and "Shadow consistency" in md


def test_a_replay_of_the_same_cases_gives_the_same_remedies_section(live, tmp_path):
    fake = start_fake_upstream("--hidden-tools", str(live["dir"] / "hidden.jsonl"), "--usage-counts")
    try:
        r = replay("--backend", f"{fake.url}/v1", "--config", str(live["dir"] / "profiles.toml"), "--profiles",
                   ",".join(PROFILES), "--categories", "multiple", "--limit", str(N_MAIN), "--header",
                   f"X-Toolquake-Seed: {SEED}", "--token-counter", "estimate", "--allow-estimate",
                   "--out", str(tmp_path / "runs"))
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        fake.stop()
    replayed = json.loads(report(str(tmp_path / "runs"), "--format", "json").stdout)
    lived = json.loads(report("--db", str(live["db"]), "--format", "json").stdout)
    same = {k: v for k, v in _entry(lived, "search-padded").items() if k != "model"}
    assert same == {k: v for k, v in _entry(replayed, "search-padded").items() if k != "model"}
    # the two arms' own statistics too (off differs: live, it also holds the shadowed requests' own answers)
    for p in PROFILES[1:]:
        assert {k: lived["arms"][p][k] for k in SAME} == {k: replayed["arms"][p][k] for k in SAME}, p
