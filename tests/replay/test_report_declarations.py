"""The report finds the arms of its grids and families by what perturbers declare (`Perturber.experiment` and
`Perturber.axes`, perturbers/base.py), never by a perturber's name: a perturber of another name that declares
seed 003's catalog experiment, or the faults family, is reported there; one that declares nothing is not.

The results are written through the replay's own writer (`ResultsFile`); the perturbers are registered the way
an out-of-tree plugin registers its own (`@register`), under names no shipped perturber has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber
from toolquake.proxy.replay.report import build, load, padding_counts, summarize
from toolquake.proxy.replay.store import Record, ResultsFile


@register
class _PaddingLookalike(Perturber):
    """Declares seed 003's catalog experiment under a name of its own."""

    name = "test_declared_padding"
    experiment = "catalog_size"
    axes: ClassVar[tuple[str, ...]] = ("budget_tokens", "position")
    budget_tokens: int = 4096
    position: float = 0.5

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request


@register
class _FaultLookalike(Perturber):
    """Declares the faults family; its kind is its first axis."""

    name = "test_declared_fault"
    experiment = "faults"
    axes: ClassVar[tuple[str, ...]] = ("kind",)
    kind: str = "timeout"

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request


@register
class _Undeclared(Perturber):
    """Has the catalog's parameters but declares no experiment."""

    name = "test_undeclared_padding"
    budget_tokens: int = 4096
    position: float = 0.5

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request


def _step(name: str, **params: Any) -> dict[str, Any]:
    return {"mode": "perturb", "perturbers": [{"name": name, "params": params, "probability": 1.0}]}


def _write(path: Path) -> None:
    f = ResultsFile(path)
    f.claim("m", "http://backend/v1")
    f.register_arms({"off": {"mode": "off", "perturbers": []},
                     "declared-8k": _step("test_declared_padding", budget_tokens=8192, position=0.1),
                     "declared-32k": _step("test_declared_padding", budget_tokens=32768, position=0.5),
                     "undeclared": _step("test_undeclared_padding", budget_tokens=16384, position=0.9),
                     "fault": _step("test_declared_fault", kind="http_500")})
    for i in range(4):
        for profile in ("off", "declared-8k", "declared-32k", "undeclared", "fault"):
            valid = profile == "off" or i % 2 == 0
            f.record(Record(f"c{i}", profile, "multiple", "scored", valid=valid,
                            taxonomy=None if valid else "wrong_function"))
    f.close()


def test_arms_are_found_by_the_experiment_their_perturber_declares(tmp_path: Path) -> None:
    _write(tmp_path / "replay.sqlite")
    summary = summarize(load([tmp_path]))
    # the declared arms are the catalog grid's cells; the undeclared one, with the same parameter names, is not
    assert padding_counts(summary, "m") == {(8192, 0.1): (2, 4), (32768, 0.5): (2, 4)}
    assert {(e["profile"], e["family"], e["kind"]) for e in summary["families"]} == {("fault", "faults", "http_500")}
    table1 = summary["padding_extremes"]["m"]["multiple"]
    assert table1["arms"] == 2 and {table1["max_arm"], table1["min_arm"]} <= {"declared-8k", "declared-32k"}
    text, _ = build([tmp_path], "md", None, plots=False)
    assert "Perturbation families" in text and "Seed 003 Table 1" in text
