"""The embedded server binds port 0 and says the port it got (`listening on http://HOST:PORT` on stderr), and
`LocalBackend` starts it that way and reads the port from that line: no port picked first and bound later by the
child, which another process could take in between.

Without the model: the real server processes over loopback, on the stand-in for llama-cpp-python's `Llama`
(tests/backend/stand_in)."""

from __future__ import annotations

import re
from typing import Iterator

import httpx
import pytest

from tests.support import start_process
from tests.support.backend import STAND_IN, STAND_IN_MODEL, stand_in_env
from tests.support.ports import held_port

pytestmark = pytest.mark.processes


def test_the_cli_on_port_0_says_the_port_it_got_and_serves_there():
    proc = start_process(["-m", "toolquake", "backend", "local", "--port", "0", "--model-path", str(STAND_IN_MODEL)],
                         None, "/healthz", env=stand_in_env())
    try:
        assert proc.port != 0 and httpx.get(f"{proc.url}/v1/models", timeout=30).status_code == 200
        out = proc.output()
        # the line start_process read, and the OpenAI base URL printed for a user, name the same port
        assert f"listening on http://127.0.0.1:{proc.port}\n" in out
        assert re.search(rf"^http://127\.0\.0\.1:{proc.port}/v1$", out, re.M), out
    finally:
        proc.stop()


@pytest.fixture
def on_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LocalBackend's checks and its child find the stand-in as `llama_cpp`."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    monkeypatch.setenv("PYTHONPATH", stand_in_env()["PYTHONPATH"])
    yield


def test_local_backend_reads_the_port_its_server_chose(on_the_stand_in, tmp_path):
    from toolquake.proxy.backend.local import BackendUnavailable, LocalBackend

    backend = LocalBackend(model_path=STAND_IN_MODEL, log_path=tmp_path / "backend.log")
    with pytest.raises(BackendUnavailable, match="not known yet"):
        backend.url  # noqa: B018 - no port before the server says it
    with backend:
        assert backend.port and f"listening on {backend.url}\n" in (tmp_path / "backend.log").read_text()
        models = httpx.get(f"{backend.api_url}/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [backend.model]
        assert backend.command()[backend.command().index("--port") + 1] == "0"


def test_local_backend_on_a_port_asked_for_serves_there(on_the_stand_in, tmp_path):
    from toolquake.proxy.backend.local import LocalBackend

    with held_port("127.0.0.1") as port, LocalBackend(model_path=STAND_IN_MODEL, port=port,
                                                      log_path=tmp_path / "backend.log") as backend:
        assert backend.url == f"http://127.0.0.1:{port}"
        assert f"listening on {backend.url}\n" in (tmp_path / "backend.log").read_text()
        assert httpx.get(f"{backend.api_url}/models", timeout=30).status_code == 200


def test_a_log_local_backend_made_itself_is_removed_when_it_stops_and_a_given_one_is_kept(on_the_stand_in, tmp_path):
    from toolquake.proxy.backend.local import BackendUnavailable, LocalBackend

    backend = LocalBackend(model_path=STAND_IN_MODEL)
    with backend:
        made = backend.log_path
        assert made is not None and f"listening on {backend.url}\n" in made.read_text()
    assert not made.exists() and backend.log_path is None
    with backend:  # started again: a new log of its own, removed again
        again = backend.log_path
        assert again is not None and again.exists()
    assert not again.exists()

    given = tmp_path / "backend.log"
    with LocalBackend(model_path=STAND_IN_MODEL, log_path=given):
        pass
    assert "listening on" in given.read_text()  # the caller's file stays

    broken = LocalBackend(model_path=STAND_IN_MODEL, host="no-such-host.invalid")  # cannot listen: it exits
    with pytest.raises(BackendUnavailable, match="exited with code") as failed:
        broken.start(timeout=60)
    assert "Name or service not known" in str(failed.value)  # its last output is in the error, its log gone
    assert broken.log_path is None
