"""The results store: one SQLite row per scored answer (WAL, versioned schema, migrations). The write side only.

Rows hold what was measured — request id, time, profile, perturbers and their parameters, case id,
verdicts, error types, consistency, latencies, token counts — and never message contents unless
`store_contents` is on. The report reads a store as one more source of the replay report
(proxy/replay/report/rows.py: `load(paths, db)`; `summarize_db(path)` is `toolquake report --db PATH
--format json`), so every statistic of live traffic is the replay report's.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from toolquake.perturbers.base import NOT_PERTURBED

#: the schema version this code writes; older files are migrated on open, newer ones refused
SCHEMA_VERSION = 4
BUSY_TIMEOUT_S = 60.0


def _v1(db: sqlite3.Connection) -> None:
    db.execute("""
        CREATE TABLE results (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            request_id TEXT NOT NULL,
            ts REAL NOT NULL,
            profile TEXT NOT NULL,
            mode TEXT NOT NULL,
            arm TEXT NOT NULL,
            model TEXT,
            stream INTEGER NOT NULL,
            status INTEGER NOT NULL,
            case_id TEXT,
            category TEXT,
            resolved_by TEXT,
            expected TEXT,
            perturbers TEXT NOT NULL,
            valid INTEGER,
            error_type TEXT,
            taxonomy TEXT,
            errors TEXT,
            fair_valid INTEGER,
            semantic_valid INTEGER,
            total_ms REAL,
            upstream_ms REAL,
            scoring_ms REAL,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            tokens_added INTEGER,
            request_body TEXT,
            response_body TEXT
        )""")
    db.execute("CREATE INDEX results_profile_category ON results (profile, category)")


def _v2(db: sqlite3.Connection) -> None:
    # shadow mode: the twin's agreement with the original answer, and which original it shadows
    db.execute("ALTER TABLE results ADD COLUMN agree TEXT")
    db.execute("ALTER TABLE results ADD COLUMN shadow_of TEXT")


def _v3(db: sqlite3.Connection) -> None:
    # the API the client spoke (chat_completions | responses), and its calls to tools the proxy added
    db.execute("ALTER TABLE results ADD COLUMN route TEXT")
    db.execute("ALTER TABLE results ADD COLUMN injected_calls TEXT")


def _v4(db: sqlite3.Connection) -> None:
    # backend conformance: one row per broken rule (docs/conformance.md); excerpt only with store_contents
    db.execute("""
        CREATE TABLE conformance (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            request_id TEXT NOT NULL,
            ts REAL NOT NULL,
            profile TEXT NOT NULL,
            model TEXT,
            route TEXT NOT NULL,
            stream INTEGER NOT NULL,
            rule TEXT NOT NULL,
            call_index INTEGER,
            detail TEXT NOT NULL,
            excerpt TEXT
        )""")
    db.execute("CREATE INDEX conformance_rule ON conformance (model, rule)")


#: MIGRATIONS[i] takes a database at version i to version i + 1
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2, _v3, _v4)

COLUMNS = ("request_id", "ts", "profile", "mode", "arm", "model", "stream", "status", "case_id", "category",
           "resolved_by", "expected", "perturbers", "valid", "error_type", "taxonomy", "errors", "fair_valid",
           "semantic_valid", "total_ms", "upstream_ms", "scoring_ms", "prompt_tokens", "completion_tokens",
           "tokens_added", "request_body", "response_body", "agree", "shadow_of", "route", "injected_calls")
_JSON_COLUMNS = ("perturbers", "errors", "request_body", "response_body", "injected_calls")
#: the verdict columns of every results table (this store and each replay file), with their SQL types;
#: a change here needs a migration in both
VERDICT_COLUMNS = (("expected", "TEXT"), ("valid", "INTEGER"), ("error_type", "TEXT"), ("taxonomy", "TEXT"),
                   ("errors", "TEXT"), ("fair_valid", "INTEGER"), ("semantic_valid", "INTEGER"))


def sql_value(value: Any, as_json: bool = False) -> Any:
    """A Python value as a results table stores it: JSON text for structured columns, booleans as 0/1."""
    if as_json:
        return None if value is None else json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))
    return int(value) if isinstance(value, bool) else value


class StoreError(RuntimeError):
    """A results file that cannot be used (newer schema, not a SQLite file, unwritable)."""


def default_path() -> Path:
    cache = os.environ.get("TOOLQUAKE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "toolquake")
    return Path(cache) / "results.sqlite"


def schema_version(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def migrate(db: sqlite3.Connection, migrations: Sequence[Callable[[sqlite3.Connection], None]] = MIGRATIONS) -> int:
    """Bring the file to the newest version, one step per transaction. Returns the version reached."""
    version = schema_version(db)
    if version > len(migrations):
        raise StoreError(f"results file has schema version {version}, newer than this toolquake understands "
                         f"({len(migrations)}); upgrade toolquake or use another --db / [scoring] store path")
    for target in range(version + 1, len(migrations) + 1):
        with db:
            db.execute("BEGIN IMMEDIATE")
            # another process may have migrated while we waited for the write lock
            if schema_version(db) >= target:
                continue
            migrations[target - 1](db)
            db.execute(f"PRAGMA user_version = {target}")
    return schema_version(db)


#: the mode of a results file this toolquake creates (and of SQLite's -wal / -shm files beside it, which take the
#: database file's mode): rows name models, profiles and cases, and with `store_contents` hold whole requests
PRIVATE_MODE = 0o600
_SIDE_FILES = ("-wal", "-shm", "-journal")


def create_private(path: Path) -> bool:
    """Create `path` empty, mode 0600 whatever the umask, unless it exists (True when created). SQLite then
    opens the empty file as a new database, and creates its -wal / -shm / -journal files with the same mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)
    return True


def make_private(path: Path) -> None:
    """Take group and other access away from an existing results file and its SQLite side files (a file written
    by a toolquake before 0600 was the rule); best effort: a file this user does not own stays as it is."""
    for p in (path, *(path.with_name(path.name + s) for s in _SIDE_FILES)):
        try:
            if p.stat().st_mode & 0o077:
                os.chmod(p, PRIVATE_MODE)
        except OSError:
            continue


def connect(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """Open (and for writers create and migrate) a results file."""
    path = Path(path)
    try:
        if readonly:
            if not path.exists():
                raise StoreError(f"no results file at {path}")
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S,
                                 check_same_thread=False)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            create_private(path)
            db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            migrate(db)
        if readonly and schema_version(db) > SCHEMA_VERSION:
            raise StoreError(f"results file {path} has schema version {schema_version(db)}, newer than "
                             f"this toolquake understands ({SCHEMA_VERSION})")
        return db
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"cannot use {path} as a results file: {exc}") from None


@dataclass
class Row:
    """One scored answer. `perturbers` is a list of {name, params, report}; bodies only with store_contents."""

    request_id: str
    profile: str
    mode: str
    arm: str
    model: str | None
    stream: bool
    status: int
    ts: float = field(default_factory=time.time)
    case_id: str | None = None
    category: str | None = None
    resolved_by: str | None = None
    expected: str | None = None
    perturbers: list[dict[str, Any]] = field(default_factory=list)
    valid: bool | None = None
    error_type: str | None = None
    taxonomy: str | None = None
    errors: list[str] | None = None
    fair_valid: bool | None = None
    semantic_valid: bool | None = None
    total_ms: float | None = None
    upstream_ms: float | None = None
    scoring_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_added: int | None = None
    request_body: Any = None
    response_body: Any = None
    agree: str | None = None
    shadow_of: str | None = None
    route: str | None = None
    #: names of tools the proxy added that the model called (None: none called)
    injected_calls: list[str] | None = None

    def values(self) -> tuple[Any, ...]:
        return tuple(sql_value(getattr(self, name), name in _JSON_COLUMNS) for name in COLUMNS)


class ResultsStore:
    """Appends rows to one SQLite file. Thread-safe; `append` blocks while another writer holds the lock."""

    def __init__(self, path: str | Path, *, store_contents: bool = False) -> None:
        self.path = Path(path)
        self.store_contents = store_contents
        self._db = connect(self.path)
        if store_contents:  # whole requests and answers: never readable by others, even in an older file
            make_private(self.path)
        self._lock = threading.Lock()
        self._sql = f"INSERT INTO results ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"

    def append(self, row: Row) -> None:
        if not self.store_contents:
            row.request_body = row.response_body = None
        values = row.values()
        with self._lock:
            self._db.execute(self._sql, values)

    def append_violations(self, rows: list[ConformanceRow]) -> None:
        """Conformance violations of one answer; their excerpts only with store_contents."""
        values = [(r.request_id, r.ts, r.profile, r.model, r.route, int(r.stream), r.rule, r.call_index, r.detail,
                   r.excerpt if self.store_contents else None) for r in rows]
        with self._lock:
            self._db.executemany("INSERT INTO conformance (request_id, ts, profile, model, route, stream, rule, "
                                 "call_index, detail, excerpt) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class ConformanceRow:
    """One rule a backend's answer broke (`detail` never holds message contents; `excerpt` may)."""

    request_id: str
    profile: str
    model: str | None
    route: str
    stream: bool
    rule: str
    detail: str
    call_index: int | None = None
    excerpt: str | None = None
    ts: float = field(default_factory=time.time)


def read_violations(path: str | Path) -> list[dict[str, Any]]:
    """Every conformance row of a results file, oldest first (none in a file older than schema 4)."""
    db = connect(path, readonly=True)
    try:
        if schema_version(db) < 4:
            return []
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM conformance ORDER BY id")]
    finally:
        db.close()


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a results file as a dict (JSON columns decoded), oldest first."""
    db = connect(path, readonly=True)
    try:
        db.row_factory = sqlite3.Row
        rows = []
        for r in db.execute("SELECT * FROM results ORDER BY id"):
            d = dict(r)
            for name in _JSON_COLUMNS:
                if d.get(name) is not None:
                    d[name] = json.loads(d[name])
            rows.append(d)
        return rows
    finally:
        db.close()


def not_perturbed(perturbers: Any) -> bool:
    """A row every applied step left unperturbed on purpose (e.g. a rephrasing rejected by the value check):
    the request went out unchanged, so its verdict is counted apart, out of the arm's accuracy."""
    steps = [s for s in perturbers if isinstance(s, dict)] if isinstance(perturbers, list) else []
    return bool(steps) and all(NOT_PERTURBED in (s.get("report") or {}) for s in steps)
