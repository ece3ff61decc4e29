"""Replay: BFCL cases × profiles sent through the proxy, verdicts recorded in SQLite, resumable.

Every (case, profile) pair is one chat-completions request to `/p/<profile>/v1` with the header
`X-Toolquake-Case: <id>`, sent over real HTTP to the proxy — one started in this process on a free
loopback port (the default), or an external one (`--proxy URL`). The answer is graded by the same
code as live scoring (`proxy.scoring.Grader`: BFCL's verdict, `fair`, optionally `semantic`; a
`tool_removal` that took the expected tool away turns the case into an irrelevance case; a
`format_rewrite` answer is graded on its strict and lenient decodes).

Exactly-once: each finished pair is one SQLite transaction keyed by (case_id, profile). A rerun
with the same `--out` skips scored pairs and retries failed ones; a pair in flight when the process
was killed was never committed and is simply sent again.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

SCHEMA_VERSION = 1
CASE_HEADER = "X-Toolquake-Case"
#: named groups of profiles for `--profiles` (`@name`); patterns are expanded against the config
PRESETS: dict[str, list[str]] = {
    # seed 001 Table 2: original / rephrased query / expanded toolkit (run it on `multiple`)
    "seed001": ["off", "rephrased", "expanded"],
    # seed 003 challenge 1: catalog padded to 5 budgets × 5 positions of the original tools
    "seed003": ["off", "pad-*"],
    # seed 002: the 26 format configurations of BFCL V4 format sensitivity
    "seed002": ["fmt-*"],
    "tool_order": ["off", "shuffled", "reversed"],
    "tool_removal": ["off", "no-target-tool", "random-tool-removed"],
}
#: this many connection failures in a row means the backend (or proxy) is down: stop, resume later
MAX_CONSECUTIVE_UNREACHABLE = 25


class ReplayError(RuntimeError):
    """A replay that cannot start or go on (unreachable backend, bad arguments, a foreign results file)."""


# ---------------------------------------------------------------------------------------------
# what to run


def parse_shard(text: str | None, env: dict[str, str] | None = None) -> tuple[int, int] | None:
    """`I/N` → (I, N); `N` alone takes I from JOB_COMPLETION_INDEX (a Kubernetes Indexed Job)."""
    if text is None or text == "":
        return None
    env = os.environ if env is None else env
    index_text, sep, count_text = text.partition("/")
    if not sep:
        index_text, count_text = env.get("JOB_COMPLETION_INDEX", ""), text
        if index_text == "":
            raise ReplayError(f"--shard {text}: give I/N, or set JOB_COMPLETION_INDEX for the index")
    try:
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise ReplayError(f"--shard {text!r}: expected I/N with integers, e.g. 0/8") from None
    if count < 1 or not 0 <= index < count:
        raise ReplayError(f"--shard {text!r}: need 0 <= I < N")
    return index, count


def expand_profiles(spec: str, known: list[str]) -> list[str]:
    """Comma-separated profile names, shell patterns (`pad-*`) and presets (`@seed001`), in order, once each."""
    out: list[str] = []
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ReplayError("--profiles is empty")
    for item in items:
        if item.startswith("@"):
            group = PRESETS.get(item[1:])
            if group is None:
                raise ReplayError(f"unknown preset {item!r} (presets: {', '.join('@' + p for p in PRESETS)})")
            names = [n for pattern in group for n in _match(pattern, known, item)]
        else:
            names = _match(item, known, item)
        out.extend(n for n in names if n not in out)
    return out


def _match(pattern: str, known: list[str], asked: str) -> list[str]:
    if any(c in pattern for c in "*?["):
        names = [n for n in known if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ReplayError(f"{asked!r}: no profile matches {pattern!r}")
        return names
    if pattern not in known:
        raise ReplayError(f"unknown profile {pattern!r} (known: {', '.join(known)})")
    return [pattern]


def select_cases(categories: list[str], limit: int | None, shard: tuple[int, int] | None) -> list[Any]:
    """The first `limit` cases of each category (file order), then every N-th from index I for a shard."""
    from proxy.scoring import scorable_categories
    from scorers.corpus import MULTI_TURN_CATEGORIES, load_category

    allowed = scorable_categories() + MULTI_TURN_CATEGORIES  # multi-turn: proxy/multiturn.py
    cases: list[Any] = []
    for name in categories:
        if name not in allowed:
            raise ReplayError(f"category {name!r} cannot be replayed (categories: {', '.join(allowed)})")
        items = load_category(name)
        cases.extend(items if limit is None else items[:limit])
    if shard is not None:
        index, count = shard
        cases = cases[index::count]
    return cases


def results_name(shard: tuple[int, int] | None) -> str:
    return "replay.sqlite" if shard is None else f"replay-shard-{shard[0]}-of-{shard[1]}.sqlite"


# ---------------------------------------------------------------------------------------------
# the results file


@dataclass
class Record:
    """One finished pair: scored (a verdict) or error (no verdict; retried on the next run)."""

    case_id: str
    profile: str
    category: str
    status: str  # "scored" | "error"
    expected: str | None = None
    valid: bool | None = None
    error_type: str | None = None
    taxonomy: str | None = None
    errors: list[str] = field(default_factory=list)
    fair_valid: bool | None = None
    semantic_valid: bool | None = None
    http_status: int | None = None
    error_code: str | None = None
    error: str | None = None
    answer: dict[str, Any] | None = None
    perturbers: dict[str, Any] | None = None
    request_id: str | None = None
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


_COLUMNS = ("case_id", "profile", "category", "status", "expected", "valid", "error_type", "taxonomy", "errors",
            "fair_valid", "semantic_valid", "http_status", "error_code", "error", "answer", "perturbers",
            "request_id", "latency_ms", "prompt_tokens", "completion_tokens")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS arms (profile TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    case_id TEXT NOT NULL,
    profile TEXT NOT NULL,
    category TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('scored', 'error')),
    expected TEXT,
    valid INTEGER,
    error_type TEXT,
    taxonomy TEXT,
    errors TEXT,
    fair_valid INTEGER,
    semantic_valid INTEGER,
    http_status INTEGER,
    error_code TEXT,
    error TEXT,
    answer TEXT,
    perturbers TEXT,
    request_id TEXT,
    latency_ms REAL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    attempts INTEGER NOT NULL DEFAULT 1,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (case_id, profile)
);
"""


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))


class ResultsFile:
    """The SQLite file of one replay (one shard). One writer: the replay's event-loop thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        # a process crash never loses a committed row (only a power loss may lose the last ones)
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        version = self.meta().get("schema_version")
        if version is not None and version != str(SCHEMA_VERSION):
            raise ReplayError(f"{path} has replay schema {version}; this toolquake writes {SCHEMA_VERSION}. "
                              "Use a new --out directory.")
        self.set_meta({"schema_version": str(SCHEMA_VERSION)})

    def meta(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT key, value FROM meta").fetchall())

    def set_meta(self, values: dict[str, str]) -> None:
        with self.db:
            self.db.executemany("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET "
                                "value = excluded.value", list(values.items()))

    def claim(self, model: str, backend: str) -> None:
        """Tie the file to one model; a resume against another model is refused."""
        meta = self.meta()
        if "model" in meta and meta["model"] != model:
            raise ReplayError(f"{self.path} holds results for model {meta['model']!r}, not {model!r}: "
                              "use another --out directory (or pass --model to match)")
        values = {"model": model, "backend": backend}
        if "created_at" not in meta:
            values["created_at"] = f"{time.time():.3f}"
        self.set_meta(values)

    def register_arms(self, specs: dict[str, dict[str, Any]]) -> None:
        """Record each profile's definition; a profile whose definition changed since is refused."""
        stored = {p: json.loads(s) for p, s in self.db.execute("SELECT profile, spec FROM arms")}
        for name, spec in specs.items():
            if name in stored and stored[name] != spec:
                raise ReplayError(f"profile {name!r} is defined differently from the one in {self.path} "
                                  f"(stored {json.dumps(stored[name])}, now {json.dumps(spec)}): "
                                  "use another --out directory, or restore the old definition")
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO arms(profile, spec) VALUES(?, ?)",
                                [(n, json.dumps(s, sort_keys=True)) for n, s in specs.items()])

    def scored_pairs(self) -> set[tuple[str, str]]:
        return set(self.db.execute("SELECT case_id, profile FROM results WHERE status = 'scored'").fetchall())

    def tallies(self) -> dict[str, tuple[int, int]]:
        """profile → (scored, valid)."""
        rows = self.db.execute("SELECT profile, COUNT(*), SUM(valid) FROM results WHERE status = 'scored' "
                               "GROUP BY profile").fetchall()
        return {p: (n, int(v or 0)) for p, n, v in rows}

    def record(self, rec: Record) -> None:
        """Commit one pair. A scored row is final; an error row is replaced by the next attempt."""
        values = [getattr(rec, c) for c in _COLUMNS]
        for i, c in enumerate(_COLUMNS):
            if c in ("errors", "answer", "perturbers"):
                values[i] = _json(values[i])
            elif c in ("valid", "fair_valid", "semantic_valid") and values[i] is not None:
                values[i] = int(bool(values[i]))
        cols = ", ".join(_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[2:])
        with self.db:
            self.db.execute(
                f"INSERT INTO results({cols}, recorded_at) VALUES({', '.join('?' * len(_COLUMNS))}, ?) "
                f"ON CONFLICT(case_id, profile) DO UPDATE SET {updates}, attempts = results.attempts + 1, "
                "recorded_at = excluded.recorded_at WHERE results.status = 'error'",
                [*values, time.time()])

    def close(self) -> None:
        self.db.close()


# ---------------------------------------------------------------------------------------------
# the proxy, in this process


class InProcessProxy:
    """`create_app` served by uvicorn on a free loopback port, in a thread of this process.

    Replay runs each profile strictly (a perturber that fails fails the pair, which is recorded as
    an error and retried) unless `fail_open`; live scoring is off (replay grades the answers itself),
    and each finished exchange is kept by request id so that grading sees what the perturbers did.
    """

    def __init__(self, config: Any, *, fail_open: bool = False) -> None:
        from proxy.config import ScoringConfig

        profiles = config.profiles if fail_open else {
            name: msgspec.structs.replace(spec, strict=True) for name, spec in config.profiles.items()}
        scoring = msgspec.structs.replace(config.scoring if isinstance(config.scoring, ScoringConfig)
                                          else ScoringConfig(), enabled=False, match_content=False)
        self.config = msgspec.structs.replace(config, profiles=profiles, scoring=scoring)
        self.exchanges: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _observe(self, ex: Any) -> None:
        with self._lock:
            self.exchanges[ex.request_id] = ex

    def take(self, request_id: str | None) -> Any:
        if not request_id:
            return None
        with self._lock:
            return self.exchanges.pop(request_id, None)

    def start(self, timeout: float = 30.0) -> str:
        import uvicorn

        from proxy.app import create_app

        app = create_app(self.config, state_hook=lambda st: st.observers.append(self._observe))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                     timeout_graceful_shutdown=5, server_header=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="toolquake-replay-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ReplayError("the in-process proxy did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)


# ---------------------------------------------------------------------------------------------
# progress


class Progress:
    """Progress per arm with ETA and running accuracy: a rich live display on a terminal, lines otherwise."""

    def __init__(self, arms: list[str], totals: dict[str, int], done: dict[str, tuple[int, int]],
                 enabled: bool = True, stream: Any = None) -> None:
        self.arms = arms
        self.totals = totals
        self.tally = {a: list(done.get(a, (0, 0))) for a in arms}
        self.failed = {a: 0 for a in arms}
        self.stream = stream or sys.stderr
        self.todo = sum(totals.values()) - sum(n for n, _ in self.tally.values())
        self.finished = 0
        self._rich = None
        self._next_line = 0.0
        self._t0 = time.monotonic()
        if not enabled:
            self.stream = None
            return
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._rich = RichProgress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                      TimeRemainingColumn(), console=Console(file=self.stream), transient=False)
            self._overall = self._rich.add_task("all pairs", total=max(self.todo, 0), acc="")
            self._tasks = {a: self._rich.add_task(a, total=totals.get(a, 0), completed=self.tally[a][0],
                                                  acc=self._acc(a)) for a in arms}

    def _acc(self, arm: str) -> str:
        n, v = self.tally[arm]
        text = f"acc {v / n:.3f} (n={n})" if n else "acc -"
        return text + (f" failed {self.failed[arm]}" if self.failed[arm] else "")

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        elif self.stream is not None:
            print(f"replay: {self.todo} pairs to send", file=self.stream, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.stream is not None and self.finished < self.todo:
            self._line(force=True)

    def advance(self, arm: str, valid: bool | None) -> None:
        self.finished += 1
        if valid is None:
            self.failed[arm] += 1
        else:
            self.tally[arm][0] += 1
            self.tally[arm][1] += int(valid)
        if self._rich is not None:
            self._rich.update(self._tasks[arm], completed=self.tally[arm][0] + self.failed[arm], acc=self._acc(arm))
            self._rich.advance(self._overall)
        elif self.stream is not None:
            self._line()

    def _line(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_line and self.finished < self.todo:
            return
        self._next_line = now + 10.0
        rate = self.finished / max(now - self._t0, 1e-9)
        eta = (self.todo - self.finished) / rate if rate > 0 else float("inf")
        arms = "; ".join(f"{a} {self._acc(a)}" for a in self.arms)
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        print(f"replay: {self.finished}/{self.todo} pairs, ETA {eta_text} | {arms}", file=self.stream, flush=True)


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Options:
    backend: str | None
    profiles: str
    out: Path
    config: str | None = None
    categories: list[str] = field(default_factory=lambda: ["multiple"])
    limit: int | None = None
    concurrency: int = 4
    model: str | None = None
    shard: tuple[int, int] | None = None
    proxy: str | None = None
    timeout: float = 600.0
    temperature: float | None = 0.0
    max_tokens: int | None = None
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    semantic: bool = False
    fail_open: bool = False
    progress: bool = True


@dataclass
class Summary:
    path: Path
    model: str
    arms: list[str]
    sent: int = 0
    skipped: int = 0
    failed: int = 0
    aborted: str | None = None
    tallies: dict[str, tuple[int, int]] = field(default_factory=dict)


def _check_reachable(url: str, what: str, headers: dict[str, str]) -> httpx.Response:
    try:
        return httpx.get(url, timeout=10.0, headers=headers, trust_env=False)
    except httpx.HTTPError as exc:
        raise ReplayError(f"cannot reach the {what} at {url} ({type(exc).__name__}: {exc}). Start it first "
                          "(for the embedded model: `toolquake backend local`), or fix the URL.") from None


def discover_model(backend: str, headers: dict[str, str]) -> str:
    r = _check_reachable(f"{backend.rstrip('/')}/models", "backend", headers)
    if r.status_code >= 400:
        raise ReplayError(f"the backend at {backend} answered GET /models with {r.status_code}: {r.text[:200]}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(f"the backend at {backend} lists no model on GET /models: pass --model") from None


def _auth(options: Options) -> dict[str, str]:
    headers = dict(options.headers)
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    return headers


def _profile_specs(config: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each profile as replayed: mode, and each perturber with all its parameters (defaults included)."""
    from perturbers import build

    out = {}
    for name in names:
        spec = config.profiles.get(name)
        if spec is None:
            out[name] = {"mode": "off", "perturbers": []}
            continue
        steps = [{"name": p.name, "params": msgspec.to_builtins(build(p.name, p.params).params()),
                  "probability": p.probability} for p in spec.perturbers]
        out[name] = {"mode": spec.mode, "perturbers": steps}
    return out


def prepare(options: Options) -> tuple[Any, list[str], list[Any]]:
    """Load the config, expand the profiles, select the cases: everything that can fail before sending."""
    from proxy.config import ConfigError, load_config

    try:
        config = load_config(options.config or os.environ.get("TOOLQUAKE_CONFIG") or None,
                             overrides={"upstream": options.backend, "read_timeout": options.timeout})
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None
    known = ["off", *config.profiles]
    arms = expand_profiles(options.profiles, known)
    try:
        cases = select_cases(options.categories, options.limit, options.shard)
    except FileNotFoundError as exc:
        raise ReplayError(str(exc)) from None
    return config, arms, cases


async def _send_all(options: Options, proxy_url: str, pairs: list[tuple[Any, str]], results: ResultsFile,
                    progress: Progress, model: str, in_process: InProcessProxy | None,
                    summary: Summary) -> None:
    from proxy.scoring import Grader
    from scorers.corpus import case_request

    grader = Grader(semantic=options.semantic)
    headers = _auth(options)
    queue: asyncio.Queue[tuple[Any, str]] = asyncio.Queue()
    for pair in pairs:
        queue.put_nowait(pair)
    state = {"unreachable": 0}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:

        async def multi_turn(case: Any, profile: str) -> Record:
            """A multi-turn case: a whole conversation through the proxy, scored by BFCL's multi-turn checker."""
            from proxy.multiturn import replay_fields

            extra = {k: v for k, v in (("temperature", options.temperature), ("max_tokens", options.max_tokens))
                     if v is not None}
            fields = await replay_fields(case, f"{proxy_url}/p/{profile}/v1", model=model, client=client,
                                         headers=headers, extra_body=extra,
                                         take=in_process.take if in_process is not None else None)
            return Record(case_id=case.id, profile=profile, category=case.category, **fields)

        async def one(case: Any, profile: str) -> Record:
            if case.is_multi_turn:
                return await multi_turn(case, profile)
            body = case_request(case, model=model)
            if options.temperature is not None:
                body["temperature"] = options.temperature
            if options.max_tokens is not None:
                body["max_tokens"] = options.max_tokens
            rec = Record(case_id=case.id, profile=profile, category=case.category, status="error")
            t0 = time.perf_counter()
            try:
                r = await client.post(f"{proxy_url}/p/{profile}/v1/chat/completions", json=body,
                                      headers={**headers, CASE_HEADER: case.id})
            except httpx.TimeoutException as exc:
                rec.error_code, rec.error = "timeout", f"{type(exc).__name__}: no answer in {options.timeout:.0f} s"
                return rec
            except httpx.HTTPError as exc:
                rec.error_code, rec.error = "unreachable", f"{type(exc).__name__}: {exc}"[:500]
                return rec
            rec.latency_ms = (time.perf_counter() - t0) * 1000
            rec.http_status = r.status_code
            rec.request_id = r.headers.get("x-toolquake-request-id")
            ex = in_process.take(rec.request_id) if in_process is not None else None
            if ex is not None and ex.outcome is not None:
                rec.perturbers = {"applied": [{"name": a.name, "params": a.params, "report": a.report}
                                              for a in ex.outcome.applied],
                                  "skipped": list(ex.outcome.skipped), "failed": list(ex.outcome.failed)}
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if r.status_code != 200 or not isinstance(answer, dict):
                err = (answer or {}).get("error") if isinstance(answer, dict) else None
                err = err if isinstance(err, dict) else {}
                rec.error_code = str(err.get("code") or f"http_{r.status_code}")
                rec.error = str(err.get("message") or r.text)[:500]
                return rec
            rec.answer = answer
            usage = answer.get("usage") or {}
            rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            applied = list(ex.outcome.applied) if ex is not None and ex.outcome is not None else []
            restorers = list(ex.outcome.restorers) if ex is not None and ex.outcome is not None else []
            try:
                grade = await asyncio.to_thread(grader.grade, case, answer, applied, restorers)
            except Exception as exc:  # a scorer bug costs this pair only; it is retried on the next run
                rec.error_code, rec.error = "scorer_error", f"{type(exc).__name__}: {exc}"[:500]
                return rec
            rec.status = "scored"
            rec.expected, rec.valid, rec.error_type, rec.taxonomy = (grade.expected, grade.valid, grade.error_type,
                                                                     grade.taxonomy)
            rec.errors, rec.fair_valid, rec.semantic_valid = list(grade.errors), grade.fair_valid, grade.semantic_valid
            return rec

        async def worker() -> None:
            while not stop.is_set():
                try:
                    case, profile = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                rec = await one(case, profile)
                results.record(rec)
                summary.sent += 1
                if rec.status == "error":
                    summary.failed += 1
                progress.advance(profile, rec.valid if rec.status == "scored" else None)
                if rec.error_code == "unreachable":
                    state["unreachable"] += 1
                    if state["unreachable"] >= MAX_CONSECUTIVE_UNREACHABLE:
                        summary.aborted = (f"{MAX_CONSECUTIVE_UNREACHABLE} requests in a row could not reach "
                                           f"the proxy or backend ({rec.error}); stopped. Rerun the same command "
                                           "to resume.")
                        stop.set()
                else:
                    state["unreachable"] = 0

        await asyncio.gather(*(worker() for _ in range(max(1, options.concurrency))))


def run(options: Options, log: Callable[[str], None] | None = None) -> Summary:
    """Check the backend, plan the pairs, send what is left, record everything; returns a summary."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if options.concurrency < 1:
        raise ReplayError("--concurrency must be at least 1")
    if options.backend is None and options.proxy is None:
        raise ReplayError("give --backend URL (and optionally --proxy URL)")
    headers = _auth(options)
    # reachability first: a clear error before anything else happens
    if options.proxy:
        r = _check_reachable(f"{options.proxy.rstrip('/')}/readyz", "proxy", {})
        if r.status_code != 200:
            raise ReplayError(f"the proxy at {options.proxy} is up but not ready ({r.status_code}: {r.text[:200]}): "
                              "is its backend running?")
    model = options.model
    if options.backend:
        if model is None:
            model = discover_model(options.backend, headers)
        else:  # any HTTP answer will do: the backend is up
            _check_reachable(f"{options.backend.rstrip('/')}/models", "backend", headers)
    model = model or "default"
    config, arms, cases = prepare(options)
    if not cases:
        raise ReplayError("no cases selected (check --categories, --limit and --shard)")
    out = Path(options.out)
    results = ResultsFile(out / results_name(options.shard))
    try:
        results.claim(model, options.backend or options.proxy or "")
        results.register_arms(_profile_specs(config, arms))
        results.set_meta({"categories": ",".join(options.categories), "limit": str(options.limit or ""),
                          "shard": "" if options.shard is None else f"{options.shard[0]}/{options.shard[1]}"})
        done = results.scored_pairs()
        pairs = [(c, p) for c in cases for p in arms if (c.id, p) not in done]
        summary = Summary(path=results.path, model=model, arms=arms, skipped=len(cases) * len(arms) - len(pairs))
        if options.proxy and any(_changes_expectation(config, p) for p in arms):
            say("replay: note: with --proxy, what the perturbers did is not visible here; arms that remove the "
                "expected tool or rewrite the answer format are graded on the client's answer only")
        say(f"replay: {len(cases)} cases × {len(arms)} profiles, model {model!r}; {summary.skipped} pairs already "
            f"scored in {results.path}")
        if pairs:
            in_process = None
            proxy_url = options.proxy.rstrip("/") if options.proxy else None
            if proxy_url is None:
                in_process = InProcessProxy(config, fail_open=options.fail_open)
                proxy_url = in_process.start()
            totals = {a: len(cases) for a in arms}
            tallies = results.tallies()
            try:
                with Progress(arms, totals, tallies, enabled=options.progress) as progress:
                    asyncio.run(_send_all(options, proxy_url, pairs, results, progress, model, in_process, summary))
            finally:
                if in_process is not None:
                    in_process.stop()
        summary.tallies = results.tallies()
        return summary
    finally:
        results.close()


def _changes_expectation(config: Any, profile: str) -> bool:
    spec = config.profiles.get(profile)
    return spec is not None and any(p.name in ("tool_removal", "format_rewrite") for p in spec.perturbers)


def iter_tallies(summary: Summary) -> Iterable[tuple[str, int, int]]:
    for arm in summary.arms:
        n, v = summary.tallies.get(arm, (0, 0))
        yield arm, n, v
