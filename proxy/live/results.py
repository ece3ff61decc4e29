"""The results store: one SQLite row per scored answer (WAL, versioned schema, migrations), and its summary.

Rows hold what was measured — request id, time, profile, perturbers and their parameters, case id,
verdicts, error types, consistency, latencies, token counts — and never message contents unless
`store_contents` is on. `summarize(path)` is what `toolquake report --db PATH` prints.
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
from toolquake.proxy.escape import md_text
from toolquake.proxy.live.anytime import Sequences, finite
from toolquake.proxy.server.config import NOISE_PROFILE
from toolquake.scorers.aggregate import ALPHA, mcnemar, paired_drop_ci, ratio, relative_drop, wilson_ci

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



def summarize(path: str | Path) -> dict[str, Any]:
    """Accuracy per profile × category with the relative drop against `off`, error types, consistency.

    Shape: {"db", "rows", "arms": {profile: {"n", "accuracy", "drop_vs_off", "by_category": {category:
    {"n", "accuracy", "drop_vs_off"}}, "errors": {taxonomy: count}, "semantic_flips", "not_perturbed",
    "perturbed_share"}},
    "consistency": {profile: {"n", "exact", "semantic", "disagree", "rate_exact", "rate_semantic"}}}.
    `drop_vs_off` = (acc - acc_off) / acc_off over the same category (null without an `off` baseline).
    Next to them: `accuracy_ci` (95 % Wilson), `errors_ci` (the Wilson interval of each error type's share
    of the failures), `drop_vs_off_ci` and `paired` (the arm against `off` on the case ids both scored, the
    latest verdict of each: {"n", "both_valid", "valid_to_invalid", "invalid_to_valid", "both_invalid",
    "p_value" (McNemar exact), "significant" (p < 0.05), "drop", "drop_ci"}; null for `off` or without
    it), and "consistency_ci": {profile: {"rate_exact": [lo, hi], "rate_semantic": [lo, hi]}}.
    The perturbed twins only: the unperturbed noise twins (`noise_rate`, arm "noise") are in "noise" and
    "noise_ci", the same shape, per profile they were sampled from plus "<noise>" for all of them pooled
    (the model's own nondeterminism, the floor under every profile's disagreement). "conformance":
    {model: {rule: violations}} from the conformance table. A scored row on which every applied step reported
    `not_perturbed` (the request went out unchanged) is counted in `not_perturbed`, apart: it is out of `n`,
    the accuracy and the paired comparison, as in the replay report; `perturbed_share` = n / (n + not_perturbed).
    """
    rows = read_rows(path)
    arms = _arm_counts(rows)
    _with_paired(arms, rows)
    consistency, consistency_ci = _agreement([r for r in rows if r["arm"] != "noise"])
    _with_anytime(arms, consistency_ci, rows)
    noise, noise_ci = _agreement([r for r in rows if r["arm"] == "noise"])
    if noise:
        pooled, pooled_ci = _agreement([{**r, "profile": NOISE_PROFILE} for r in rows if r["arm"] == "noise"])
        noise.update(pooled)
        noise_ci.update(pooled_ci)
    conformance: dict[str, dict[str, int]] = {}
    for v in read_violations(path):
        by_rule = conformance.setdefault(v["model"] or "none", {})
        by_rule[v["rule"]] = by_rule.get(v["rule"], 0) + 1
    return {"db": str(path), "rows": len(rows), "arms": dict(sorted(arms.items())),
            "consistency": consistency, "consistency_ci": consistency_ci, "noise": noise, "noise_ci": noise_ci,
            "conformance": {m: dict(sorted(r.items(), key=lambda kv: (-kv[1], kv[0])))
                            for m, r in sorted(conformance.items())}}


def _arm_counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per profile: scored rows, accuracy with its interval, per category, error types; rows not perturbed apart."""
    arms: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["valid"] is None:
            continue
        arm = arms.setdefault(r["profile"], {"n": 0, "correct": 0, "by_category": {}, "errors": {},
                                             "semantic_flips": 0, "not_perturbed": 0})
        if not_perturbed(r["perturbers"]):
            arm["not_perturbed"] += 1
            continue
        cat = arm["by_category"].setdefault(r["category"] or "unknown", {"n": 0, "correct": 0})
        arm["n"] += 1
        cat["n"] += 1
        if r["valid"]:
            arm["correct"] += 1
            cat["correct"] += 1
        else:
            key = r["taxonomy"] or r["error_type"] or "unknown"
            arm["errors"][key] = arm["errors"].get(key, 0) + 1
            if r["semantic_valid"]:
                arm["semantic_flips"] += 1
    for arm in arms.values():
        correct = arm.pop("correct")
        arm["accuracy"] = ratio(correct, arm["n"])
        arm["accuracy_ci"] = wilson_ci(correct, arm["n"])
        arm["perturbed_share"] = ratio(arm["n"], arm["n"] + arm["not_perturbed"])
        for cat in arm["by_category"].values():
            cat_correct = cat.pop("correct")
            cat["accuracy"] = ratio(cat_correct, cat["n"])
            cat["accuracy_ci"] = wilson_ci(cat_correct, cat["n"])
        arm["errors"] = dict(sorted(arm["errors"].items(), key=lambda kv: (-kv[1], kv[0])))
        arm["errors_ci"] = {k: wilson_ci(v, arm["n"] - correct) for k, v in arm["errors"].items()}
    return arms


def _with_paired(arms: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Each arm's drop against `off` and its paired comparison, overall and per category."""
    # the latest verdict of each (profile, case id): the pairs of the paired comparison against off
    latest: dict[str, dict[str, tuple[str, bool]]] = {}
    for r in rows:
        if r["valid"] is not None and r["case_id"] and not not_perturbed(r["perturbers"]):
            latest.setdefault(r["profile"], {})[r["case_id"]] = (r["category"] or "unknown", bool(r["valid"]))
    base = arms.get("off")
    for name_, arm in arms.items():
        arm["paired"] = _paired(latest.get("off", {}), latest.get(name_, {})) if base and name_ != "off" else None
        # the drop on the cases both arms scored, the one its interval and McNemar's test are about; the two arms'
        # overall accuracies (over different cases) only while they share no case
        arm["drop_vs_off"] = (arm["paired"]["drop"] if arm["paired"] and arm["paired"]["n"] else
                              relative_drop(arm["accuracy"], base["accuracy"] if base else None))
        arm["drop_vs_off_ci"] = arm["paired"]["drop_ci"] if arm["paired"] else None
        for name, cat in arm["by_category"].items():
            b = base["by_category"].get(name) if base else None
            cat["drop_vs_off"] = relative_drop(cat["accuracy"], b["accuracy"] if b else None)
            cmp = (_paired(latest.get("off", {}), latest.get(name_, {}), name) if b and name_ != "off" else None)
            cat["drop_vs_off_ci"] = cmp["drop_ci"] if cmp else None


def _with_anytime(arms: dict[str, dict[str, Any]], consistency_ci: dict[str, dict[str, Any]],
                  rows: list[dict[str, Any]]) -> None:
    """The anytime-valid intervals (proxy/live/anytime.py; the live gauges' numbers over the same rows) beside the
    fixed-sample ones: `accuracy_cs`, `drop_vs_off_cs` (over `anytime_pairs`, the first verdict of each case in
    each arm) and, in `consistency_ci` per shadow profile, `disagreement_cs` (its twins' disagreement minus the
    noise twins')."""
    seq = Sequences()
    for r in rows:
        seq.feed(r, not_perturbed(r["perturbers"]))
    intervals = seq.intervals(ALPHA)
    for name, arm in arms.items():
        iv = intervals.get(name) or {}
        arm["accuracy_cs"] = finite(iv.get("accuracy_cs"))
        arm["drop_vs_off_cs"] = finite(iv.get("drop_vs_off_cs"))
        arm["anytime_pairs"] = iv.get("pairs", 0)
    for name, c in consistency_ci.items():
        c["disagreement_cs"] = finite((intervals.get(name) or {}).get("disagreement_cs"))


def not_perturbed(perturbers: Any) -> bool:
    """A row every applied step left unperturbed on purpose (e.g. a rephrasing rejected by the value check):
    the request went out unchanged, so its verdict is counted apart, out of the arm's accuracy."""
    steps = [s for s in perturbers if isinstance(s, dict)] if isinstance(perturbers, list) else []
    return bool(steps) and all(NOT_PERTURBED in (s.get("report") or {}) for s in steps)


def _agreement(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Twins' agreement with the original per profile: counts and rates, and their Wilson intervals."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["agree"] is None:
            continue
        c = out.setdefault(r["profile"], {"n": 0, "exact": 0, "semantic": 0, "disagree": 0})
        c["n"] += 1
        c[{"true": "exact", "semantic": "semantic"}.get(r["agree"], "disagree")] += 1
    for c in out.values():
        c["rate_exact"] = ratio(c["exact"], c["n"])
        c["rate_semantic"] = ratio(c["exact"] + c["semantic"], c["n"])
        c["rate_disagree"] = ratio(c["disagree"], c["n"])
    cis = {p: {"rate_exact": wilson_ci(c["exact"], c["n"]), "rate_semantic": wilson_ci(c["exact"] + c["semantic"],
                                                                                          c["n"]),
               "rate_disagree": wilson_ci(c["disagree"], c["n"])} for p, c in sorted(out.items())}
    return dict(sorted(out.items())), cis


def _paired(base: dict[str, tuple[str, bool]], arm: dict[str, tuple[str, bool]],
            category: str | None = None) -> dict[str, Any]:
    """An arm against off on the case ids both scored ({case id: (category, valid)}): 2×2 table, McNemar's
    exact p-value, the relative drop on these cases and its approximate 95 % interval."""
    cases = [c for c in arm if c in base and (category is None or arm[c][0] == category)]
    both = sum(1 for c in cases if base[c][1] and arm[c][1])
    lost = sum(1 for c in cases if base[c][1] and not arm[c][1])
    gained = sum(1 for c in cases if not base[c][1] and arm[c][1])
    neither = len(cases) - both - lost - gained
    p = mcnemar(lost, gained)
    ci = paired_drop_ci(both, lost, gained, neither)
    return {"n": len(cases), "both_valid": both, "valid_to_invalid": lost, "invalid_to_valid": gained,
            "both_invalid": neither, "p_value": p, "significant": p < ALPHA,
            "drop": relative_drop(ratio(both + gained, len(cases)), ratio(both + lost, len(cases))),
            "drop_ci": None if ci is None else list(ci)}



def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def _pct_ci(ci: list[float | None] | None, signed: bool = False) -> str:
    if ci is None:
        return "–"

    def end(x: float | None) -> str:  # an unbounded end of an anytime interval is None
        return "+∞" if x is None else f"{x * 100:+.1f}" if signed else f"{x * 100:.1f}"

    return f"[{end(ci[0])}, {end(ci[1])}]"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as Markdown: seed 001 Table 2 shape (accuracy, drop vs off in brackets), errors, consistency."""
    lines = [f"# Live results: {md_text(summary['db'])} ({summary['rows']} rows)", ""]
    if summary["arms"]:
        lines += _arms_md(summary["arms"])
    else:
        lines.append("No scored answers with a known case.")
    lines += _consistency_md(summary) + _noise_md(summary) + _conformance_md(summary)
    return "\n".join(lines) + "\n"


# every name in these tables (profiles, models, categories, error types, rules) came from traffic: `md_text`


def _arms_md(arms: dict[str, Any]) -> list[str]:
    md = md_text
    lines = ["Intervals: \"95 % CI\" holds at this sample size only (read once, at the end); \"anytime 95 %\" is a "
             "confidence sequence, valid however often it is looked at (the live gauges and alerts use it; the drop's "
             "over the first verdict of each case in each arm).", "",
             "| profile | n | accuracy | semantic flips | accuracy 95 % CI | drop vs off [95 % CI] | "
             f"paired cases | valid→invalid | invalid→valid | McNemar p | drop ≠ 0 at {ALPHA} | "
             "accuracy anytime 95 % | drop anytime 95 % (pairs) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, arm in arms.items():
        drop = "" if arm["drop_vs_off"] is None or name == "off" else f" ({arm['drop_vs_off'] * 100:+.0f}%)"
        cmp = arm.get("paired")
        stats = (f"{_pct(arm['drop_vs_off'])} {_pct_ci(arm['drop_vs_off_ci'], True)} | {cmp['n']} | "
                 f"{cmp['valid_to_invalid']} | {cmp['invalid_to_valid']} | {_p(cmp['p_value'])} | "
                 f"{'yes' if cmp['significant'] else 'no'}") if cmp else "– | – | – | – | – | –"
        anytime = ("–" if name == "off" or not arm.get("anytime_pairs") else
                   f"{_pct_ci(arm.get('drop_vs_off_cs'), True)} ({arm['anytime_pairs']})")
        lines.append(f"| {md(name)} | {arm['n']} | {_pct(arm['accuracy'])}{drop} | {arm['semantic_flips']} | "
                     f"{_pct_ci(arm.get('accuracy_ci'))} | {stats} | {_pct_ci(arm.get('accuracy_cs'))} | {anytime} |")
    lines += ["", "## By category", "", "| profile | category | n | accuracy | drop vs off | accuracy 95 % CI | "
              "drop 95 % CI |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, arm in arms.items():
        for cat, c in sorted(arm["by_category"].items()):
            lines.append(f"| {md(name)} | {md(cat)} | {c['n']} | {_pct(c['accuracy'])} | "
                         f"{_pct(c['drop_vs_off'])} | {_pct_ci(c.get('accuracy_ci'))} | "
                         f"{_pct_ci(c.get('drop_vs_off_ci'), True)} |")
    lines += ["", "## Error types (share of failures)", "", "| profile | error type | count | share | "
              "share 95 % CI |", "|---|---|---:|---:|---:|"]
    for name, arm in arms.items():
        failures = sum(arm["errors"].values())
        for kind, count in arm["errors"].items():
            lines.append(f"| {md(name)} | {md(kind)} | {count} | {_pct(count / failures)} | "
                         f"{_pct_ci((arm.get('errors_ci') or {}).get(kind))} |")
    kept = [(name, arm) for name, arm in arms.items() if arm.get("not_perturbed")]
    if kept:
        lines += ["", "## Pairs not perturbed (served unchanged, e.g. a rephrasing rejected by the value check; "
                  "out of the accuracy)", "", "| profile | scored (perturbed) | not perturbed | share perturbed |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {md(name)} | {arm['n']} | {arm['not_perturbed']} | {_pct(arm['perturbed_share'])} |"
                  for name, arm in kept]
    return lines


def _consistency_md(summary: dict[str, Any]) -> list[str]:
    if not summary["consistency"]:
        return []
    md = md_text
    floor = (summary.get("noise") or {}).get(NOISE_PROFILE)
    lines = ["", "## Shadow consistency", "", "| profile | n | exact | semantic | disagree | consistent | "
             "consistent 95 % CI | exact 95 % CI | disagree rate | noise floor (all noise twins) | net of noise | "
             "net of noise, anytime 95 % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cis = summary.get("consistency_ci") or {}
    for name, c in summary["consistency"].items():
        ci = cis.get(name) or {}
        net = "–" if floor is None else f"{(c['rate_disagree'] - floor['rate_disagree']) * 100:+.1f}%"
        lines.append(f"| {md(name)} | {c['n']} | {c['exact']} | {c['semantic']} | {c['disagree']} | "
                     f"{_pct(c['rate_semantic'])} | {_pct_ci(ci.get('rate_semantic'))} | "
                     f"{_pct_ci(ci.get('rate_exact'))} | {_pct(c['rate_disagree'])} "
                     f"{_pct_ci(ci.get('rate_disagree'))} | "
                     f"{'–' if floor is None else _pct(floor['rate_disagree'])} | {net} | "
                     f"{_pct_ci(ci.get('disagreement_cs'), True)} |")
    return lines


def _noise_md(summary: dict[str, Any]) -> list[str]:
    if not summary.get("noise"):
        return []
    md = md_text
    lines = ["", "## Noise floor (unperturbed twins: the model disagreeing with itself)", "",
             "| sampled from | n | exact | semantic | disagree | disagree rate | disagree 95 % CI |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in summary["noise"].items():
        ci = (summary.get("noise_ci") or {}).get(name) or {}
        lines.append(f"| {md('all (' + name + ')' if name == NOISE_PROFILE else name)} | {c['n']} | {c['exact']} | "
                     f"{c['semantic']} | {c['disagree']} | {_pct(c['rate_disagree'])} | "
                     f"{_pct_ci(ci.get('rate_disagree'))} |")
    return lines


def _conformance_md(summary: dict[str, Any]) -> list[str]:
    if not summary.get("conformance"):
        return []
    lines = ["", "## Backend conformance (tool-call format rules broken; docs/conformance.md)", "",
             "| model | rule | violations |", "|---|---|---:|"]
    for model, by_rule in summary["conformance"].items():
        lines += [f"| {md_text(model)} | {md_text(rule)} | {n} |" for rule, n in by_rule.items()]
    return lines
