"""Perturbers: one file per perturbation, registered by name.

Every module in this package whose name does not start with `_` is imported on first use of the
registry; a module registers its perturber with `@register`. Modules must import heavy
dependencies (torch, sentence-transformers) lazily, inside functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import msgspec

from perturbers.base import ChatRequest, PerturbContext, Perturber, Services

__all__ = ["ChatRequest", "PerturbContext", "Perturber", "Services", "register", "registry", "build"]

_REGISTRY: dict[str, type[Perturber]] = {}
_loaded = False
# helper modules that hold no perturber; skipped by the loader to keep start-up light
_HELPERS = {"base"}


def register(cls: type[Perturber]) -> type[Perturber]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"perturber {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Perturber]]:
    global _loaded
    if not _loaded:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_") and mod.name not in _HELPERS:
                importlib.import_module(f"{__name__}.{mod.name}")
        _loaded = True
    return _REGISTRY


def build(name: str, params: dict[str, Any] | None = None) -> Perturber:
    """Instantiate a registered perturber from its parameters; ValueError with the reason otherwise."""
    known = registry()
    if name not in known:
        raise ValueError(f"unknown perturber {name!r} (known: {', '.join(sorted(known))})")
    try:
        return msgspec.convert(params or {}, known[name])
    except msgspec.ValidationError as exc:
        raise ValueError(f"perturber {name!r}: {exc}") from None
