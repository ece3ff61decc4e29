"""The `toolquake` command line: serve, perturb, and the commands other parts register."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
from typing import Any

# modules that add sub-commands; each exposes `register(subparsers)` and sets `func` on its parser
# (imported only to build the parser: their heavy imports stay inside the commands)
COMMAND_MODULES = (
    "proxy.cmd_corpus",
    "proxy.cmd_score",
    "proxy.cmd_formats",
    "proxy.cmd_replay",
    "proxy.cmd_report",
    "proxy.cmd_backend",
)


def _config_from_args(args: argparse.Namespace, **overrides: Any):
    from proxy.config import ConfigError, load_config

    path = args.config or os.environ.get("TOOLQUAKE_CONFIG") or None
    try:
        return load_config(path, overrides=overrides)
    except ConfigError as exc:
        sys.exit(f"toolquake: {exc}")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy import logs
    from proxy.app import create_app

    config = _config_from_args(args, upstream=args.upstream, host=args.host, port=args.port,
                               default_profile=args.default_profile, token_counter=args.token_counter)
    from proxy.scoring import apply_cli

    config = apply_cli(config, corpus=args.corpus, no_scoring=args.no_scoring, results_db=args.results_db,
                       store_contents=args.store_contents, no_content_match=args.no_content_match)
    server = config.server
    logs.configure(server.log_level)
    if server.default_profile != "off" and server.default_profile not in config.profiles:
        sys.exit(f"toolquake: default profile {server.default_profile!r} is not defined in the config "
                 f"(defined: off, {', '.join(sorted(config.profiles))})")
    app = create_app(config, admin_token=os.environ.get("TOOLQUAKE_ADMIN_TOKEN") or None)
    uvicorn.run(app, host=server.host, port=server.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, timeout_graceful_shutdown=5, server_header=False,
                timeout_keep_alive=int(server.keep_alive_timeout), proxy_headers=False)
    return 0


def _load_request(args: argparse.Namespace) -> dict[str, Any]:
    if args.request:
        try:
            with open(args.request, "rb") if args.request != "-" else sys.stdin.buffer as f:
                body = json.loads(f.read())
        except (OSError, json.JSONDecodeError) as exc:
            sys.exit(f"toolquake: cannot read request {args.request}: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            sys.exit("toolquake: the request must be a chat-completions JSON object with a 'messages' list")
        return body
    from proxy.cases import request_for_case

    try:
        return request_for_case(args.case)
    except (LookupError, FileNotFoundError) as exc:
        sys.exit(f"toolquake: {exc}")


def cmd_perturb(args: argparse.Namespace) -> int:
    from perturbers import ChatRequest
    from perturbers.base import Services
    from perturbers.tokens import make_counter
    from proxy.pipeline import run_profile, seed_for
    from proxy.profiles import ProfileStore

    config = _config_from_args(args, upstream=args.upstream)
    store = ProfileStore(config.profiles)
    profile = store.get(args.profile)
    if profile is None:
        sys.exit(f"toolquake: unknown profile {args.profile!r} (known: {', '.join(store.names())})")
    body = _load_request(args)
    case = None
    if args.case:
        from proxy.cases import case_by_id

        case = case_by_id(args.case)
    raw = json.dumps(body).encode()
    seed = args.seed if args.seed is not None else seed_for(None, raw)
    services = Services(token_counter=make_counter(config.server.token_counter, config.server.upstream))
    outcome = asyncio.run(run_profile(profile, ChatRequest(body), seed, services, case))
    json.dump(outcome.request.body, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")
    summary = {"profile": profile.name, "seed": seed, "token_counter": services.token_counter.source,
               "applied": [{"name": a.name, "params": a.params, **a.report} for a in outcome.applied],
               "skipped": outcome.skipped, "failed": outcome.failed}
    print(json.dumps(summary, ensure_ascii=False), file=sys.stderr)
    return 1 if outcome.failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolquake",
        description="An OpenAI-compatible evaluating proxy for function-calling agents: perturbs live "
                    "chat-completions requests, forwards them to the real backend, scores the tool calls "
                    "and exports everything to Prometheus.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy server. Flags win over "
                           "environment variables (TOOLQUAKE_*), which win over the config file.")
    serve.add_argument("--upstream", help="the backend's OpenAI API base URL, e.g. http://127.0.0.1:8000/v1 "
                       "(env TOOLQUAKE_UPSTREAM; default from the config file)")
    serve.add_argument("--host", help="address to listen on (env TOOLQUAKE_HOST; default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (env TOOLQUAKE_PORT; default 8080)")
    serve.add_argument("--config", help="TOML config file with [server] and [profiles.*] (env TOOLQUAKE_CONFIG; "
                       "default: the packaged example profiles)")
    serve.add_argument("--default-profile", help="profile for requests that name none (env "
                       "TOOLQUAKE_DEFAULT_PROFILE; default 'off')")
    serve.add_argument("--token-counter", help="'estimate', 'upstream' or 'tokenizer:/path/tokenizer.json' "
                       "(env TOOLQUAKE_TOKEN_COUNTER)")
    serve.add_argument("--corpus", metavar="DIR", help="where the BFCL corpus is: a toolquake cache dir or the "
                       "data dir `toolquake corpus path` prints ([scoring] corpus; default: the pull cache)")
    serve.add_argument("--no-scoring", action="store_true", help="do not score answers, count verdicts or "
                       "store results ([scoring] enabled = false); X-Toolquake-Case still reaches the perturbers")
    serve.add_argument("--no-content-match", action="store_true", help="tie requests to cases only by the "
                       "X-Toolquake-Case header, never by the hash of the first user message ([scoring] "
                       "match_content = false)")
    serve.add_argument("--results-db", metavar="PATH", help="SQLite results store, or 'off' ([scoring] store; "
                       "default: results.sqlite in the cache dir)")
    serve.add_argument("--store-contents", action="store_true", help="also keep request and answer bodies in "
                       "the results store ([scoring] store_contents; off by default)")
    serve.set_defaults(func=cmd_serve)

    perturb = sub.add_parser("perturb", help="dry run: print a perturbed request",
                             description="Apply a profile to one request without sending it: the perturbed "
                                         "body (JSON) goes to stdout, what was applied to stderr.")
    perturb.add_argument("--config", help="TOML config file with the profile (default: the packaged profiles)")
    perturb.add_argument("--profile", required=True, help="profile to apply")
    src = perturb.add_mutually_exclusive_group(required=True)
    src.add_argument("--request", help="chat-completions request body (JSON file, or - for stdin)")
    src.add_argument("--case", help="BFCL case id (needs `toolquake corpus pull`)")
    perturb.add_argument("--seed", type=int, help="seed for the perturbers' randomness (default: hash of the body)")
    perturb.add_argument("--upstream", help="backend base URL, used by the 'upstream' token counter")
    perturb.set_defaults(func=cmd_perturb)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
