"""Perturbers: one file per perturbation, registered by name.

Every module directly in this package (not `base`, not a sub-package, not starting with `_`) holds
one perturber and is imported on first use of the registry; it registers its perturber with
`@register`. Shared helpers live in the `helpers` sub-package, which the registry never imports.
Modules must import heavy dependencies (torch, sentence-transformers) lazily, inside functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

import msgspec

from toolquake.perturbers.base import NO_CALL, ChatRequest, PerturbContext, Perturber, Services

__all__ = ["NO_CALL", "ChatRequest", "PerturbContext", "Perturber", "Services", "register", "registry", "build",
           "operator_only_set", "shown_params", "without_credentials"]

_REGISTRY: dict[str, type[Perturber]] = {}
_loaded = False
# the interface module holds no perturber
_NOT_PERTURBERS = {"base"}


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
            if not mod.ispkg and not mod.name.startswith("_") and mod.name not in _NOT_PERTURBERS:
                importlib.import_module(f"{__name__}.{mod.name}")
        _loaded = True
    return _REGISTRY


def operator_only_set(name: str, params: dict[str, Any], allowed: dict[str, Any] | None = None,
                      known: Mapping[str, type[Perturber]] | None = None) -> list[str]:
    """The operator-only parameters (`Perturber.operator_only`) that `params` sets for perturber `name` away from
    their defaults, unless every operator-only value it leads to is exactly that of `allowed` (the params the
    operator configured for this step): no mix of the operator's values and the defaults (one host's key sent to
    another host). Empty when `params` may be used as given. `known`: the registry `name` is in (the remedies');
    the perturbers' by default."""
    cls = (registry() if known is None else known).get(name)
    if cls is None or not cls.operator_only:
        return []
    defaults = {f.name: f.default for f in msgspec.structs.fields(cls) if f.name in cls.operator_only}
    changed = [key for key, value in params.items() if key in defaults and value != defaults[key]]
    if not changed:
        return []
    if allowed is not None and all(params.get(k, d) == allowed.get(k, d) for k, d in defaults.items()):
        return []
    return changed


def without_credentials(value: Any) -> Any:
    """A URL's user, password and query hidden (`***`); anything else as it is."""
    if not isinstance(value, str) or "://" not in value:
        return value
    try:
        parts = urlsplit(value)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def shown_params(params: dict[str, Any]) -> dict[str, Any]:
    """A step's parameters as shown outside the operator's configuration (the admin API's GET, the results stores):
    URLs without their credentials and queries (`without_credentials`)."""
    return {k: without_credentials(v) for k, v in params.items()}


def build(name: str, params: dict[str, Any] | None = None) -> Perturber:
    """Instantiate a registered perturber from its parameters; ValueError with the reason otherwise."""
    known = registry()
    if name not in known:
        raise ValueError(f"unknown perturber {name!r} (known: {', '.join(sorted(known))})")
    try:
        return msgspec.convert(params or {}, known[name])
    except msgspec.ValidationError as exc:
        raise ValueError(f"perturber {name!r}: {exc}") from None
