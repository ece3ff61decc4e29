"""Live scoring end to end: the proxy and the fake upstream as real processes, the `openai` SDK as client.

The fake upstream answers some BFCL cases correctly and others wrongly (`X-Fake-Answer`); the
counters on /metrics and the rows in the results store must match the verdicts that the scorer
computes, in this test, for the very answers the client received.

The tests that read only their own requests' counters and rows share one proxy (`shared`): each counts what its
requests added (the work of the tests before it waited for, so done) and reads the rows of its request ids. Those
about a whole store or a server's own settings start their own.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import uuid
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import scraped, start_proxy, wait_for
from tests.support.live import MODEL, expected_verdict, gt_calls, live_config, send, wrong_function, wrong_value
from tests.support.shadow import MESSAGES, TOOLS
from toolquake.proxy.live import results
from toolquake.proxy.replay.report import render_markdown, summarize_db

# --- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(fake_upstream, tmp_path_factory):
    """One proxy (live_config, semantic on) and its results store, for the tests that read only their own."""
    db = tmp_path_factory.mktemp("live-scoring") / "shared.sqlite"
    proxy = start_proxy(fake_upstream.url, live_config(db))
    yield proxy, db
    proxy.stop()


def rows_of(db, request_ids) -> list[dict]:
    """The stored rows of these requests: theirs (live, original) and their twins'."""
    ids = set(request_ids)
    return [r for r in results.read_rows(db) if r["request_id"] in ids or r["shadow_of"] in ids]



@pytest.mark.needs_corpus
def test_metrics_and_rows_match_the_scorers_verdicts(proxy_factory, tmp_path):
    from toolquake.bfcl.corpus import case_request, load_case

    db = tmp_path / "live.sqlite"
    proxy = proxy_factory(live_config(db, semantic=False))
    wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, what="the case index")
    plan = []  # (profile, case id, answer kind, resolve by header?, stream?)
    for i, cid in enumerate(["multiple_0", "multiple_1", "multiple_2", "multiple_3", "simple_python_1",
                             "simple_python_2", "parallel_0", "parallel_1"]):
        kind = ("right", "wrong_value", "wrong_function", "text")[i % 4]
        plan.append(("off", cid, kind, i % 2 == 0, i % 3 == 0))
    plan += [
        ("reversed", "multiple_4", "right", True, False),
        ("reversed", "multiple_5", "wrong_function", False, True),
        ("off", "irrelevance_0", "text", True, False),
        ("off", "irrelevance_1", "first_tool", False, False),
        ("removed", "multiple_6", "first_tool", True, False),
        ("removed", "multiple_7", "text", True, True),
    ]
    sent = []
    for profile, cid, kind, by_header, stream in plan:
        case = load_case(cid)
        if kind == "first_tool":
            answer = None  # the fake calls the first tool it is offered
        elif kind == "text":
            answer = {"text": "I would rather not call a tool."}
        else:
            calls = gt_calls(case)
            answer = {
                "calls": {
                    "right": calls,
                    "wrong_value": wrong_value(calls),
                    "wrong_function": wrong_function(case, calls) if len(case.functions) > 1 else wrong_value(calls),
                }[kind]
            }
        rid, message = send(
            proxy, profile, case_request(case), answer=answer, case_header=cid if by_header else None, stream=stream
        )
        verdict, error = expected_verdict(case, message, irrelevance=profile == "removed")
        sent.append(
            {
                "rid": rid,
                "profile": profile,
                "case": case,
                "verdict": verdict,
                "error": error,
                "resolved_by": "header" if by_header else "content",
                "stream": stream,
            }
        )
    # the plan exercises both verdicts and the main error classes
    assert {s["verdict"] for s in sent} == {"valid", "invalid"}
    assert {"wrong_syntax", "wrong_function", "wrong_param_value", "irrelevance_violation"} <= {
        s["error"] for s in sent
    }
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == len(sent), what="every answer scored")

    by_labels = Counter((s["profile"], s["case"].category, s["verdict"]) for s in sent)
    for (profile, category, verdict), n in by_labels.items():
        assert (
            scraped(proxy, "toolquake_scored_total", profile=profile, model=MODEL, category=category, verdict=verdict)
            == n
        ), (profile, category, verdict)
    errors = Counter((s["profile"], s["error"]) for s in sent if s["verdict"] == "invalid")
    for (profile, error), n in errors.items():
        assert scraped(proxy, "toolquake_errors_total", profile=profile, model=MODEL, error_type=error) == n
    assert scraped(proxy, "toolquake_errors_total") == sum(errors.values())

    wait_for(lambda: len(results.read_rows(db)) == len(sent), what="every row stored")
    rows = {r["request_id"]: r for r in results.read_rows(db)}
    for s in sent:
        row = rows[s["rid"]]
        assert row["case_id"] == s["case"].id and row["category"] == s["case"].category
        assert row["profile"] == s["profile"] and row["arm"] == "live"
        assert bool(row["valid"]) == (s["verdict"] == "valid"), s["case"].id
        assert row["taxonomy"] == s["error"] or (s["error"] is not None and row["error_type"] == s["error"])
        assert row["resolved_by"] == s["resolved_by"]
        assert row["expected"] == (
            "irrelevance" if s["profile"] == "removed" or "irrelevance" in s["case"].category else "ground_truth"
        )
        assert row["upstream_ms"] > 0 and bool(row["stream"]) == s["stream"]
        assert row["prompt_tokens"] == (None if s["stream"] else 10)  # the fake's usage block (not in streams)
        assert row["request_body"] is None and row["response_body"] is None
    assert [r["perturbers"][0]["name"] for r in rows.values() if r["profile"] == "removed"] == ["tool_removal"] * 2

    summary = summarize_db(db)
    for profile in {s["profile"] for s in sent}:
        mine = [s for s in sent if s["profile"] == profile]
        assert summary["arms"][profile]["n"] == len(mine)
        assert summary["arms"][profile]["accuracy"] == pytest.approx(
            sum(s["verdict"] == "valid" for s in mine) / len(mine)
        )


@pytest.mark.needs_corpus
def test_unlabeled_and_followup_requests_are_counted_not_scored(shared):
    from toolquake.bfcl.corpus import case_request, load_case

    proxy, _ = shared
    wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, what="the case index")

    def skipped(reason: str) -> float:
        return scraped(proxy, "toolquake_scoring_skipped_total", profile="off", reason=reason)

    before = {r: skipped(r) for r in ("followup", "no_answer", "unlabeled", "unknown_case")}
    scored = scraped(proxy, "toolquake_scored_total")
    case = load_case("multiple_2")
    body = case_request(case)
    # the case's question with tools under other names is some other conversation: unlabeled
    other_tools = [
        {"type": "function", "function": {**t["function"], "name": t["function"]["name"] + "_v2"}}
        for t in body["tools"]
    ]
    send(proxy, "off", {**body, "tools": other_tools}, answer=None, case_header=None, stream=False)
    send(proxy, "off", {"messages": MESSAGES, "tools": TOOLS}, answer=None, case_header=None, stream=False)
    # the second model turn of the case's conversation is not the case any more
    followup = body["messages"] + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "country_info_capital", "arguments": '{"country": "Brazil"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Brasília"},
    ]
    send(
        proxy,
        "off",
        {**body, "messages": followup},
        answer={"text": "The capital is Brasília."},
        case_header=None,
        stream=False,
    )
    send(proxy, "off", body, answer={"text": "x"}, case_header="no_such_category_7", stream=False)
    # the upstream failed: there is no answer to score
    with pytest.raises(openai.InternalServerError):
        send(proxy, "off", body, answer=None, case_header=case.id, stream=False, fault="status:500")
    wait_for(lambda: skipped("followup") == before["followup"] + 1, what="followup")
    wait_for(lambda: skipped("no_answer") == before["no_answer"] + 1, what="no answer")
    assert skipped("unlabeled") == before["unlabeled"] + 2
    # an id that names no case: served, counted apart (#28)
    assert skipped("unknown_case") == before["unknown_case"] + 1
    assert scraped(proxy, "toolquake_scored_total") == scored


@pytest.mark.needs_corpus
def test_semantic_flips_are_counted(shared):
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.bfcl.corpus import case_request, load_case
    from toolquake.bfcl.decode import calls_from_message
    from toolquake.scorers.ast_checker import check

    proxy, db = shared
    case = load_case("multiple_2")  # country_info.capital(country="Brazil")
    scored = scraped(proxy, "toolquake_scored_total")
    flips = scraped(proxy, "toolquake_semantic_flips_total", profile="off", model=MODEL)
    expected_flips = 0
    rids = []
    # valid as is; an evaluation artefact (the semantic mode accepts it); wrong in every mode (a number differs)
    for value in ("brazil", "BRAZIL!", "Brazil 1822"):
        answer = {"calls": [{"name": "country_info_capital", "arguments": {"country": value}}]}
        rid, message = send(proxy, "off", case_request(case), answer=answer, case_header=case.id, stream=False)
        rids.append(rid)
        calls = calls_from_message(message, to_openai_tools(case.functions)[1])
        if not check(case, calls, mode="bfcl").valid and check(case, calls, mode="semantic").valid:
            expected_flips += 1
    assert expected_flips >= 1  # the plan holds an answer that only the semantic mode accepts
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == scored + 3, what="three verdicts")
    assert scraped(proxy, "toolquake_semantic_flips_total", profile="off", model=MODEL) == flips + expected_flips
    wait_for(lambda: len(rows_of(db, rids)) == 3, what="rows")
    assert sum(bool(r["semantic_valid"]) and not r["valid"] for r in rows_of(db, rids)) == expected_flips


@pytest.mark.needs_corpus
def test_format_rewrite_answers_are_scored_from_the_strict_decode(shared):
    """The upstream answers in text: decodable text is a call (scored), undecodable text is wrong_syntax."""
    from toolquake.bfcl.corpus import case_request, load_case

    proxy, db = shared
    case = load_case("multiple_2")  # country_info.capital(country="Brazil")
    texts = {
        "right": "[country_info.capital(country='Brazil')]",
        "wrong": "[country_info.capital(country='Peru')]",
        "fenced": "```python\n[country_info.capital(country='Brazil')]\n```",  # only lenient decodes it
        "prose": "The capital of Brazil is Brasília.",
    }
    sent = {}
    for kind, text in texts.items():
        rid, message = send(
            proxy, "python-text", case_request(case), answer={"text": text}, case_header=case.id, stream=kind == "wrong"
        )
        sent[kind] = (rid, message)
    assert sent["right"][1]["tool_calls"][0]["function"]["name"] == "country_info_capital"  # restored for the client
    assert sent["fenced"][1].get("tool_calls")  # lenient parsing gave the client its call
    rids = [rid for rid, _ in sent.values()]
    wait_for(lambda: len(rows_of(db, rids)) == len(texts), what="rows")
    rows = {r["request_id"]: r for r in rows_of(db, rids)}
    got = {
        kind: (bool(rows[rid]["valid"]), rows[rid]["taxonomy"], bool(rows[rid]["fair_valid"]))
        for kind, (rid, _) in sent.items()
    }
    right, _ = expected_verdict(case, sent["right"][1])
    wrong, wrong_error = expected_verdict(case, sent["wrong"][1])
    prose, prose_error = expected_verdict(case, sent["prose"][1])
    assert got["right"] == (right == "valid", None, True)
    assert got["wrong"] == (wrong == "valid", wrong_error, False)
    assert got["prose"] == (prose == "valid", prose_error, False) and prose_error == "wrong_syntax"
    # BFCL's decoder rejects the fence (strict); the lenient decode that served the client passes `fair`
    assert got["fenced"] == (False, "wrong_syntax", True)
    assert [r["perturbers"][0]["report"]["decode"]["wrong_syntax"] for r in rows.values()].count(True) == 2


@pytest.mark.needs_corpus
def test_shadow_original_counts_as_off_and_twin_under_the_profile(shared):
    from toolquake.bfcl.corpus import case_request, load_case

    proxy, db = shared
    before = {v: scraped(proxy, "toolquake_scored_total", profile="off", verdict=v) for v in ("valid", "invalid")}
    twins = scraped(proxy, "toolquake_scored_total", profile="shadow-reversed")
    case = load_case("multiple_1")  # three tools: the reversed twin is offered them in another order
    # no X-Fake-Answer: the fake calls the first tool offered, so the twin calls another function
    rid, message = send(proxy, "shadow-reversed", case_request(case), answer=None, case_header=case.id, stream=True)
    first = case_request(case)["tools"][0]["function"]["name"]
    assert message["tool_calls"][0]["function"]["name"] == first
    wait_for(lambda: len(rows_of(db, [rid])) == 2, what="original and twin rows")
    rows = {r["arm"]: r for r in rows_of(db, [rid])}
    assert rows["original"]["profile"] == "off" and rows["twin"]["profile"] == "shadow-reversed"
    assert rows["twin"]["shadow_of"] == rid == rows["original"]["request_id"]
    assert rows["twin"]["agree"] == "false"
    expected_original, _ = expected_verdict(case, message)
    assert bool(rows["original"]["valid"]) == (expected_original == "valid")
    assert scraped(proxy, "toolquake_scored_total", profile="off", verdict=expected_original) == \
        before[expected_original] + 1
    assert scraped(proxy, "toolquake_scored_total", profile="off") == sum(before.values()) + 1
    assert scraped(proxy, "toolquake_scored_total", profile="shadow-reversed") == twins + 1


def test_queue_overflow_is_counted_and_nothing_breaks(proxy_factory, tmp_path):
    """A results file locked by another writer stalls the one worker: the queue fills, the rest is dropped."""
    db = tmp_path / "locked.sqlite"
    proxy = proxy_factory(live_config(db, workers=1, queue_size=2))
    wait_for(db.exists, what="the store")
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    n = 12
    try:
        client = openai.OpenAI(base_url=f"{proxy.url}/p/shadow-reversed/v1", api_key="k", max_retries=0)
        for _ in range(n):
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
            assert r.choices[0].message.tool_calls  # every client is answered
        wait_for(lambda: scraped(proxy, "toolquake_shadow_requests_total", outcome="answered") == n, what="twins")
        # one job is stuck in the worker's write, two wait in the queue, the other twins were dropped
        wait_for(lambda: scraped(proxy, "toolquake_scoring_dropped_total") == n - 3, what="drops")
        assert scraped(proxy, "toolquake_scoring_queue_depth") == 2
        assert scraped(proxy, "toolquake_scoring_dropped_total", profile="shadow-reversed") == n - 3
    finally:
        lock.execute("COMMIT")
        lock.close()
    wait_for(lambda: len(results.read_rows(db)) == 3, what="the three accepted jobs stored")
    wait_for(lambda: scraped(proxy, "toolquake_scoring_queue_depth") == 0, what="an empty queue")
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)  # still serving and scoring
    wait_for(lambda: len(results.read_rows(db)) == 4, what="scoring resumed")
    assert scraped(proxy, "toolquake_consistency_total") == 4


def test_no_scoring_flag_turns_the_queue_off(proxy_factory, tmp_path):
    db = tmp_path / "never.sqlite"
    proxy = proxy_factory(live_config(db), None, None, "--no-scoring")
    client = openai.OpenAI(base_url=f"{proxy.url}/p/shadow-reversed/v1", api_key="k", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    # the request was finished (counted where the observers are handed it: a scorer, had it one, would have
    # enqueued it and launched its twin by then) ...
    wait_for(lambda: scraped(proxy, "toolquake_requests_total", profile="shadow-reversed") == 1,
             what="the request counted")
    # ... and there is no scorer: no queue, no twin, no store
    text = httpx.get(f"{proxy.url}/metrics").text
    assert "toolquake_scoring_queue_depth" not in text and "toolquake_consistency" not in text
    assert "toolquake_shadow_requests" not in text
    assert not db.exists()


def test_the_store_path_from_the_command_line(proxy_factory, tmp_path):
    db = tmp_path / "flag.sqlite"
    proxy = proxy_factory(live_config(tmp_path / "from-config.sqlite"), None, None, "--results-db", str(db))
    client = openai.OpenAI(base_url=f"{proxy.url}/p/shadow-reversed/v1", api_key="k", max_retries=0)
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, extra_headers={"X-Test-Tag": uuid.uuid4().hex}
    )
    wait_for(lambda: db.exists() and len(results.read_rows(db)) == 1, what="the row in --results-db")
    assert not (tmp_path / "from-config.sqlite").exists()


# --- the Grafana dashboard and the documented PromQL ------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "toolquake-dashboard.json"
VARIABLES = {"$model": ".*", "$profile": ".*", "$window": "1m", "$__rate_interval": "1m"}


def dashboard_queries() -> dict[str, list[str]]:
    """Panel title → its PromQL, with the dashboard variables filled in as "All" / 1m would."""
    out: dict[str, list[str]] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.setdefault(panel["title"], []).append(expr)
    return out


def test_dashboard_queries_name_only_metrics_the_proxy_exports(shared):
    proxy, _ = shared
    exported = set(re.findall(r"^# HELP (\S+)", httpx.get(f"{proxy.url}/metrics").text, re.M))
    used = {name for exprs in dashboard_queries().values() for e in exprs for name in re.findall(r"toolquake_\w+", e)}
    assert used, "the dashboard has no toolquake queries"
    missing = {n for n in used if n not in exported and n.removesuffix("_bucket") not in exported}
    assert not missing, f"dashboard queries metrics the proxy does not export: {sorted(missing)}"
    for contract in (
        "toolquake_scored_total",
        "toolquake_errors_total",
        "toolquake_semantic_flips_total",
        "toolquake_consistency_total",
        "toolquake_proxy_overhead_seconds_bucket",
        "toolquake_conformance_violations_total",
    ):
        assert contract in used


@pytest.mark.processes
def test_dashboard_queries_are_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, expr in enumerate(e for exprs in dashboard_queries().values() for e in exprs)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus scraping the targets written into its file_sd file every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus)")
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "toolquake", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}
                ],
            }
        )
    )
    log_path = tmp_path / "prometheus.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            "--web.listen-address=127.0.0.1:0",  # it logs the port it got: `msg="Listening on" address=...`
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        address = wait_for(lambda: _listening(log_path), timeout=30, what="prometheus to say where it listens")
        url = f"http://{address}"
        wait_for(lambda: _ready(url), timeout=30, what="prometheus")
        yield url, targets
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _listening(log_path: Path) -> str | None:
    found = re.search(r'msg="Listening on" address=(127\.0\.0\.1:\d+)', log_path.read_text(errors="replace"))
    return found.group(1) if found else None


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def promql(url: str, expr: str) -> dict[str, float]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}).json()
    assert r["status"] == "success", (expr, r)
    return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1]) for s in r["data"]["result"]}


@pytest.mark.needs_corpus
def test_dashboard_accuracy_and_drop_match_the_stored_verdicts(proxy_factory, prometheus, tmp_path):
    from toolquake.bfcl.corpus import case_request, load_case

    prom, targets = prometheus
    db = tmp_path / "p.sqlite"
    proxy = proxy_factory(live_config(db, semantic=False))
    targets.write_text(json.dumps([{"targets": [proxy.url.removeprefix("http://")]}]))
    plan = {"off": ["right", "right", "right", "wrong"], "reversed": ["right", "wrong", "wrong", "wrong"]}
    n = 0
    for profile, kinds in plan.items():
        for i, kind in enumerate(kinds):
            case = load_case(f"multiple_{10 + i}")
            calls = gt_calls(case)
            send(
                proxy,
                profile,
                case_request(case),
                answer={"calls": calls if kind == "right" else wrong_value(calls)},
                case_header=case.id,
                stream=False,
            )
            n += 1
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == n, what="every answer scored")
    wait_for(lambda: promql(prom, "sum(toolquake_scored_total)") == {"{}": n}, timeout=30, what="a scrape")
    summary = summarize_db(db)
    queries = dashboard_queries()
    [accuracy] = queries["Accuracy by profile (since the proxies started)"]
    [drop] = queries["Relative drop vs off (seed 001 Table 2)"]
    got_acc = {json.loads(k)["profile"]: v for k, v in promql(prom, accuracy).items()}
    got_drop = {json.loads(k)["profile"]: v for k, v in promql(prom, drop).items()}
    assert set(got_acc) == set(plan)
    for profile in plan:
        assert got_acc[profile] == pytest.approx(summary["arms"][profile]["accuracy"])
        assert got_drop[profile] == pytest.approx(summary["arms"][profile]["drop_vs_off"])
    for title, exprs in queries.items():  # every other panel's query evaluates without error
        for expr in exprs:
            promql(prom, expr)


@pytest.mark.needs_corpus
def test_corpus_flag_points_at_a_data_directory(proxy_factory, tmp_path):
    """--corpus DIR finds the corpus even when the cache dir (TOOLQUAKE_CACHE) holds none."""
    from toolquake.bfcl.corpus import case_request, data_dir, load_case

    db = tmp_path / "c.sqlite"
    empty_cache = tmp_path / "empty-cache"
    empty_cache.mkdir()
    proxy = proxy_factory(
        live_config(db, semantic=False), {"TOOLQUAKE_CACHE": str(empty_cache)}, None, "--corpus", str(data_dir())
    )
    wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, what="the case index")
    case = load_case("simple_python_1")
    body = case_request(case)
    send(proxy, "off", body, answer={"calls": gt_calls(case)}, case_header=None, stream=False)  # by content
    wait_for(
        lambda: scraped(proxy, "toolquake_scored_total", verdict="valid", category="simple_python") == 1,
        what="the verdict",
    )
    assert results.read_rows(db)[0]["resolved_by"] == "content"


def test_an_unusable_default_store_does_not_stop_serving_but_a_chosen_one_does(proxy_factory, tmp_path):
    not_a_dir = tmp_path / "cache-is-a-file"
    not_a_dir.write_text("")
    shadow = (
        '[profiles.shadow-reversed]\nmode = "shadow"\n'
        'perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]\n'
    )
    proxy = proxy_factory(shadow, {"TOOLQUAKE_CACHE": str(not_a_dir)})  # default store: <cache>/results.sqlite
    client = openai.OpenAI(base_url=f"{proxy.url}/p/shadow-reversed/v1", api_key="k", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    wait_for(lambda: scraped(proxy, "toolquake_consistency_total") == 1, what="scoring without a store")
    assert "results_store_unavailable" in proxy.output()
    with pytest.raises(RuntimeError, match=r"\[scoring\] store"):
        proxy_factory(shadow + f'[scoring]\nstore = "{not_a_dir / "results.sqlite"}"\n')


@pytest.mark.needs_corpus
def test_anytime_gauges_are_the_reports_confidence_sequences(proxy_factory, tmp_path):
    """The toolquake_live_* gauges are read back from the store and equal the anytime intervals `report --db`
    prints over the same rows; 20 cases lost under a profile put its drop's whole interval below 0 (what the
    ToolquakeProfileHurtsAccuracy alert reads)."""
    from toolquake.bfcl.corpus import case_request, load_case

    db = tmp_path / "a.sqlite"
    proxy = proxy_factory(live_config(db, semantic=False))
    cases = [load_case(f"multiple_{i}") for i in range(20)]
    for profile, right in (("off", True), ("reversed", False)):
        for case in cases:
            calls = gt_calls(case)
            send(proxy, profile, case_request(case), answer={"calls": calls if right else wrong_value(calls)},
                 case_header=case.id, stream=False)
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == 2 * len(cases), what="every answer scored")
    # the monitor reads the store every few seconds: wait for the pairs it has seen
    wait_for(lambda: scraped(proxy, "toolquake_live_pairs", profile="reversed") == len(cases), timeout=30,
             what="the anytime monitor read every pair")
    summary = summarize_db(db)
    arm, base = summary["arms"]["reversed"], summary["arms"]["off"]
    assert arm["anytime_pairs"] == len(cases)
    lo, hi = arm["drop_vs_off_cs"]
    assert scraped(proxy, "toolquake_live_drop_lower", profile="reversed") == pytest.approx(lo)
    assert scraped(proxy, "toolquake_live_drop_upper", profile="reversed") == pytest.approx(hi)
    assert lo <= arm["drop_vs_off"] == -1.0 <= hi < 0  # every case lost: the whole interval below 0
    for profile, a in (("reversed", arm), ("off", base)):
        acc_lo, acc_hi = a["accuracy_cs"]
        assert scraped(proxy, "toolquake_live_accuracy_lower", profile=profile) == pytest.approx(acc_lo)
        assert scraped(proxy, "toolquake_live_accuracy_upper", profile=profile) == pytest.approx(acc_hi)
        # anytime-valid is wider than the fixed-sample interval at the same n
        assert acc_lo <= a["accuracy_ci"][0] and a["accuracy_ci"][1] <= acc_hi
    text = render_markdown(summary)
    assert "accuracy anytime 95 %" in text and f"| [{lo * 100:+.1f}, {hi * 100:+.1f}] | {len(cases)} |" in text
