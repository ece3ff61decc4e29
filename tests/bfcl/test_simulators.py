"""The API simulators' worker: its sandbox, dispatch by name (never eval), call parsing, fresh worlds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from toolquake.bfcl.simulators import ERROR_PREFIX, BackendError, Backends, Call, parse_call


class Probe:
    """A stand-in API class whose methods try to leave the sandbox (loaded into the worker by the tests)."""

    def _load_scenario(self, scenario: dict[str, Any], long_context: bool = False) -> None:
        self.scenario = scenario

    def ping(self) -> dict[str, str]:
        return {"pong": "yes"}

    def read_file(self, path: str) -> str:
        with open(path) as f:
            return f.read()

    def write_file(self, path: str, content: str) -> str:
        Path(path).write_text(content)
        return "written"

    def list_dir(self, path: str) -> list[str]:
        return os.listdir(path)

    def run_command(self, command: str) -> str:
        return subprocess.run(command, shell=True, capture_output=True, text=True).stdout

    def system(self, command: str) -> int:
        return os.system(command)

    def connect(self, port: int) -> str:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return "connected"

    def load_module(self, name: str) -> str:
        import importlib

        return repr(importlib.import_module(name))

    def run_code(self, code: str) -> str:
        exec(code)
        return "ran"

    def spin(self) -> None:
        while True:
            pass


PROBE = {"Probe": "tests.bfcl.test_simulators:Probe"}
ESCAPES = ["read_file", "write_file", "list_dir", "run_command", "system", "connect", "load_module", "run_code"]


@pytest.fixture(scope="module")
def probe_worker() -> Any:
    from toolquake.bfcl.simulators import ensure_installed

    try:
        ensure_installed()
    except FileNotFoundError as exc:
        pytest.skip(f"no corpus/simulators: {exc}")
    with Backends(extra_classes=PROBE, timeout_s=5) as b:
        yield b


def escape_calls(tmp_path: Path, port: int) -> dict[str, Call]:
    secret = tmp_path / "secret.txt"
    return {
        "read_file": Call("read_file", (), {"path": str(secret)}),
        "write_file": Call("write_file", (), {"path": str(tmp_path / "planted.txt"), "content": "x"}),
        "list_dir": Call("list_dir", (), {"path": str(tmp_path)}),
        "run_command": Call("run_command", (), {"command": f"touch {tmp_path / 'ran.txt'}"}),
        "system": Call("system", (), {"command": f"touch {tmp_path / 'system.txt'}"}),
        "connect": Call("connect", (), {"port": port}),
        "load_module": Call("load_module", (), {"name": "xml.dom.minidom"}),
        "run_code": Call("run_code", (), {"code": f"open({str(tmp_path / 'exec.txt')!r}, 'w').write('x')"}),
    }


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_the_sandbox_refuses_files_processes_sockets_imports_and_exec(probe_worker: Backends, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("SECRET-CONTENT")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        calls = escape_calls(tmp_path, port)
        # the same methods outside the sandbox do reach the file system, processes and the network
        probe = Probe()
        assert probe.read_file(calls["read_file"].kwargs["path"]) == "SECRET-CONTENT"
        assert probe.connect(port) == "connected"
        (tmp_path / "secret.txt").write_text("SECRET-CONTENT")
        with probe_worker.world(["Probe"]) as world:
            assert world.execute([Call("ping")]) == ['{"pong": "yes"}']
            results = dict(zip(ESCAPES, world.execute([calls[name] for name in ESCAPES])))
    for name, result in results.items():
        assert result.startswith(ERROR_PREFIX + "sandbox:"), (name, result)
    assert "SECRET" not in " ".join(results.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]


@pytest.mark.needs_corpus
def test_model_output_is_never_evaluated(backends: Backends, tmp_path: Path) -> None:
    from toolquake.bfcl.corpus import load_case

    c = load_case("multi_turn_base_0")
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    with backends.world(c.extra["involved_classes"], c.extra["initial_config"]) as world:
        results = world.execute([
            Call("__import__", ("os",)), Call("eval", (payload,)), Call("exec", (), {"source": payload}),
            Call("_load_scenario", ({},)),              # private methods are not callable
            Call("GorillaFileSystem.cd", (), {"folder": "document"}),
            Call("cd", (), {"folder": "document"}),
            Call("touch", (), {"file_name": "notes.txt"}),
            Call("echo", (), {"content": payload, "file_name": "notes.txt"}),
            Call("cat", (), {"file_name": "notes.txt"}),
            Call("run"), Call("kill", (), {"pid": 1}),  # names BFCL refuses outright
        ])
    assert results[:5] == [
        ERROR_PREFIX + "name '__import__' is not defined", ERROR_PREFIX + "name 'eval' is not defined",
        ERROR_PREFIX + "name 'exec' is not defined", ERROR_PREFIX + "name '_load_scenario' is not defined",
        ERROR_PREFIX + "name 'GorillaFileSystem' is not defined"]
    assert results[8] == json.dumps({"file_content": payload})  # stored and read back as plain text
    assert results[9:] == [ERROR_PREFIX + "Function call run is not allowed.",
                           ERROR_PREFIX + "Function call kill is not allowed."]
    assert not marker.exists()


@pytest.mark.needs_corpus
def test_arguments_are_bound_like_python_calls(backends: Backends) -> None:
    from toolquake.bfcl.corpus import load_case

    c = load_case("multi_turn_base_0")
    with backends.world(c.extra["involved_classes"], c.extra["initial_config"]) as world:
        results = world.execute([
            Call("cd", (), {"folder": "document"}),
            Call("sort", ("final_report.pdf",)),            # positional, as ground-truth strings use
            Call("sort", (), {}),                           # what a prompting model's `sort('x')` decodes to
            Call("sort", (), {"file_name": "final_report.pdf", "reverse": True}),
            Call("sort", (), {"not an identifier": 1}),
        ])
    assert results[1].startswith('{"sorted_content"')
    assert results[2] == ERROR_PREFIX + "GorillaFileSystem.sort() missing 1 required positional argument: 'file_name'"
    assert results[3] == ERROR_PREFIX + "GorillaFileSystem.sort() got an unexpected keyword argument 'reverse'"
    assert results[4].startswith(ERROR_PREFIX + "invalid keyword argument name")


class _NotData:
    pass


@pytest.mark.needs_corpus
def test_only_plain_data_reaches_the_worker(backends: Backends) -> None:
    with backends.world(["MathAPI"]) as world:
        assert world.execute([Call("add", (), {"a": 1, "b": 2})]) == ['{"result": 3}']
        with pytest.raises(BackendError, match="refused global"):
            world.execute([Call("add", (), {"a": _NotData(), "b": 2})])
        # the worker is still serving after refusing the request
        assert world.execute([Call("mean", (), {"numbers": [1, 2, 3]})]) == ['{"result": 2.0}']


@pytest.mark.needs_corpus
def test_worlds_are_fresh_and_independent(backends: Backends) -> None:
    from toolquake.bfcl.corpus import load_case

    c = load_case("multi_turn_base_0")
    classes, config = c.extra["involved_classes"], c.extra["initial_config"]
    with backends.world(classes, config) as a, backends.world(classes, config) as b:
        assert a.differences(b) == []
        a.execute([parse_call("cd(folder='document')"), parse_call("mkdir(dir_name='new')")])
        diffs = a.differences(b)
        assert [(d["class"], d["attribute"]) for d in diffs] == [("GorillaFileSystem", "root")]
        assert "new" in diffs[0]["model"] and "new" not in diffs[0]["ground_truth"]
    with backends.world(classes, config) as again:     # a new world starts from the initial config
        assert "'new'" not in again.state()["GorillaFileSystem"]["root"]


@pytest.mark.needs_corpus
def test_long_context_worlds_hold_more_data(backends: Backends) -> None:
    from toolquake.bfcl.corpus import load_case

    c = load_case("multi_turn_long_context_0")
    classes, config = c.extra["involved_classes"], c.extra["initial_config"]
    with backends.world(classes, config, long_context=False) as short, \
            backends.world(classes, config, long_context=True) as long:
        calls = [parse_call("cd(folder='document')"), parse_call("ls()")]
        plain, padded = short.execute(calls)[1], long.execute(calls)[1]
        assert len(padded) > 5 * len(plain)
        assert {d["attribute"] for d in long.differences(short)} >= {"root", "long_context"}


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_a_stuck_call_stops_the_worker_and_the_next_request_restarts_it(probe_worker: Backends) -> None:
    world = probe_worker.world(["Probe"])
    before = probe_worker.generation
    with pytest.raises(BackendError, match="did not answer within"):
        world.execute([Call("spin")])
    with pytest.raises(BackendError, match="restarted"):
        world.execute([Call("ping")])
    with probe_worker.world(["Probe"]) as fresh:
        assert fresh.execute([Call("ping")]) == ['{"pong": "yes"}']
    assert probe_worker.generation == before + 1


def test_ground_truth_strings_are_parsed_without_evaluation() -> None:
    assert parse_call("sort('final_report.pdf')") == Call("sort", ("final_report.pdf",), {})
    assert parse_call("mean(numbers=[1, -2.5, 3])") == Call("mean", (), {"numbers": [1, -2.5, 3]})
    assert parse_call("f(a={'k': (1, 2)}, b=None, c=True)") == Call("f", (), {"a": {"k": (1, 2)}, "b": None,
                                                                             "c": True})
    for text in ("f(x=__import__('os'))", "f(x=1+2)", "f(*args)", "f(**kw)", "os.system('ls')", "[f()]",
                 "f(x=g())", "f(x=y)", "lambda: 0", "f(x="):
        with pytest.raises(ValueError):
            parse_call(text)


def test_missing_simulators_say_how_to_install_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from toolquake.bfcl.simulators import BackendsMissing, backends_root

    monkeypatch.setenv("TOOLQUAKE_CACHE", str(tmp_path))
    with pytest.raises(BackendsMissing, match="toolquake corpus pull --with-backends"):
        backends_root()
