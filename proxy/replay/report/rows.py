"""Load: replay results files (proxy/replay/store.py) and the live results store of `toolquake serve`
(proxy/live/results.py) read into rows, and the stored columns the report reads later (applied steps' reports,
answers). Every SQLite read of the report is here; read-only, so it is safe while a replay or a server is still
writing.

A live store is one more source: its arms are reported under the model `LIVE` (it pools every model its traffic
named, per profile, as its gauges do), every scored answer is a row (a case answered twice counts twice in the
accuracy; the paired comparison and the per-case diffs read its latest verdict), and its shadow and noise twins'
agreement and its conformance violations are kept for their own sections (`live_rows`, `conformance`)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.live.results import connect, not_perturbed, read_violations
from toolquake.proxy.replay.store import row_status

#: the model an arm of the live results store is reported under (its source's label in every table)
LIVE = "live"


@dataclass
class Row:
    model: str
    profile: str
    case_id: str
    category: str
    status: str
    valid: bool | None
    taxonomy: str | None
    error_type: str | None
    error_code: str | None
    fair_valid: bool | None
    semantic_valid: bool | None
    #: index into Results.sources of the file the row was read from (for the per-case details)
    source: int = -1
    #: the trial number (`replay --trials`; 0 without, and in files written before it)
    trial: int = 0
    #: a multi-turn row's AST verdict on its last turn's calls (seed 003 challenge 3; None: not recorded)
    final_valid: bool | None = None
    #: a given conversation's row (seed 003 challenge 3 as the paper measures it: `valid` is its next call's AST
    #: verdict): the ground-truth calls of its last turn, of which the first is graded (None: not such a row)
    next_expected: int | None = None


@dataclass
class SweepRow:
    """One recorded request of `toolquake sweep`: the case asked at intensity `x` along the run's axis."""

    run: int  # index into Results.sweep_runs
    case_id: str
    category: str
    x: float
    trial: int
    status: str
    valid: bool | None
    #: why a request the backend refused (or that timed out) got no answer: it is scored wrong (failures.py)
    error_code: str | None = None


@dataclass
class SweepRun:
    """The settings of one sweep results file (the meta `toolquake sweep` wrote), and where it came from."""

    model: str
    axis: str
    unit: str
    points: list[float]
    rule: str
    trials: int
    position: str
    source: Path
    #: the remedies applied at every point (`sweep --remedy`), by name; empty for a sweep without
    remedies: list[str] = field(default_factory=list)


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    #: the requests of `toolquake sweep` results files (sweep*.sqlite), and each file's settings
    sweep_rows: list[SweepRow] = field(default_factory=list)
    sweep_runs: list[SweepRun] = field(default_factory=list)
    #: (model, profile) → the profile's definition when it was replayed
    arms: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: indices into `sources` of live results stores (`serve --results-db`); every other source is a replay file
    live_sources: set[int] = field(default_factory=set)
    #: per live model (`LIVE`): every row of its store in the store's order, as the shadow consistency, the noise
    #: floor and the anytime intervals read them ({profile, arm, case_id, valid, agree, not_perturbed})
    live_rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: per live model: its store's conformance violations ({model, rule}), oldest first
    conformance: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    sources: list[Path] = field(default_factory=list)
    duplicates: int = 0
    #: model → what its requests were sent with, as the results files recorded it: {"temperature": "0" | "none"
    #: (left out) | several joined by ", " when files differ, "token_counter": ...}; absent: not recorded
    settings: dict[str, dict[str, str]] = field(default_factory=dict)

    def note_settings(self, model: str, meta: dict[str, str]) -> None:
        """Keep what a results file says its requests were sent with (several files of a model: each value once)."""
        mine = self.settings.setdefault(model, {})
        for key in ("temperature", "token_counter"):
            if key in meta and meta[key] not in mine.get(key, "").split(", "):
                mine[key] = ", ".join(x for x in (mine.get(key), meta[key]) if x)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.arms))

    def profiles(self, model: str) -> list[str]:
        return [p for m, p in self.arms if m == model]


def result_files(paths: list[str | Path]) -> list[Path]:
    """Results files in each path: the file itself, or every replay*.sqlite and sweep*.sqlite in a directory."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(p.glob("replay*.sqlite")) + sorted(p.glob("sweep*.sqlite"))
            if not found:
                raise FileNotFoundError(f"{p}: no replay results (replay*.sqlite) or sweep results (sweep*.sqlite) "
                                        "in this directory")
            files.extend(found)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return files


def _bool(v: Any) -> bool | None:
    return None if v is None else bool(v)


def trial_column(db: sqlite3.Connection) -> str:
    """`trial` in files written since `--trials` (schema 2), the constant 0 in older ones."""
    return "trial" if any(r[1] == "trial" for r in db.execute("PRAGMA table_info(results)")) else "0"


def _model(db: sqlite3.Connection) -> str:
    return dict(db.execute("SELECT key, value FROM meta").fetchall()).get("model", "unknown")


def load(paths: list[str | Path], db: str | Path | None = None) -> Results:
    """Read and merge replay results, and the live results store `db` when given (read-only; safe while a replay
    or a server is still writing)."""
    res = Results()
    if db is not None:
        _load_live(Path(db), res)
    seen: dict[tuple[str, str, str, int], int] = {}
    for path in result_files(paths):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            if "sweep_axis" in dict(db.execute("SELECT key, value FROM meta").fetchall()):
                _load_sweep(db, res, path)
                continue
            _load_file(db, res, seen)
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{path}: not a replay results file ({exc})") from None
        finally:
            db.close()
        res.sources.append(path)
    return res


#: a multi-turn answer's `final_call.valid` (proxy/replay/multiturn.py), read in SQLite without loading the answer
_FINAL_VALID = ("CASE WHEN answer LIKE '%\"final_call\"%' AND json_valid(answer) "
                "THEN json_extract(answer, '$.final_call.valid') END")
#: a given conversation's answer's `next_call.expected_calls` (proxy/replay/multiturn.py `next_call_grade`)
_NEXT_EXPECTED = ("CASE WHEN answer LIKE '%\"next_call\"%' AND json_valid(answer) "
                  "THEN json_extract(answer, '$.next_call.expected_calls') END")


def _load_file(db: sqlite3.Connection, res: Results, seen: dict[tuple[str, str, str, int], int]) -> None:
    """One file's arms and rows into `res`; a (model, profile, case, trial) seen before counts once (a scored row
    wins over a failed one)."""
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    model = meta.get("model", "unknown")
    res.note_settings(model, meta)
    for profile, spec in db.execute("SELECT profile, spec FROM arms ORDER BY rowid"):
        res.arms.setdefault((model, profile), json.loads(spec))
    for r in db.execute("SELECT profile, case_id, category, status, valid, taxonomy, error_type, error_code, "
                        f"fair_valid, semantic_valid, {trial_column(db)}, perturbers, {_FINAL_VALID}, "
                        f"{_NEXT_EXPECTED} FROM results ORDER BY rowid"):
        row = Row(model, r[0], r[1], r[2], row_status(r[3], r[11], r[6]), _bool(r[4]), r[5], r[6],
                  r[7], _bool(r[8]), _bool(r[9]), source=len(res.sources), trial=int(r[10]), final_valid=_bool(r[12]),
                  next_expected=r[13] if isinstance(r[13], int) else None)
        key = (model, row.profile, row.case_id, row.trial)
        if key in seen:
            res.duplicates += 1
            if res.rows[seen[key]].status != "scored" and row.status == "scored":
                res.rows[seen[key]] = row
            continue
        seen[key] = len(res.rows)
        res.rows.append(row)
        res.arms.setdefault((model, row.profile), {"mode": "unknown", "perturbers": []})


def _load_live(path: Path, res: Results) -> None:
    """A live results store: its scored answers as rows of the model `LIVE` (in the store's order, none dropped as
    a duplicate), its arms (profiles, sorted; each defined by the steps its first perturbed answer records), its
    twins and its conformance violations. A file that is not a results store raises StoreError."""
    store = connect(path, readonly=True)
    try:
        found = store.execute("SELECT profile, mode, arm, case_id, category, valid, taxonomy, error_type, "
                              "fair_valid, semantic_valid, agree, perturbers FROM results ORDER BY id").fetchall()
    finally:
        store.close()
    src = len(res.sources)
    kept, arms = [], {}
    for (profile, mode, arm, case_id, category, valid, taxonomy, error_type, fair, semantic, agree,
         perturbers) in found:
        steps = json.loads(perturbers) if perturbers else []
        unchanged = not_perturbed(steps)
        kept.append({"profile": profile, "arm": arm, "case_id": case_id, "valid": valid, "agree": agree,
                     "not_perturbed": unchanged})
        if valid is None:  # no case known, or a noise twin (compared only): in no accuracy
            continue
        if profile not in arms or (not arms[profile]["perturbers"] and steps):
            arms[profile] = {"mode": mode, **arm_steps(steps)}
        res.rows.append(Row(LIVE, profile, case_id or "", category or "unknown",
                            NOT_PERTURBED if unchanged else "scored", bool(valid), taxonomy, error_type, None,
                            _bool(fair), _bool(semantic), source=src))
    for profile in sorted(arms):
        res.arms[(LIVE, profile)] = arms[profile]
    res.live_rows[LIVE] = kept
    res.conformance[LIVE] = [{"model": v["model"], "rule": v["rule"]} for v in read_violations(path)]
    res.live_sources.add(src)
    res.sources.append(path)


def arm_steps(steps: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """An arm's definition from the steps an answer records: {"perturbers": [...]}, and {"remedies": [...]} when
    some step is a remedy (`"kind": "remedy"`), each {name, params}."""
    shown = [(s.get("kind"), {"name": s.get("name"), "params": s.get("params") or {}})
             for s in steps if isinstance(s, dict)]
    remedies = [step for kind, step in shown if kind == "remedy"]
    return {"perturbers": [step for kind, step in shown if kind != "remedy"], **({"remedies": remedies} if remedies
                                                                                 else {})}


def _load_sweep(db: sqlite3.Connection, res: Results, path: Path) -> None:
    """A sweep file: its settings, and every request as (case, x, trial, verdict); x read from the arm's spec."""
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    run = SweepRun(model=meta.get("model", "unknown"), axis=meta["sweep_axis"], unit=meta.get("sweep_unit", ""),
                   points=json.loads(meta.get("sweep_points") or "[]"), rule=meta.get("sweep_rule", "majority"),
                   trials=int(meta.get("trials") or 1), position=meta.get("sweep_position", ""), source=path,
                   remedies=[str(r.get("name")) for r in json.loads(meta.get("sweep_remedies") or "[]")])
    if not run.points:
        raise ValueError(f"{path}: a sweep results file without its grid (sweep_points): written by an older "
                         "toolquake; sweep again into a new directory")
    xs = {p: (json.loads(s).get("sweep") or {}).get("x") for p, s in db.execute("SELECT profile, spec FROM arms")}
    res.sweep_runs.append(run)
    res.note_settings(run.model, meta)
    index = len(res.sweep_runs) - 1
    for profile, case_id, category, status, valid, trial, perturbers, code, error_type in db.execute(
            "SELECT profile, case_id, category, status, valid, trial, perturbers, error_code, error_type FROM results "
            "ORDER BY rowid"):
        if xs.get(profile) is not None:
            res.sweep_rows.append(SweepRow(index, case_id, category, xs[profile], int(trial),
                                           row_status(status, perturbers, error_type), _bool(valid), code))


def scored_steps(res: Results) -> Iterator[tuple[str, str, str, str | None]]:
    """(model, profile, case id, stored `perturbers` JSON) of every scored row of trial 0, file by file in
    the order written (replay files only)."""
    for path in _replay_files(res):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            model = _model(db)
            # with `replay --trials`, trial 0 (as every other per-case number of the report)
            first = " AND trial = 0" if any(r[1] == "trial" for r in db.execute("PRAGMA table_info(results)")) else ""
            rows = db.execute(f"SELECT profile, case_id, perturbers FROM results WHERE status = 'scored'{first} "
                              "ORDER BY rowid").fetchall()
        finally:
            db.close()
        for profile, case_id, perturbers in rows:
            yield model, profile, case_id, perturbers


def step_reports(res: Results, names: list[str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(model, profile, report) of every step of the perturbers `names` applied to a scored pair, from the files."""
    for model, profile, report, _ in step_usage(res, names):
        yield model, profile, report


def step_usage(res: Results, names: list[str]) -> Iterator[tuple[str, str, dict[str, Any], int | None]]:
    """`step_reports` with, for a single-turn pair, the prompt tokens the backend counted for its request
    (`usage.prompt_tokens`, recorded with the row); None for a multi-turn pair (its row sums every step's)."""
    if not names:
        return
    like = " OR ".join("perturbers LIKE ?" for _ in names)
    for path in _replay_files(res):
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            model = _model(db)
            rows = db.execute(f"SELECT profile, perturbers, prompt_tokens FROM results WHERE status = 'scored' AND "
                              f"({like})", [f"%{n}%" for n in names]).fetchall()
        except sqlite3.DatabaseError:
            continue
        finally:
            db.close()
        for profile, text, prompt_tokens in rows:
            applied = (json.loads(text) or {}).get("applied")
            single = isinstance(applied, list) and isinstance(prompt_tokens, int)
            for step in applied if isinstance(applied, list) else []:
                if step.get("name") in names:
                    yield model, profile, step.get("report") or {}, prompt_tokens if single else None


def stored_answers(res: Results, wanted: dict[int, set[tuple[str, str]]]) -> dict[tuple[int, str, str],
                                                                                 tuple[Any, Any]]:
    """{(source, profile, case id): (answer, perturbers)} of trial 0 of the wanted pairs of each source file."""
    stored: dict[tuple[int, str, str], tuple[Any, Any]] = {}
    for src, pairs in wanted.items():
        if src in res.live_sources:
            stored.update(_live_answers(res.sources[src], src, pairs))
            continue
        db = sqlite3.connect(f"file:{res.sources[src]}?mode=ro", uri=True)
        try:
            trial = trial_column(db)
            for profile, case_id in sorted(pairs):
                row = db.execute(f"SELECT answer, perturbers FROM results WHERE profile = ? AND case_id = ? "
                                 f"AND {trial} = 0", (profile, case_id)).fetchone()
                if row is not None:
                    stored[(src, profile, case_id)] = (
                        None if row[0] is None else json.loads(row[0]),
                        None if row[1] is None else json.loads(row[1]),
                    )
        finally:
            db.close()
    return stored


def _replay_files(res: Results) -> list[Path]:
    return [p for i, p in enumerate(res.sources) if i not in res.live_sources]


def _live_answers(path: Path, src: int, pairs: set[tuple[str, str]]) -> dict[tuple[int, str, str], tuple[Any, Any]]:
    """The answer (stored only with `store_contents`) and applied steps of the latest scored verdict of each pair
    in a live store, the steps as a replay file stores them ({"applied": [...]})."""
    out: dict[tuple[int, str, str], tuple[Any, Any]] = {}
    db = connect(path, readonly=True)
    try:
        for profile, case_id in sorted(pairs):
            row = db.execute("SELECT response_body, perturbers FROM results WHERE profile = ? AND case_id = ? AND "
                             "valid IS NOT NULL ORDER BY id DESC LIMIT 1", (profile, case_id)).fetchone()
            if row is not None:
                out[(src, profile, case_id)] = (None if row[0] is None else json.loads(row[0]),
                                                {"applied": json.loads(row[1]) if row[1] else []})
    finally:
        db.close()
    return out


def pair_usage(res: Results, wanted: set[tuple[str, str]]) -> dict[tuple[str, str, str], tuple[int | None,
                                                                                           list[dict[str, Any]]]]:
    """{(model, profile, case id): (prompt tokens, applied steps)} of the scored pairs of trial 0 of the wanted
    (model, profile) arms, in the replay files and the live store: the tokens the backend counted for the request
    (`usage`; a multi-turn row sums its steps'), and the steps as recorded (a multi-turn row records counts only:
    []). A live store's pair is its latest scored answer, as the paired comparison reads it."""
    out: dict[tuple[str, str, str], tuple[int | None, list[dict[str, Any]]]] = {}
    for src, path in enumerate(res.sources):
        live = src in res.live_sources
        db = connect(path, readonly=True) if live else sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            model = LIVE if live else _model(db)
            profiles = sorted(p for m, p in wanted if m == model)
            if not profiles:
                continue
            marks = ", ".join("?" for _ in profiles)
            scored = "valid IS NOT NULL" if live else f"status = 'scored' AND {trial_column(db)} = 0"
            found = db.execute(f"SELECT profile, case_id, prompt_tokens, perturbers FROM results WHERE {scored} "
                               f"AND profile IN ({marks}) ORDER BY {'id' if live else 'rowid'}", profiles).fetchall()
        except sqlite3.DatabaseError:
            continue
        finally:
            db.close()
        for profile, case_id, tokens, text in found:
            out[(model, profile, case_id)] = (tokens if isinstance(tokens, int) else None, _recorded_steps(text))
    return out


def _recorded_steps(text: str | None) -> list[dict[str, Any]]:
    """The applied steps of a stored `perturbers` column: a replay file's {"applied": [...]} or a live store's list
    ([] when it cannot be read)."""
    try:
        stored = json.loads(text) if text else None
    except ValueError:
        return []
    applied = stored.get("applied") if isinstance(stored, dict) else stored
    return [s for s in applied if isinstance(s, dict)] if isinstance(applied, list) else []
