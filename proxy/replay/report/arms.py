"""Which experiment an arm's steps belong to, as their perturbers declare it (`Perturber.experiment` and
`Perturber.axes`, perturbers/base.py): the report finds the arms of a grid or a family by these declarations,
never by a perturber's name. A step whose perturber is not registered here belongs to no experiment."""

from __future__ import annotations

from typing import Any

from toolquake.perturbers import registry


def experiment_of(step: dict[str, Any]) -> str:
    """The experiment the step's perturber declares ("" when none, or when the perturber is not registered)."""
    cls = registry().get(str(step.get("name")))
    return "" if cls is None else cls.experiment


def names_of(experiment: str) -> list[str]:
    """The registered perturbers that declare `experiment`, by name."""
    return sorted(name for name, cls in registry().items() if cls.experiment == experiment)


def step_of(perturbers: list[dict[str, Any]], experiment: str) -> dict[str, Any] | None:
    """The first of an arm's steps that belongs to `experiment`, else None."""
    return next((s for s in perturbers if experiment_of(s) == experiment), None)


def axes_of(step: dict[str, Any]) -> tuple[str, ...]:
    """The parameters that place the step in its experiment (its perturber's `axes`)."""
    cls = registry().get(str(step.get("name")))
    return () if cls is None else tuple(cls.axes)


def param(step: dict[str, Any], key: str) -> Any:
    """A step's parameter, else the perturber's default (None when it has neither)."""
    params = step.get("params") or {}
    if key in params:
        return params[key]
    return getattr(registry().get(str(step.get("name"))), key, None)


def remedied(arm: dict[str, Any]) -> bool:
    """Whether an arm (its definition, or its summary entry) applies remedies after its perturbations: such an arm
    measures the remedy, not the model under the perturbation, and stays out of the papers' tables, grids and
    families (it has its own section, report/remedies.py)."""
    return bool(arm.get("remedies"))
