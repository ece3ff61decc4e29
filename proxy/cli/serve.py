"""`toolquake serve`: run the proxy, with live scoring and the recorder attached (and the tracing wing, when
`[tracing] enabled`)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

import msgspec
import structlog

from toolquake.proxy.cli.common import config_from_args
from toolquake.proxy.server.config import Config

#: seconds a worker gives its in-flight requests and streams to finish after SIGTERM
GRACEFUL_S = 5
#: gc's first threshold in a serving process (Python's default: 700); see tune_gc
GC_YOUNG = 10_000
#: open files a worker may need besides its client connections and its upstream pool (logs, the recording,
#: the results store, metrics files, the listening socket, model files)
SPARE_FILES = 256


def check_token_counter(spec: str) -> None:
    """A local tokenizer (`tiktoken:`, `tokenizer:`) that cannot be loaded is refused before serving, with why."""
    if spec.startswith(("tiktoken:", "tokenizer:")):
        from toolquake.perturbers.helpers.tokens import make_counter

        try:
            make_counter(spec)
        except ValueError as exc:
            sys.exit(f"toolquake: {exc}")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from toolquake.proxy.live import recording
    from toolquake.proxy.server import logs, workers
    from toolquake.proxy.server.app import create_app
    from toolquake.proxy.server.lean import lean_protocol
    from toolquake.proxy.server.limits import limited_protocol, rejection_counter

    config = config_from_args(args, upstream=args.upstream, host=args.host, port=args.port,
                              default_profile=args.default_profile, token_counter=args.token_counter,
                              workers=args.workers, body_timeout=args.body_timeout)
    config = apply_cli(config, corpus=args.corpus, no_scoring=args.no_scoring, results_db=args.results_db,
                       store_contents=args.store_contents, no_content_match=args.no_content_match,
                       cases=args.cases, record=args.record)
    server = config.server
    n = server.workers or workers.default_workers()
    logs.configure(server.log_level, worker_pid=n > 1)
    if server.default_profile != "off" and server.default_profile not in config.profiles:
        sys.exit(f"toolquake: default profile {server.default_profile!r} is not defined in the config "
                 f"(defined: off, {', '.join(sorted(config.profiles))})")
    recording.prepare_or_exit(config.record)  # a file that is not a recording: refused before serving (#28)
    extensions = extensions_of(config)
    check_token_counter(server.token_counter)
    raise_open_files(server.max_client_connections + server.max_connections + SPARE_FILES)
    admin_token = os.environ.get("TOOLQUAKE_ADMIN_TOKEN") or None

    def uvicorn_config(app: Any) -> uvicorn.Config:
        protocol = lean_protocol(app) if server.lean_path and server.lean_protocol else None
        # where the lean path runs: inside the HTTP protocol, as ASGI ahead of the framework, or not at all
        log = structlog.get_logger("toolquake.proxy")
        log.info("lean_path", served_in="protocol" if protocol else "asgi" if server.lean_path else "off")
        limited = limited_protocol(protocol or HttpToolsProtocol, server, rejection_counter(app))
        if limited is None:  # pragma: no cover - an uvicorn whose protocol lacks the hooks the limits use
            log.warning("connection_limits_off", reason="this uvicorn's HTTP protocol lacks the hooks they use")
        return uvicorn.Config(app, host=server.host, port=server.port, loop="uvloop",
                              http=limited or protocol or "httptools", log_level="warning", access_log=False,
                              timeout_graceful_shutdown=GRACEFUL_S, server_header=False,
                              timeout_keep_alive=server.keep_alive_timeout, proxy_headers=False)

    try:
        sock = workers.listen(server.host, server.port)
    except OSError as exc:
        sys.exit(f"toolquake: cannot listen on {server.host}:{server.port}: {exc}")
    # the port it got (`--port 0`: any free one, picked by the kernel), for whoever started it
    port = sock.getsockname()[1]
    host = f"[{server.host}]" if ":" in server.host else server.host
    structlog.get_logger("toolquake.proxy").info("listening", host=server.host, port=port,
                                                 url=f"http://{host}:{port}")
    if n == 1:
        app = create_app(config, admin_token=admin_token, extensions=extensions)
        tune_gc()
        uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
        return 0
    runtime = workers.Runtime.create()
    workers.use_multiprocess_metrics(runtime.metrics)
    tune_gc()  # before the fork: the workers share these pages, and no collection writes to them

    def run_worker() -> None:  # in each forked worker: its own app, event loop and upstream pool
        app = create_app(config, admin_token=admin_token, extensions=extensions,
                         shared=runtime.root)
        tune_gc()
        uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])

    return workers.supervise(n, sock, run_worker, runtime, grace_s=GRACEFUL_S + 5)


def extensions_of(config: Config) -> list[Any]:
    """What `serve` attaches to the app: the tracing wing first when `[tracing] enabled` (its OTEL_* settings
    checked here, before serving; off, nothing of it is imported), then live scoring and the recorder."""
    from toolquake.proxy import live
    from toolquake.proxy.live import recording

    if not config.tracing.enabled:
        return [live.attach, recording.attach]
    from toolquake.proxy import tracing
    from toolquake.proxy.server.config import ConfigError

    try:
        tracing.make_tracer(config)
    except ConfigError as exc:
        sys.exit(f"toolquake: {exc}")
    return [tracing.attach, live.attach, recording.attach]


def raise_open_files(wanted: int) -> tuple[int, int]:
    """Raise the soft limit on open files towards `wanted` (a worker's client connections, its upstream pool and
    spare descriptors), never past the hard limit and never down. With the usual soft limit of 1,024 a worker
    would fail new connections with EMFILE long before `max_client_connections` answers them with a 503.
    Returns the (soft, hard) limits in force afterwards."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # pragma: no cover - a platform that refuses; the limits still hold
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        structlog.get_logger("toolquake.proxy").warning(
            "open_files_limit_low", soft=soft, hard=hard, wanted=wanted,
            hint="raise the hard limit (ulimit -Hn) or lower max_client_connections / max_connections")
    return soft, hard


def tune_gc() -> None:
    """Leave what start-up built (imports, the app, profiles, pools) out of the cyclic garbage collector's
    scans, and collect the young generation less often. Before this, collections were ~13 % of a
    unperturbed request's CPU time at 64 connections (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    # a young-generation collection after 10,000 net new container objects instead of 700: the objects of
    # 64 requests in flight alone passed 700 again and again (a collection every ~25 requests), while
    # nearly all of them are freed by reference counting
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


def apply_cli(config: Config, *, corpus: str | None = None, no_scoring: bool = False, results_db: str | None = None,
              store_contents: bool = False, no_content_match: bool = False, cases: list[str] | None = None,
              record: str | None = None) -> Config:
    """`toolquake serve` flags over the `[scoring]` and `[record]` sections."""
    if record:
        config = msgspec.structs.replace(config, record=msgspec.structs.replace(config.record, path=record))
    s = config.scoring
    changes: dict[str, Any] = {}
    if cases:
        changes["cases"] = [*s.cases, *cases]
    if corpus:
        changes["corpus"] = corpus
    if no_scoring:
        changes["enabled"] = False
    if results_db:
        changes["store"] = results_db
    if store_contents:
        changes["store_contents"] = True
    if no_content_match:
        changes["match_content"] = False
    return msgspec.structs.replace(config, scoring=msgspec.structs.replace(s, **changes)) if changes else config


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the proxy", description="Run the proxy server. Flags win over "
                           "environment variables (TOOLQUAKE_*), which win over the config file.")
    serve.add_argument("--upstream", help="the backend's OpenAI API base URL, e.g. http://127.0.0.1:8000/v1 "
                       "(env TOOLQUAKE_UPSTREAM; default from the config file)")
    serve.add_argument("--host", help="address to listen on (env TOOLQUAKE_HOST; default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (env TOOLQUAKE_PORT; default 8080; 0: any free "
                       "port, logged as the `listening` event's port)")
    serve.add_argument("--workers", type=int, metavar="N", help="worker processes sharing the port (env "
                       "TOOLQUAKE_WORKERS, [server] workers; default: one per CPU this process may use). Metrics "
                       "are summed over the workers and admin-API profile changes reach all of them; "
                       "1 for a sidecar")
    serve.add_argument("--body-timeout", type=float, metavar="SECONDS", help="seconds a client has to send a "
                       "request's whole body after its headers, else 408 and the connection is closed (env "
                       "TOOLQUAKE_BODY_TIMEOUT, [server] body_timeout; default 30)")
    serve.add_argument("--config", help="TOML config file with [server] and [profiles.*] (env TOOLQUAKE_CONFIG; "
                       "default: the packaged example profiles)")
    serve.add_argument("--default-profile", help="profile for requests that name none (env "
                       "TOOLQUAKE_DEFAULT_PROFILE; default 'off')")
    serve.add_argument("--token-counter", help="how token budgets are counted: 'estimate', 'upstream' (the backend's "
                       "/tokenize), 'auto', 'tiktoken:<encoding or /path/file.tiktoken>' (OpenAI models, e.g. "
                       "tiktoken:o200k_base for GPT-4o; files from `make tiktoken-files`, never downloaded) or "
                       "'tokenizer:/path/tokenizer.json' (env TOOLQUAKE_TOKEN_COUNTER)")
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
    serve.add_argument("--cases", action="append", metavar="FILE", help="a file of your own cases (JSON lines, "
                       "docs/own-cases.md), repeatable: requests are tied to them by X-Toolquake-Case or by the hash "
                       "of their conversation, and scored like BFCL cases ([scoring] cases)")
    serve.add_argument("--record", metavar="PATH", help="append each unperturbed exchange (request and final "
                       "answer) to this JSON-lines recording, off the request path ([record] path; the [record] "
                       "section sets the sample rate, profiles, size cap and redaction; docs/own-cases.md)")
    serve.set_defaults(func=run)
