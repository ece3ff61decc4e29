"""The report finds the arms of its grids and families by what perturbers declare (`Perturber.experiment` and
`Perturber.axes`, perturbers/base.py), never by a perturber's name: a perturber of another name that declares
seed 003's catalog experiment, or the faults family, is reported there; one that declares nothing is not. So
does replay: a preset of a perturber's name holds the profiles it declares (`preset_profiles`), and an arm whose
step declares that a generator model writes its text (`generates_text`) needs a fixed one.

The results are written through the replay's own writer (`ResultsFile`); the perturbers are registered the way
an out-of-tree plugin registers its own (`@register`), under names no shipped perturber has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber
from toolquake.proxy.replay.errors import ReplayError
from toolquake.proxy.replay.report import build, load, padding_counts, summarize
from toolquake.proxy.replay.run import Options, _check_rephraser
from toolquake.proxy.replay.selection import expand_profiles
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


@register
class _RephrasingLookalike(Perturber):
    """Declares seed 001's rephrasing under a name of its own; a generator model writes its text."""

    name = "test_declared_rephrasing"
    experiment = "rephrasing"
    preset_profiles: ClassVar[tuple[str, ...]] = ("reworded-*",)
    generator_model: str = ""
    rejected: str = "keep"

    def generates_text(self) -> bool:
        return True

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


def test_rephrasing_arms_are_found_by_the_experiment_their_perturber_declares(tmp_path: Path) -> None:
    f = ResultsFile(tmp_path / "replay.sqlite")
    f.claim("m", "http://backend/v1")
    f.register_arms({"off": {"mode": "off", "perturbers": []},
                     "reworded-all": _step("test_declared_rephrasing", generator_model="fixed", rejected="send")})
    for i in range(4):
        f.record(Record(f"c{i}", "off", "multiple", "scored", valid=True))
        # c0's rephrasing lost a value and was sent anyway (`rejected = "send"`); the others were accepted
        report = {"rephraser": "fixed", **({"rejected_for": ["200"]} if i == 0 else {})}
        f.record(Record(f"c{i}", "reworded-all", "multiple", "scored", valid=i % 2 == 1, taxonomy=None,
                        perturbers={"applied": [{"name": "test_declared_rephrasing", "report": report}]}))
    f.close()
    summary = summarize(load([tmp_path]))
    assert summary["rephrasers"]["m"]["reworded-all"]["rephraser"] == "fixed"
    assert summary["rephrasers"]["m"]["reworded-all"]["pairs"] == {"fixed": 4}
    drops = summary["rephrasing_drops"]["m"]["reworded-all"]
    assert (drops["cases"], drops["table2"], drops["rejected_sent"], drops["n"]) == ("all cases", True, 1, 4)


def test_a_preset_holds_the_profiles_its_perturber_declares() -> None:
    known = ["off", "shuffled", "reversed", "reworded-a", "reworded-b", "other"]
    assert expand_profiles("@test_declared_rephrasing", known) == ["off", "reworded-a", "reworded-b"]
    assert expand_profiles("@tool_order", known) == ["off", "shuffled", "reversed"]


def test_an_arm_whose_text_a_generator_writes_needs_a_fixed_generator(tmp_path: Path) -> None:
    options = Options(backend="http://127.0.0.1:1/v1", profiles="reworded", out=tmp_path)
    own = {"reworded": _step("test_declared_rephrasing")}
    with pytest.raises(ReplayError, match="reworded: no fixed generator model is configured(.|\n)*--self-rephrase"):
        _check_rephraser(options, own)
    _check_rephraser(options, {"reworded": _step("test_declared_rephrasing", generator_model="fixed")})
    options.self_rephrase = True
    _check_rephraser(options, own)
