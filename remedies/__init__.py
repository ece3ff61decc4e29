"""Remedies: one file per remedy, registered by name (the perturbers' registry, for the steps that win back).

Every module directly in this package (not `base`, not starting with `_`) holds one remedy and is imported on
first use of the registry; it registers its remedy with `@register`. Modules import heavy dependencies (torch,
sentence-transformers) lazily, inside functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import msgspec

from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy, Services

__all__ = ["ChatRequest", "PerturbContext", "Remedy", "Services", "register", "registry", "build"]

_REGISTRY: dict[str, type[Remedy]] = {}
_loaded = False
_NOT_REMEDIES = {"base"}


def register(cls: type[Remedy]) -> type[Remedy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"remedy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registry() -> dict[str, type[Remedy]]:
    global _loaded
    if not _loaded:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.ispkg and not mod.name.startswith("_") and mod.name not in _NOT_REMEDIES:
                importlib.import_module(f"{__name__}.{mod.name}")
        _loaded = True
    return _REGISTRY


def build(name: str, params: dict[str, Any] | None = None) -> Remedy:
    """Instantiate a registered remedy from its parameters; ValueError with the reason otherwise."""
    known = registry()
    if name not in known:
        raise ValueError(f"unknown remedy {name!r} (known: {', '.join(sorted(known)) or 'none'})")
    try:
        return msgspec.convert(params or {}, known[name])
    except msgspec.ValidationError as exc:
        raise ValueError(f"remedy {name!r}: {exc}") from None
