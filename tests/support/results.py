"""Replay results files written from verdicts a test chose (the replay's own store), for the report's tests: an
arm's spec with one perturber, and a results file holding arms and records."""

from __future__ import annotations

from pathlib import Path

from toolquake.proxy.replay.store import Record, ResultsFile


def perturb_arm(perturber: str, **params) -> dict:
    """The spec of an arm that applies one perturber to every request."""
    return {"mode": "perturb", "perturbers": [{"name": perturber, "params": params, "probability": 1.0}]}


def write_results(path: Path, arms: dict, records: list[Record], model: str = "m1") -> None:
    """A results file at `path` for `model`: the arms registered, the records recorded."""
    f = ResultsFile(path)
    f.claim(model, "http://backend/v1")
    f.register_arms(arms)
    for rec in records:
        f.record(rec)
    f.close()
