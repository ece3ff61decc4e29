"""/readyz with `[server] warm_up` (TOOLQUAKE_WARM_UP): a fresh pod is ready only once the configured
profiles' perturbers are set up — the tool-pool index built into an empty cache — so the first perturbed
request builds nothing. Warm-up off keeps readiness as it was (only the upstream is probed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.support import recorded, start_proxy
from tests.support.perturbers import bfcl, corpus_present, names, needs_pool, send

DEADLINE_S = 600  # the small corpus's index builds in seconds on two idle cores; a busy machine may take a minute


#: cases kept per single-turn category in the small corpus the warming proxies read
SMALL_CORPUS_CASES = 25


def small_corpus(dest: Path, cases: int = SMALL_CORPUS_CASES) -> Path:
    """The BFCL corpus with only the first `cases` questions of each single-turn category (the tool pool is built
    from those: ~500 functions instead of ~4,000, an index built in seconds instead of a minute or two); every
    other file linked in place. The warm-up's order of events does not depend on the pool's size."""
    from toolquake.bfcl import corpus

    source = corpus.corpus_root()
    dest.mkdir(parents=True)
    stems = {f"BFCL_v4_{corpus._source_stem(c)}.json" for c in corpus.SINGLE_TURN_CATEGORIES}
    for entry in source.iterdir():
        if entry.name in stems:
            with entry.open(encoding="utf-8") as f:
                (dest / entry.name).write_text("".join(line for _, line in zip(range(cases), f)), encoding="utf-8")
        else:
            (dest / entry.name).symlink_to(entry)
    return dest


def fresh_cache_env(tmp_path: Path, warm_up: bool) -> dict[str, str]:
    """An empty TOOLQUAKE_CACHE (what a new pod's emptyDir holds) with only a (small) corpus reachable."""
    env = {"TOOLQUAKE_CACHE": str(tmp_path / "cache"), "TOOLQUAKE_WARM_UP": "1" if warm_up else "0",
           "TOOLQUAKE_GENERATOR_URL": ""}  # `expanded` draws from the tool pool
    if corpus_present():
        env["TOOLQUAKE_CORPUS"] = str(small_corpus(tmp_path / "corpus"))
    return env


def index_files(cache: Path) -> dict[str, int]:
    """The tool-pool index under `cache` ({relative path: mtime_ns}); empty until it is complete."""
    found = {}
    for directory in (cache / "tool_pool").glob("bfcl-*"):
        if (directory / "tools.json").is_file() and (directory / "embeddings.npy").is_file():
            found.update({str(p.relative_to(cache)): p.stat().st_mtime_ns for p in directory.iterdir()})
    return found


def readyz(proxy) -> httpx.Response:
    return httpx.get(f"{proxy.url}/readyz", timeout=30)


@needs_pool
def test_a_fresh_cache_is_not_ready_until_the_index_exists_and_the_first_expanded_request_builds_nothing(
        tmp_path, fake_upstream) -> None:
    cache = tmp_path / "cache"
    fake = fake_upstream
    proxy = start_proxy(fake.url, None, fresh_cache_env(tmp_path, warm_up=True))
    try:
        warming_without_index = 0
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert time.monotonic() < deadline, f"not ready after {DEADLINE_S} s:\n{proxy.output()[-3000:]}"
            r = readyz(proxy)
            if r.status_code == 200:
                assert r.json()["status"] == "ready"
                break
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "warming_up" and error["message"].startswith("warming up: loading ")
            # the index still missing once the answer came (files only appear): it was missing when the proxy
            # answered, so `expanded` was still loading (looked at before the probe instead, the index may be
            # written between the look and the answer: the small corpus builds it in a second or two)
            if not index_files(cache):
                warming_without_index += 1
                assert "expanded" in error["message"]
            time.sleep(0.5)
        assert warming_without_index >= 1  # a fresh cache was really warming, not ready at once
        built = index_files(cache)
        assert any(p.endswith("tools.json") for p in built) and any(p.endswith("embeddings.npy") for p in built)
        at_ready = proxy.output()
        assert at_ready.count('"tool_pool_built"') == 1 and '"perturbers_set_up"' in at_ready
        assert '"ready_after_failed_warm_up"' not in at_ready

        case, body = bfcl("multiple_4")
        tag, answer = send(proxy, "expanded", body, case.id)
        assert answer.choices[0].message is not None
        got, *_ = recorded(fake, tag)
        sent = names(json.loads(got["body"])["tools"])
        assert len(sent) == len(body["tools"]) + 3  # perturbed from the pool built at start-up
        assert index_files(cache) == built  # same files, same mtimes: nothing rebuilt or added
        assert proxy.output().count('"tool_pool_built"') == 1
    finally:
        proxy.stop()


def test_without_warm_up_readiness_is_immediate_and_nothing_is_built(tmp_path, fake_upstream) -> None:
    fake = fake_upstream
    proxy = start_proxy(fake.url, None, fresh_cache_env(tmp_path, warm_up=False))
    try:
        # ready at once: the start-up is over and began no warm-up (one in progress holds /readyz back, and only
        # a warm-up begun at start-up builds the pool or logs perturbers_set_up), so nothing can appear later
        r = readyz(proxy)
        assert r.status_code == 200 and r.json()["status"] == "ready"
        assert not (tmp_path / "cache" / "tool_pool").exists()
        assert '"perturbers_set_up"' not in proxy.output()
    finally:
        proxy.stop()


def test_a_failed_warm_up_is_logged_and_readiness_goes_ready_anyway(tmp_path, fake_upstream) -> None:
    """Fail open: without an embedding model `expanded` cannot set up; the pod still becomes ready, and the
    log says which perturbers will load (and may fail) on first use."""
    env = {**fresh_cache_env(tmp_path, warm_up=True), "TOOLQUAKE_EMBEDDING_MODEL": str(tmp_path / "no-model-here")}
    fake = fake_upstream
    proxy = start_proxy(fake.url, None, env)
    try:
        deadline = time.monotonic() + 300
        while (r := readyz(proxy)).status_code != 200:
            assert time.monotonic() < deadline, proxy.output()[-3000:]
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up", r.text
            time.sleep(0.2)
        failed = [json.loads(line) for line in proxy.output().splitlines()
                  if '"ready_after_failed_warm_up"' in line]
        assert len(failed) == 1 and "expanded/toolkit_expansion" in failed[0]["failed"]
        assert len(failed[0]["failed"]) > 1  # every pool perturber failed for the same reason: logged once
        assert proxy.output().count('"perturber_setup_failed"') == 1
        assert not (tmp_path / "cache" / "tool_pool").exists()
    finally:
        proxy.stop()


@pytest.mark.parametrize("workers", ["2"])
def test_each_worker_answers_readyz_for_itself_once_warm(tmp_path, fake_upstream, workers: str) -> None:
    """Several workers: each warms its own process; all of them end up ready (the probe hits any)."""
    env = {**fresh_cache_env(tmp_path, warm_up=True), "TOOLQUAKE_EMBEDDING_MODEL": str(tmp_path / "no-model-here")}
    fake = fake_upstream
    proxy = start_proxy(fake.url, None, env, "--workers", workers)
    try:
        deadline = time.monotonic() + 300
        ready = 0
        while ready < 20:  # twenty 200s in a row: whichever worker answered was warm
            assert time.monotonic() < deadline, proxy.output()[-3000:]
            r = httpx.get(f"{proxy.url}/readyz", timeout=30, headers={"Connection": "close"})
            ready = ready + 1 if r.status_code == 200 else 0
            time.sleep(0.05)
        assert proxy.output().count('"ready_after_failed_warm_up"') == int(workers)
    finally:
        proxy.stop()
