"""The `toolquake` command line. Each command is a module of this package with `register(subparsers)`,
which adds its parser and sets `func` to the module's `run` (or `run_<sub-command>`). Command modules
import their heavy dependencies inside `run`, so building the parser stays light."""

from __future__ import annotations

import argparse
import importlib
import sys

#: the command modules, in the order `toolquake --help` lists them
COMMAND_MODULES = (
    "toolquake.proxy.cli.serve",
    "toolquake.proxy.cli.perturb",
    "toolquake.proxy.cli.corpus",
    "toolquake.proxy.cli.score",
    "toolquake.proxy.cli.formats",
    "toolquake.proxy.cli.replay",
    "toolquake.proxy.cli.sweep",
    "toolquake.proxy.cli.cases",
    "toolquake.proxy.cli.report",
    "toolquake.proxy.cli.backend",
    "toolquake.proxy.cli.conformance",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolquake",
        description="An OpenAI-compatible evaluating proxy for function-calling agents: perturbs live "
                    "chat-completions requests, forwards them to the real backend, scores the tool calls "
                    "and exports everything to Prometheus.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
