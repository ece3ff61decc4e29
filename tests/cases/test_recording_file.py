"""`serve --record` never touches a file it did not write (#28, item 7): a SQLite database, a PNG or a text
file is refused before serving (exit code, the file named, its bytes and mode unchanged); the torn-tail
repair cuts only the recorder's own partial last record; a recording of the format before the header
existed is still appended to; the workers of `serve --workers 2` share one file with one header."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, scraped, start_proxy, wait_for
from tests.support.cases import RECORD_TOOLS, read_records, toolquake


def sqlite_db(path: Path) -> Path:
    con = sqlite3.connect(path)
    con.execute("create table runs (id integer primary key, body text)")
    con.executemany("insert into runs (body) values (?)", [("x" * 300,)] * 100)
    con.commit()
    con.close()
    return path


def png(path: Path) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes(range(48)) for _ in range(16))  # 16 rows of 16 RGB pixels
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def serve_refused(path: Path, *extra: str) -> str:
    """`toolquake serve --record path` exits non-zero before serving; its stderr. A server that starts
    instead (the old recorder did, after "repairing" the file) is killed with its workers, and fails."""
    proc = subprocess.Popen([sys.executable, "-m", "toolquake", "serve", "--upstream", "http://127.0.0.1:9/v1",
                             "--port", "0", "--record", str(path), *extra], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"toolquake serve --record {path} did not refuse the file: it was still running after 120 s")
    assert proc.returncode != 0, (out, err)
    return err


def prepared_or_refused(path: Path) -> str:
    """The message `toolquake serve --record path` exits with before it serves (what it runs for that, in this
    process)."""
    from toolquake.proxy.live.recording import prepare_or_exit
    from toolquake.proxy.server.config import RecordConfig

    with pytest.raises(SystemExit) as refused:
        prepare_or_exit(RecordConfig(path=str(path)))
    return str(refused.value.code)


def snapshot(path: Path) -> tuple[bytes, int, int]:
    st = path.stat()
    return path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_mtime_ns


def old_record(i: int) -> bytes:
    """A record as the recorder wrote it before recordings had a header."""
    return (json.dumps({"v": 1, "ts": 1763900000.0 + i, "request_id": f"r{i}", "route": "chat_completions",
                        "profile": "off", "model": "m", "stream": False,
                        "request": {"messages": [{"role": "user", "content": f"old {i}"}]},
                        "answer": {"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}},
                       separators=(",", ":")) + "\n").encode()


def post(url: str, text: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": text}], "tools": RECORD_TOOLS})
    assert r.status_code == 200


def wait_recorded(proxy, n: int) -> None:
    wait_for(lambda: scraped(proxy, "toolquake_recorded_total") >= n, what=f"{n} exchange(s) recorded")


def not_a_recording(tmp_path: Path, kind: str) -> Path:
    """A file of someone else's, readable by the group."""
    path = tmp_path / {"sqlite": "results.sqlite", "png": "chart.png"}.get(kind, "notes.txt")
    if kind == "sqlite":
        sqlite_db(path)
    elif kind == "png":
        png(path)
    elif kind == "text":
        path.write_text("my notes\nsecond line, no newline at the end")
    elif kind == "jsonl-of-others":
        path.write_text('{"v": 1, "event": "login"}\n{"v": 1, "event": "logout"}\n')
    else:
        path.write_bytes(b"one line of someone else's text, never ended")
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("kind", ["sqlite", "png", "text", "jsonl-of-others", "no-newline"])
def test_a_file_that_is_not_a_recording_is_refused_and_left_as_it_was(tmp_path, kind):
    """What `serve` runs before it serves (and before its workers start), here in the test's process."""
    path = not_a_recording(tmp_path, kind)
    before = snapshot(path)
    err = prepared_or_refused(path)
    assert str(path) in err and "not a toolquake recording" in err and "refusing" in err, err
    assert snapshot(path) == before  # bytes, mode and modification time


@pytest.mark.processes
@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_file_that_is_not_a_recording_before_serving(tmp_path, workers):
    """`toolquake serve --record` itself, with one worker and with two: exits, the file as it was."""
    path = not_a_recording(tmp_path, "sqlite")
    before = snapshot(path)
    err = serve_refused(path, "--workers", workers)
    assert str(path) in err and "not a toolquake recording" in err and "refusing" in err, err
    assert snapshot(path) == before  # bytes, mode and modification time


def test_a_torn_tail_loses_only_its_own_fragment(fake_upstream, tmp_path):
    recording = tmp_path / "torn.jsonl"
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    try:
        for i in range(3):
            post(proxy.url, f"before {i}")
        wait_recorded(proxy, 3)
    finally:
        proxy.stop()
    whole = recording.read_bytes()
    assert whole.endswith(b"\n") and len(read_records(recording)) == 3
    fragment = b'{"v":1,"ts":1763900000.5,"request_id":"abc","route":"chat_completions","request":{"mess'
    recording.write_bytes(whole + fragment)
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    try:
        assert recording.read_bytes() == whole  # exactly the fragment cut, at start-up
        post(proxy.url, "after")
        wait_recorded(proxy, 1)
    finally:
        proxy.stop()
    after = recording.read_bytes()
    assert after.startswith(whole)
    assert [r["request"]["messages"][0]["content"] for r in read_records(recording)] == [
        "before 0", "before 1", "before 2", "after"]


def test_a_recording_with_foreign_bytes_at_its_end_is_refused_not_cut(tmp_path):
    recording = tmp_path / "glued.jsonl"
    recording.write_bytes(b'{"toolquake_recording":1,"created":1.0}\n' + old_record(0) + b"PK\x03\x04 not ours")
    recording.chmod(0o600)
    before = snapshot(recording)
    err = prepared_or_refused(recording)
    assert str(recording) in err and "after its last newline" in err
    assert snapshot(recording) == before


def test_a_recording_of_the_format_before_headers_is_still_appended_to(fake_upstream, tmp_path):
    recording = tmp_path / "old.jsonl"
    old = old_record(0) + old_record(1)
    recording.write_bytes(old + old_record(2)[:40])  # and torn: the old recorder was killed mid-write
    recording.chmod(0o644)  # made readable for the group since: tightened again
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    try:
        post(proxy.url, "new one")
        wait_recorded(proxy, 1)
    finally:
        proxy.stop()
    raw = recording.read_bytes()
    assert raw.startswith(old) and b"toolquake_recording" not in raw  # no header put in the middle of it
    assert [r["request"]["messages"][0]["content"] for r in read_records(recording)] == ["old 0", "old 1", "new one"]
    assert stat.S_IMODE(recording.stat().st_mode) == 0o600
    cases = tmp_path / "cases.jsonl"
    # no header: `cases from-recording` reads it only when told to (#45)
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases))
    assert r.returncode == 2 and "--force" in r.stderr and not cases.exists(), r.stderr
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases), "--force")
    assert r.returncode == 0, r.stderr
    assert len(cases.read_text().splitlines()) == 3


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_a_new_or_empty_file_gets_a_header_and_is_0600(fake_upstream, tmp_path, state):
    recording = tmp_path / "sub" / "new.jsonl"
    if state == "empty":
        recording.parent.mkdir()
        recording.touch(mode=0o666)
        os.chmod(recording, 0o666)
    proxy = start_proxy(fake_upstream.url, None, None, "--record", str(recording))
    try:
        post(proxy.url, "first")
        wait_recorded(proxy, 1)
    finally:
        proxy.stop()
    lines = recording.read_bytes().splitlines()
    assert json.loads(lines[0])["toolquake_recording"] == 1 and len(lines) == 2
    assert stat.S_IMODE(recording.stat().st_mode) == 0o600
    assert [r["request"]["messages"][0]["content"] for r in read_records(recording)] == ["first"]


def test_two_workers_share_one_recording_with_one_header(fake_upstream, tmp_path):
    recording = tmp_path / "shared.jsonl"
    recording.write_bytes(b'{"toolquake_recording":1,"created":1.0}\n' + old_record(0) + b'{"v":1,"ts":2.0,"req')
    recording.chmod(0o600)
    proxy = start_proxy(fake_upstream.url, None, None, "--workers", "2", "--record", str(recording))
    n = 40
    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: post(proxy.url, f"parallel {i}"), range(n)))
        wait_recorded(proxy, n)
    finally:
        proxy.stop()
    raw = recording.read_bytes()
    assert raw.count(b"toolquake_recording") == 1 and raw.endswith(b"\n")
    contents = sorted(r["request"]["messages"][0]["content"] for r in read_records(recording))
    assert contents == sorted(["old 0", *(f"parallel {i}" for i in range(n))])


# -- `cases from-recording` reads only recordings and writes only new files (#45, item 7) ---------------------

HEADER = b'{"toolquake_recording":1,"created":1.0}\n'


@pytest.mark.processes
@pytest.mark.parametrize("content", [
    b"".join(old_record(i) for i in range(3)),  # records of the right shape, no header
    b'{"request": {"messages": [{"role": "user", "content": "hi"}]}, "answer": {"message": {"content": "x"}}}\n',
    b"just some text\n" + HEADER + old_record(0),  # a header, but not on the first line
], ids=["records", "foreign", "header-later"])
def test_cases_from_a_file_without_the_recording_header_are_refused_unless_forced(tmp_path, content):
    recording = tmp_path / "export.jsonl"
    recording.write_bytes(content)
    cases = tmp_path / "cases.jsonl"
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases))
    assert r.returncode == 2, r.stderr
    assert f"{recording} is not a toolquake recording" in r.stderr and "--force" in r.stderr
    assert "nothing written" in r.stderr and not cases.exists()
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases), "--force")
    assert r.returncode == 0, r.stderr
    assert cases.exists()


@pytest.mark.processes
def test_an_existing_cases_file_is_refused_unless_forced(tmp_path):
    recording = tmp_path / "rec.jsonl"
    recording.write_bytes(HEADER + old_record(0) + old_record(1))
    cases = tmp_path / "mine.jsonl"
    cases.write_text("my hand-edited cases\n")
    cases.chmod(0o640)
    before = snapshot(cases)
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases))
    assert r.returncode == 2 and f"{cases} exists; pass --force" in r.stderr, r.stderr
    assert snapshot(cases) == before
    link = tmp_path / "link.jsonl"  # nor through a link to it
    link.symlink_to(cases)
    r = toolquake("cases", "from-recording", str(recording), "--out", str(link))
    assert r.returncode == 2 and snapshot(cases) == before, r.stderr
    rec_before = snapshot(recording)  # the recording itself, even with --force
    r = toolquake("cases", "from-recording", str(recording), "--out", str(recording), "--force")
    assert r.returncode == 2 and "is one of the recordings" in r.stderr and snapshot(recording) == rec_before
    r = toolquake("cases", "from-recording", str(recording), "--out", str(cases), "--force")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["messages"][0]["content"] for line in cases.read_text().splitlines()] == [
        "old 0", "old 1"]
    new = tmp_path / "new.jsonl"
    assert toolquake("cases", "from-recording", str(recording), "--out", str(new)).returncode == 0
    assert stat.S_IMODE(new.stat().st_mode) == 0o600  # it holds the recording's conversations
