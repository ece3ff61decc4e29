"""Remedies: one file per remedy, registered by name (the perturbers' registry, for the steps that win back).

Every module directly in this package (not `base`, not starting with `_`) holds one remedy and is imported on
first use of the registry; it registers its remedy with `@register`. Modules import heavy dependencies (torch,
sentence-transformers) lazily, inside functions.
"""

from __future__ import annotations

from toolquake.perturbers import Registry
from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy, Services

__all__ = ["ChatRequest", "PerturbContext", "Remedy", "Services", "register", "registry", "build"]

_REMEDIES: Registry[Remedy] = Registry("remedy", __name__, __path__, frozenset({"base"}))
register = _REMEDIES.register
registry = _REMEDIES.all
build = _REMEDIES.build
