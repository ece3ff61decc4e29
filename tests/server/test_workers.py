"""`toolquake serve --workers N`: several processes on one port behave as one proxy — metrics summed over
them, admin-API profile changes seen by every worker, SIGTERM finishing what is in flight, no worker
outliving the supervisor, the results store written by all of them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support import metric_value, recorded, scraped, start_proxy, wait_for
from tests.support.chat import TOOLS, body, tag
from tests.support.server import log_events, on_every_worker, worker_pids

SCORING_OFF = "[scoring]\nenabled = false\n"
ADMIN = {"Authorization": "Bearer adm-workers"}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def two_workers(fake_upstream):
    proc = start_proxy(fake_upstream.url, SCORING_OFF, {"TOOLQUAKE_ADMIN_TOKEN": "adm-workers"}, "--workers", "2")
    yield proc
    proc.stop()


@pytest.fixture
def fresh_workers(fake_upstream, tmp_path):
    """Two workers of their own, for a test that stops or kills them. Their temporary files (the supervisor's
    runtime folder, which a SIGKILLed supervisor cannot remove) go to the test's own folder, not /tmp."""
    proc = start_proxy(fake_upstream.url, SCORING_OFF, {"TMPDIR": str(tmp_path)}, "--workers", "2")
    yield proc
    proc.stop()


def test_two_workers_serve_one_port_and_metrics_sum_over_them(two_workers):
    url = two_workers.url
    pids = worker_pids(two_workers)
    assert len(pids) == 2 and all(alive(p) for p in pids)
    before = metric_value(httpx.get(f"{url}/metrics").text, "toolquake_requests_total")
    sent = 0

    def send() -> httpx.Response:
        nonlocal sent
        sent += 1
        r = httpx.post(f"{url}/v1/chat/completions", json=body(stream=sent % 2 == 0))
        assert r.status_code == 200
        return r

    by_worker = on_every_worker(two_workers, send)
    assert sorted(by_worker) == sorted(pids)
    text = httpx.get(f"{url}/metrics").text
    assert metric_value(text, "toolquake_requests_total") - before == sent
    assert metric_value(text, "toolquake_requests_total", stream="true") >= sent // 2
    assert metric_value(text, "toolquake_request_duration_seconds_count") - before == sent
    assert metric_value(text, "toolquake_in_flight_requests") == 0
    # every worker's upstream pool shows up (each keeps at least one idle connection after its requests)
    wait_for(lambda: scraped(two_workers, "toolquake_upstream_connections", state="idle") >= 2,
             what="the idle upstream connections of both workers to be summed")


def test_an_admin_profile_change_reaches_every_worker(two_workers, fake_upstream):
    url = two_workers.url
    names = [t["function"]["name"] for t in TOOLS]
    assert httpx.post(f"{url}/p/rev-w/v1/chat/completions", json=body()).status_code == 404
    spec = {"mode": "perturb", "perturbers": [{"name": "tool_order", "params": {"mode": "reverse"}}]}
    assert httpx.put(f"{url}/admin/profiles/rev-w", json=spec, headers=ADMIN).status_code == 200

    def send_tagged() -> httpx.Response:
        t = tag()
        r = httpx.post(f"{url}/p/rev-w/v1/chat/completions", json=body(), headers={"x-test-tag": t})
        r.extensions["tag"] = t
        return r

    for answers in on_every_worker(two_workers, send_tagged).values():
        for r in answers:
            assert r.status_code == 200, r.text
            (seen,) = recorded(fake_upstream, r.extensions["tag"])
            assert [x["function"]["name"] for x in json.loads(seen["body"])["tools"]] == names[::-1]

    # changed again (now it perturbs nothing): every worker forwards the tools as sent
    assert httpx.put(f"{url}/admin/profiles/rev-w", json={"mode": "off"}, headers=ADMIN).status_code == 200
    for answers in on_every_worker(two_workers, send_tagged).values():
        for r in answers:
            (seen,) = recorded(fake_upstream, r.extensions["tag"])
            assert [x["function"]["name"] for x in json.loads(seen["body"])["tools"]] == names

    # deleted: every worker answers 404 unknown_profile
    assert httpx.delete(f"{url}/admin/profiles/rev-w", headers=ADMIN).status_code == 204
    for answers in on_every_worker(two_workers, send_tagged).values():
        for r in answers:
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_profile"
    listed = httpx.get(f"{url}/admin/profiles", headers=ADMIN).json()["profiles"]
    assert "rev-w" not in [p["name"] for p in listed]


def test_sigterm_finishes_the_stream_in_flight_and_stops_every_worker(fresh_workers):
    proc = fresh_workers
    pids = worker_pids(proc)
    got: dict[str, object] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body(stream=True),
                          headers={"x-fake-fault": "chunk-delay:60"}, timeout=30) as r:
            parts = []
            for chunk in r.iter_raw():
                parts.append(chunk)
                first_chunk.set()
            got["status"], got["data"] = r.status_code, b"".join(parts)

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(10)
    t_term = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    t.join(30)
    assert got["status"] == 200
    assert got["data"].rstrip().endswith(b"data: [DONE]"), got["data"][-200:]
    assert proc.popen.wait(15) == 0
    assert time.monotonic() - t_term < 12
    assert not [p for p in pids if alive(p)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{proc.url}/healthz", timeout=2)


def test_workers_die_with_the_supervisor(fresh_workers):
    proc = fresh_workers
    pids = worker_pids(proc)
    proc.popen.kill()  # no chance to stop them itself
    proc.popen.wait(5)
    wait_for(lambda: not [p for p in pids if alive(p)], timeout=10, what="every worker to die with the supervisor")


def test_a_worker_that_dies_is_replaced(fresh_workers):
    proc = fresh_workers
    first = worker_pids(proc)
    time.sleep(5.5)  # past the start-up window in which a dying worker stops the server
    os.kill(first[0], signal.SIGKILL)
    started = wait_for(lambda: [e for e in log_events(proc) if e.get("event") == "worker_died"], timeout=10,
                       what="the supervisor to log worker_died")
    assert started[0]["pid"] == first[0]

    def replaced() -> list[str] | None:  # the supervisor logs the death, then forks the replacement
        children = Path(f"/proc/{proc.popen.pid}/task/{proc.popen.pid}/children").read_text().split()
        return children if len(children) == 2 and str(first[0]) not in children else None

    wait_for(replaced, timeout=10, what="a new worker in place of the dead one")
    for _ in range(20):
        assert httpx.post(f"{proc.url}/v1/chat/completions", json=body()).status_code == 200
    assert proc.popen.poll() is None


@pytest.mark.needs_corpus
def test_workers_write_one_results_store(fake_upstream, tmp_path: Path):
    """Live scoring with two workers: each scores what it served; both append to the one SQLite file (WAL)."""
    from toolquake.bfcl.corpus import case_request, load_case
    from toolquake.proxy.live.results import read_rows

    db = tmp_path / "results.sqlite"
    proc = start_proxy(fake_upstream.url, "[scoring]\nmatch_content = false\nsemantic = false\n", None,
                       "--workers", "2", "--results-db", str(db))
    try:
        request = case_request(load_case("multiple_0"))

        def send() -> httpx.Response:
            r = httpx.post(f"{proc.url}/v1/chat/completions", json=request,
                           headers={"x-toolquake-case": "multiple_0"})
            assert r.status_code == 200
            return r

        by_worker = on_every_worker(proc, send, per_worker=5)
        ids = {r.headers["x-toolquake-request-id"] for answers in by_worker.values() for r in answers}
        def all_rows() -> list | None:
            rows = read_rows(db)
            return rows if len(rows) >= len(ids) else None

        rows = wait_for(all_rows, timeout=20, what="every scored request in the results store")
        assert sorted(r["request_id"] for r in rows) == sorted(ids)
        assert {r["case_id"] for r in rows} == {"multiple_0"}
        text = httpx.get(f"{proc.url}/metrics").text
        assert metric_value(text, "toolquake_scored_total") == len(ids)
        assert metric_value(text, "toolquake_results_store_errors_total") == 0
    finally:
        proc.stop()
