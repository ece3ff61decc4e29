"""Perturbers: one file per perturbation, registered by name.

Every module directly in this package (not `base`, not a sub-package, not starting with `_`) holds
one perturber and is imported on first use of the registry; it registers its perturber with
`@register`. Shared helpers live in the `helpers` sub-package, which the registry never imports.
Modules must import heavy dependencies (torch, sentence-transformers) lazily, inside functions.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Generic, Mapping, TypeVar
from urllib.parse import urlsplit, urlunsplit

import msgspec

from toolquake.perturbers.base import NO_CALL, ChatRequest, PerturbContext, Perturber, Services

S = TypeVar("S", bound=Perturber)

__all__ = ["Registry", "NO_CALL", "ChatRequest", "PerturbContext", "Perturber", "Services", "register", "registry",
           "build", "operator_only_set", "shown_params", "without_credentials"]


class Registry(Generic[S]):
    """Steps registered by name: every module directly in `package` (not in `skip`, not a sub-package, not starting
    with `_`) is imported on first use and registers its step with `register`. The perturbers' registry, and the
    remedies' (`toolquake.remedies`)."""

    def __init__(self, kind: str, package: str, path: Any, skip: frozenset[str]) -> None:
        self.kind, self.package, self.path, self.skip = kind, package, path, skip
        self.classes: dict[str, type[S]] = {}
        self.loaded = False

    def register(self, cls: type[S]) -> type[S]:
        if not cls.name:
            raise ValueError(f"{cls.__name__} has no name")
        if cls.name in self.classes and self.classes[cls.name] is not cls:
            raise ValueError(f"{self.kind} {cls.name!r} registered twice")
        self.classes[cls.name] = cls
        return cls

    def all(self) -> dict[str, type[S]]:
        if not self.loaded:
            for mod in pkgutil.iter_modules(self.path):
                if not mod.ispkg and not mod.name.startswith("_") and mod.name not in self.skip:
                    importlib.import_module(f"{self.package}.{mod.name}")
            self.loaded = True
        return self.classes

    def build(self, name: str, params: dict[str, Any] | None = None) -> S:
        """Instantiate a registered step from its parameters; ValueError with the reason otherwise."""
        known = self.all()
        if name not in known:
            raise ValueError(f"unknown {self.kind} {name!r} (known: {', '.join(sorted(known)) or 'none'})")
        try:
            return msgspec.convert(params or {}, known[name])
        except msgspec.ValidationError as exc:
            raise ValueError(f"{self.kind} {name!r}: {exc}") from None


# the interface module holds no perturber
_PERTURBERS: Registry[Perturber] = Registry("perturber", __name__, __path__, frozenset({"base"}))
register = _PERTURBERS.register
registry = _PERTURBERS.all


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
    return _PERTURBERS.build(name, params)
