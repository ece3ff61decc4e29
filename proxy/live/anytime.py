"""Anytime-valid intervals of live traffic: each profile's accuracy, its paired drop against `off`, and a shadow
profile's disagreement beyond the noise floor, as confidence sequences (scorers/aggregate.py) that stay valid
however often they are looked at — a Grafana panel or an alert that acts the first time an interval excludes 0
keeps its 5 % error rate (docs/live-scoring.md#anytime-valid-intervals).

`Sequences` reads results rows in the store's order (its row ids) and keeps the counts the intervals need:
- accuracy: every scored, perturbed row of the profile (the report's `n`);
- the paired drop: pairs formed, in the order they complete, by the first verdict of each case under `off` and
  under the profile (a later verdict of the same case does not change a pair already counted);
- disagreement: the profile's shadow twins that disagree with the original (`agree` neither true nor semantic)
  against the noise twins of every profile (the model disagreeing with itself).
`toolquake report --db` feeds it every row; the live server (`Monitor`) feeds it the rows appended since its last
read, every `REFRESH_S`, in a thread, and sets the `toolquake_live_*` gauges: every worker reads the same store,
so every worker exports the same sequence (a worker that has read further has a narrower, equally valid interval).
Memory: one boolean per (profile, case) first verdict, bounded by the cases that can be scored.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from toolquake.scorers.aggregate import ALPHA, paired_drop_cs, rate_cs, rate_excess_cs

log = structlog.get_logger("toolquake.scoring")

#: seconds between two reads of the results store by a live server
REFRESH_S = 5.0
#: rows read from the store at a time (a large backlog is read in several steps, each a short transaction)
BATCH = 5000
BASELINE = "off"
_AGREE = ("true", "semantic")


@dataclass
class _Profile:
    n: int = 0
    correct: int = 0
    #: both valid, valid→invalid, invalid→valid, both invalid (pairs against the baseline)
    pairs: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    twins: int = 0
    disagree: int = 0


class Sequences:
    """Running counts per profile, fed rows (dicts with the results table's columns) in the store's order."""

    def __init__(self, baseline: str = BASELINE) -> None:
        #: the profile the drops are paired against
        self.baseline = baseline
        self.profiles: dict[str, _Profile] = {}
        #: first verdict of each case, per profile
        self.first: dict[str, dict[str, bool]] = {}
        self.noise_twins = 0
        self.noise_disagree = 0

    def _profile(self, name: str) -> _Profile:
        p = self.profiles.get(name)
        if p is None:
            p = self.profiles[name] = _Profile()
        return p

    def feed(self, row: dict[str, Any], not_perturbed: bool = False) -> None:
        arm, agree = row.get("arm"), row.get("agree")
        if arm == "noise":
            if agree is not None:
                self.noise_twins += 1
                self.noise_disagree += agree not in _AGREE
            return
        if arm == "twin" and agree is not None:
            p = self._profile(row["profile"])
            p.twins += 1
            p.disagree += agree not in _AGREE
        valid = row.get("valid")
        if valid is None or not_perturbed:
            return
        name, case = row["profile"], row.get("case_id")
        p = self._profile(name)
        p.n += 1
        p.correct += bool(valid)
        if not case:
            return
        seen = self.first.setdefault(name, {})
        if case in seen:
            return
        seen[case] = bool(valid)
        if name == self.baseline:
            for other, verdicts in self.first.items():
                if other != self.baseline and case in verdicts:
                    self._pair(other, bool(valid), verdicts[case])
        else:
            base = self.first.get(self.baseline, {}).get(case)
            if base is not None:
                self._pair(name, base, bool(valid))

    def _pair(self, name: str, base: bool, arm: bool) -> None:
        self._profile(name).pairs[(0 if arm else 1) if base else (2 if arm else 3)] += 1

    def intervals(self, alpha: float = ALPHA) -> dict[str, dict[str, Any]]:
        """Per profile: {"accuracy_cs", "drop_vs_off_cs", "pairs", "disagreement_cs", "twins"} (a list [lo, hi]
        or None; an unbounded end is `math.inf`)."""
        out = {}
        for name, p in sorted(self.profiles.items()):
            out[name] = {
                "n": p.n, "accuracy_cs": rate_cs(p.correct, p.n, alpha),
                "pairs": sum(p.pairs),
                "drop_vs_off_cs": None if name == self.baseline else paired_drop_cs(*p.pairs, alpha=alpha),
                "twins": p.twins,
                "disagreement_cs": rate_excess_cs(p.disagree, p.twins, self.noise_disagree, self.noise_twins, alpha),
            }
        return out


def finite(ci: list[float] | None) -> list[float | None] | None:
    """An interval for JSON: an unbounded end as None."""
    return None if ci is None else [x if math.isfinite(x) else None for x in ci]


class Monitor:
    """Reads the rows a live server's store gained since the last read and sets the anytime gauges."""

    def __init__(self, path: str | Path, metrics: Any, not_perturbed: Any) -> None:
        self.path = Path(path)
        self.metrics = metrics
        self.not_perturbed = not_perturbed
        self.seq = Sequences()
        self.last_id = 0
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # a read in its thread and `close` at shutdown

    def read(self) -> int:
        """In a thread: feed the new rows, set the gauges. Returns how many rows were read."""
        with self._lock:
            return self._read()

    def _read(self) -> int:
        if self._db is None:
            if not self.path.exists():
                return 0
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False, timeout=5.0)
            self._db.row_factory = sqlite3.Row
        total = 0
        while True:
            rows = self._db.execute("SELECT id, profile, arm, case_id, valid, agree, perturbers FROM results "
                                    "WHERE id > ? ORDER BY id LIMIT ?", (self.last_id, BATCH)).fetchall()
            for r in rows:
                d = dict(r)
                steps = _steps(d.pop("perturbers"))
                self.seq.feed(d, self.not_perturbed(steps))
                self.last_id = d["id"]
            total += len(rows)
            if len(rows) < BATCH:
                break
        if total:
            self.publish()
        return total

    def publish(self) -> None:
        m = self.metrics
        for name, iv in self.seq.intervals().items():
            for gauges, ci in ((m.live_accuracy, iv["accuracy_cs"]), (m.live_drop, iv["drop_vs_off_cs"]),
                               (m.live_disagreement, iv["disagreement_cs"])):
                if ci is not None:
                    gauges[0].labels(name).set(ci[0])
                    gauges[1].labels(name).set(ci[1])
            if name != BASELINE:
                m.live_pairs.labels(name).set(iv["pairs"])

    async def run(self) -> None:
        """Read every REFRESH_S until cancelled; a failed read is logged and tried again (fail-open)."""
        while True:
            try:
                await asyncio.to_thread(self.read)
            except Exception as exc:  # a damaged or replaced file: reopened on the next read
                log.warning("anytime_read_failed", error_type=type(exc).__name__, error=str(exc)[:200])
                await asyncio.to_thread(self.close)
            await asyncio.sleep(REFRESH_S)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _steps(raw: Any) -> Any:
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return None
