"""Profiles at run time: named, ordered lists of built perturbers, replaceable through the admin API."""

from __future__ import annotations

from dataclasses import dataclass

from toolquake.perturbers import Perturber, build
from toolquake.proxy.server.config import ProfileSpec

OFF = "off"


@dataclass(frozen=True)
class Step:
    perturber: Perturber
    probability: float


@dataclass(frozen=True)
class Profile:
    name: str
    spec: ProfileSpec
    steps: tuple[Step, ...]

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def active(self) -> bool:
        return self.spec.mode != "off" and bool(self.steps)


def build_profile(name: str, spec: ProfileSpec) -> Profile:
    steps = tuple(Step(build(p.name, p.params), p.probability) for p in spec.perturbers)
    return Profile(name, spec, steps)


class ProfileStore:
    """Profiles by name. `off` always exists and cannot be replaced or deleted."""

    def __init__(self, specs: dict[str, ProfileSpec]) -> None:
        self._profiles: dict[str, Profile] = {OFF: build_profile(OFF, ProfileSpec(mode="off"))}
        for name, spec in specs.items():
            self._profiles[name] = build_profile(name, spec)

    def get(self, name: str) -> Profile | None:
        return self._profiles.get(name)

    def names(self) -> list[str]:
        return sorted(self._profiles)

    def specs(self) -> dict[str, ProfileSpec]:
        return {name: p.spec for name, p in self._profiles.items()}

    def put(self, name: str, spec: ProfileSpec) -> Profile:
        if name == OFF:
            raise ValueError("profile 'off' is built in and cannot be replaced")
        profile = build_profile(name, spec)
        self._profiles[name] = profile
        return profile

    def delete(self, name: str) -> bool:
        if name == OFF:
            raise ValueError("profile 'off' is built in and cannot be deleted")
        return self._profiles.pop(name, None) is not None
