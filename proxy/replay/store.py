"""The results file of one replay (one shard): one SQLite row per (case, profile, trial), committed exactly once.

A scored row is final; an error row is replaced by the next attempt (and `attempts` counts them). A request
that failed on the backend's side is a scored row with its `error_code` (proxy/replay/failures.py); one the
backend refused for its shape is a scored row without a verdict, `error_type` `not_comparable` (final, in no
number: `row_status`).
The verdict columns are the live results store's (`VERDICT_COLUMNS`), encoded the same way.
`trial` is 0 without `--trials`; schema 1 files (keyed (case, profile), before `--trials`) are
migrated in place when opened for writing (their rows become trial 0) and read as such by reports.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.live.results import VERDICT_COLUMNS, create_private, sql_value
from toolquake.proxy.replay.errors import ReplayError
from toolquake.proxy.replay.failures import NOT_COMPARABLE

SCHEMA_VERSION = 2


@dataclass
class Record:
    """One finished pair: scored (a verdict) or error (no verdict; retried on the next run)."""

    case_id: str
    profile: str
    category: str
    status: str  # "scored" | "error"
    trial: int = 0
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
    #: not stored: the run's warning when the backend refused the request for its shape (failures.REFUSALS)
    warning: str | None = None


#: the replay's own columns before and after the shared verdict columns
_KEY_COLUMNS = ("case_id", "profile", "trial", "category", "status")
_TAIL_COLUMNS = (("http_status", "INTEGER"), ("error_code", "TEXT"), ("error", "TEXT"), ("answer", "TEXT"),
                 ("perturbers", "TEXT"), ("request_id", "TEXT"), ("latency_ms", "REAL"), ("prompt_tokens", "INTEGER"),
                 ("completion_tokens", "INTEGER"))
_COLUMNS = (*_KEY_COLUMNS, *(c for c, _ in VERDICT_COLUMNS), *(c for c, _ in _TAIL_COLUMNS))
_JSON_COLUMNS = frozenset({"errors", "answer", "perturbers"})

_META = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS arms (profile TEXT PRIMARY KEY, spec TEXT NOT NULL);
"""
_RESULTS = f"""
CREATE TABLE IF NOT EXISTS results (
    case_id TEXT NOT NULL,
    profile TEXT NOT NULL,
    trial INTEGER NOT NULL DEFAULT 0,
    category TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('scored', 'error')),
    {", ".join(f"{c} {kind}" for c, kind in (*VERDICT_COLUMNS, *_TAIL_COLUMNS))},
    attempts INTEGER NOT NULL DEFAULT 1,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (case_id, profile, trial)
);
"""


def row_status(status: str, perturbers: str | None, error_type: str | None = None) -> str:
    """`not_comparable` for a scored pair the backend refused for its shape (failures.REFUSALS), `not_perturbed`
    for a scored pair that every applied step left unperturbed on purpose, else `status`. The one place a row's
    standing is decided: the report and the run's tallies both read it."""
    if status == "scored" and error_type == NOT_COMPARABLE:
        return NOT_COMPARABLE
    if status != "scored" or not perturbers or NOT_PERTURBED not in perturbers:
        return status
    try:
        data = json.loads(perturbers) or {}
        applied = data.get("applied")
    except (ValueError, AttributeError):
        return status
    if isinstance(applied, dict) and data.get(NOT_PERTURBED):  # a multi-turn case: no step was perturbed
        return NOT_PERTURBED
    if isinstance(applied, list) and applied and all(NOT_PERTURBED in (a.get("report") or {}) for a in applied):
        return NOT_PERTURBED
    return status


class ResultsFile:
    """The SQLite file of one replay (one shard). One writer: the replay's event-loop thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        create_private(path)  # 0600: it holds every answer (and the -wal / -shm files take its mode)
        self.db = sqlite3.connect(path, isolation_level=None, timeout=30.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        # a process crash never loses a committed row (only a power loss may lose the last ones)
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_META)
        version = self.meta().get("schema_version")
        if version == "1":
            self._migrate_from_1()
        elif version is not None and version != str(SCHEMA_VERSION):
            raise ReplayError(f"{path} has replay schema {version}; this toolquake writes {SCHEMA_VERSION}. "
                              "Use a new --out directory, or the toolquake that wrote it.")
        self.db.executescript(_RESULTS)
        self.set_meta({"schema_version": str(SCHEMA_VERSION)})

    def _migrate_from_1(self) -> None:
        """Schema 1 → 2: the results key gains `trial`; every existing row is trial 0. One transaction."""
        cols = [r[1] for r in self.db.execute("PRAGMA table_info(results)")]
        keep = ", ".join(c for c in cols if c != "trial")
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("ALTER TABLE results RENAME TO results_v1")
            self.db.execute(_RESULTS.strip().replace("CREATE TABLE IF NOT EXISTS", "CREATE TABLE"))  # one statement
            self.db.execute(f"INSERT INTO results({keep}, trial) SELECT {keep}, 0 FROM results_v1")
            self.db.execute("DROP TABLE results_v1")
            self.db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

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
        specs = {n: json.loads(json.dumps(s)) for n, s in specs.items()}  # as stored: tuples are lists in JSON
        for name, spec in specs.items():
            if name in stored and stored[name] != spec:
                raise ReplayError(f"profile {name!r} is defined differently from the one in {self.path} "
                                  f"(stored {json.dumps(stored[name])}, now {json.dumps(spec)}): "
                                  "use another --out directory, or restore the old definition")
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO arms(profile, spec) VALUES(?, ?)",
                                [(n, json.dumps(s, sort_keys=True)) for n, s in specs.items()])

    def scored_pairs(self) -> set[tuple[str, str, int]]:
        """(case_id, profile, trial) of every scored row."""
        return set(self.db.execute("SELECT case_id, profile, trial FROM results WHERE status = 'scored'").fetchall())

    def verdicts(self) -> dict[tuple[str, str, int], bool]:
        """(case_id, profile, trial) → valid, of every scored row with a verdict (not the not-comparable ones)."""
        return {(c, p, t): bool(v) for c, p, t, v in
                self.db.execute("SELECT case_id, profile, trial, valid FROM results WHERE status = 'scored' AND "
                                "(error_type IS NULL OR error_type != ?)", (NOT_COMPARABLE,))}

    def not_comparable(self) -> set[tuple[str, str, int]]:
        """(case_id, profile, trial) of every pair the backend refused for its shape (final, no verdict)."""
        return set(self.db.execute("SELECT case_id, profile, trial FROM results WHERE status = 'scored' AND "
                                   "error_type = ?", (NOT_COMPARABLE,)).fetchall())

    def tallies(self) -> dict[str, tuple[int, int]]:
        """profile → (scored, valid), pairs left unperturbed on purpose not counted (as in the report)."""
        out: dict[str, tuple[int, int]] = {}
        for p, valid, perturbers, error_type in self.db.execute("SELECT profile, valid, perturbers, error_type "
                                                                "FROM results WHERE status = 'scored'"):
            if row_status("scored", perturbers, error_type) == "scored":
                n, v = out.get(p, (0, 0))
                out[p] = (n + 1, v + int(bool(valid)))
        return out

    def record(self, rec: Record) -> None:
        """Commit one (case, profile, trial). A scored row is final; an error row is replaced by the next attempt."""
        values = [sql_value(getattr(rec, c), c in _JSON_COLUMNS) for c in _COLUMNS]
        cols = ", ".join(_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[3:])
        with self.db:
            self.db.execute(
                f"INSERT INTO results({cols}, recorded_at) VALUES({', '.join('?' * len(_COLUMNS))}, ?) "
                f"ON CONFLICT(case_id, profile, trial) DO UPDATE SET {updates}, attempts = results.attempts + 1, "
                "recorded_at = excluded.recorded_at WHERE results.status = 'error'",
                [*values, time.time()])

    def close(self) -> None:
        self.db.close()
