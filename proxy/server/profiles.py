"""Profiles at run time: named, ordered lists of built perturbers (then remedies), replaceable through the admin API.

With several workers (`toolquake serve --workers N`) a change made through the admin API on one worker
reaches the others through `SharedProfiles`: a snapshot file of every profile's spec and a generation
number in a shared memory page, which each worker compares with its own on every look-up (one memory
read) and, when they differ, reloads the snapshot.

The number of profiles is bounded (`[server] max_profiles`, `off` not counted) for the whole proxy: a worker
checks it after taking the other workers' changes, under the same lock. A profile deleted on any worker is
reported to each worker's `on_gone` (its metric series are removed).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import structlog

from toolquake import remedies
from toolquake.perturbers import Perturber, build
from toolquake.proxy.server.config import ProfileSpec

OFF = "off"
log = structlog.get_logger("toolquake.proxy")
_GEN = struct.Struct("<Q")
_snapshot_decoder = msgspec.json.Decoder(dict[str, ProfileSpec])


@dataclass(frozen=True)
class Step:
    perturber: Perturber
    probability: float


@dataclass(frozen=True)
class Profile:
    name: str
    spec: ProfileSpec
    steps: tuple[Step, ...]
    #: applied after every step, in order (`remedies = [{ name, params }]`)
    remedies: tuple[remedies.Remedy, ...] = ()

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def active(self) -> bool:
        """The profile changes requests (a perturbation step or a remedy): in front of traffic or in its twins."""
        return self.spec.mode != "off" and bool(self.steps or self.remedies)

    @property
    def perturbs(self) -> bool:
        """Requests served under this profile are changed before they go upstream (never the lean path)."""
        return self.spec.mode == "perturb" and bool(self.steps or self.remedies)

    def all_steps(self) -> tuple[Perturber, ...]:
        """The perturbers, then the remedies, in the order they run."""
        return tuple(s.perturber for s in self.steps) + self.remedies


def build_profile(name: str, spec: ProfileSpec) -> Profile:
    steps = tuple(Step(build(p.name, p.params), p.probability) for p in spec.perturbers)
    return Profile(name, spec, steps, tuple(remedies.build(r.name, r.params) for r in spec.remedies))


class TooManyProfiles(Exception):
    """A new profile past `[server] max_profiles`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The proxy holds {limit} profiles ([server] max_profiles); delete one first, or ask the "
                         "operator to raise the limit.")
        self.limit = limit


class SharedProfiles:
    """The profiles the workers of one server agree on, in `directory`: `profiles.json` (every profile but
    `off`, written by the worker that changed one) and `generation` (bumped after each write)."""

    def __init__(self, directory: Path) -> None:
        self.snapshot = directory / "profiles.json"
        self._lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fd = os.open(directory / "generation", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _GEN.size:
                os.ftruncate(fd, _GEN.size)
            self._gen = mmap.mmap(fd, _GEN.size)
        finally:
            os.close(fd)

    def generation(self) -> int:
        return _GEN.unpack_from(self._gen)[0]

    @contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def read(self) -> tuple[int, dict[str, ProfileSpec] | None]:
        """(generation, specs); None before any worker wrote a snapshot. Call while locked."""
        gen = self.generation()
        try:
            return gen, _snapshot_decoder.decode(self.snapshot.read_bytes())
        except FileNotFoundError:
            return gen, None

    def write(self, specs: dict[str, ProfileSpec]) -> int:
        """Replace the snapshot and bump the generation (call while locked exclusively); the new generation."""
        tmp = self.snapshot.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(specs))
        os.replace(tmp, self.snapshot)
        gen = self.generation() + 1
        _GEN.pack_into(self._gen, 0, gen)
        return gen


class ProfileStore:
    """Profiles by name. `off` always exists and cannot be replaced or deleted.

    `shared` (several workers): changes are published to, and picked up from, the other workers.
    `limit`: the most profiles besides `off` (a put adding one more raises TooManyProfiles).
    `on_new` is called with the profiles this worker built from another worker's change (to warm them up);
    `on_gone` with the names of profiles deleted here or by another worker.
    """

    def __init__(self, specs: dict[str, ProfileSpec], shared: SharedProfiles | None = None,
                 limit: int | None = None) -> None:
        self._profiles: dict[str, Profile] = {OFF: build_profile(OFF, ProfileSpec(mode="off"))}
        for name, spec in specs.items():
            self._profiles[name] = build_profile(name, spec)
        #: the operator's profiles (`off`, then the config file's in its order): the only names told to any client
        self.configured = tuple(self._profiles)
        self._shared = shared
        self._gen = 0
        self.limit = limit
        self.on_new: Callable[[list[Profile]], None] | None = None
        self.on_gone: Callable[[list[str]], None] | None = None

    def _check(self) -> None:
        if self._shared is not None and self._shared.generation() != self._gen:
            with self._shared.locked(exclusive=False):
                self._sync()

    def _sync(self) -> None:
        """Take the shared snapshot (the caller holds the lock)."""
        assert self._shared is not None
        gen, specs = self._shared.read()
        if specs is not None:
            new = []
            gone = [n for n in self._profiles if n != OFF and n not in specs]
            for name in gone:
                del self._profiles[name]
            self._gone(gone)
            for name, spec in specs.items():
                current = self._profiles.get(name)
                if current is not None and current.spec == spec:
                    continue
                try:
                    self._profiles[name] = build_profile(name, spec)
                    new.append(self._profiles[name])
                except Exception as exc:  # validated by the worker that wrote it; keep serving what we have
                    log.warning("shared_profile_unusable", profile=name, error=str(exc)[:300])
            if new and self.on_new is not None:
                self.on_new(new)
        self._gen = gen

    def _gone(self, names: list[str]) -> None:
        if names and self.on_gone is not None:
            try:
                self.on_gone(names)
            except Exception as exc:  # a hook that fails never fails the change
                log.warning("profile_gone_hook_failed", error_type=type(exc).__name__, error=str(exc)[:300])

    def _publish(self, change: Callable[[], object]) -> object:
        if self._shared is None:
            return change()
        with self._shared.locked(exclusive=True):
            self._sync()  # another worker's change first, so that it is not lost
            result = change()
            self._gen = self._shared.write({n: p.spec for n, p in self._profiles.items() if n != OFF})
        return result

    def get(self, name: str) -> Profile | None:
        self._check()
        return self._profiles.get(name)

    def names(self) -> list[str]:
        self._check()
        return sorted(self._profiles)

    def configured_now(self) -> list[str]:
        """The operator's profiles that exist now (`off` first, then the config file's in its order)."""
        self._check()
        return [name for name in self.configured if name in self._profiles]

    def specs(self) -> dict[str, ProfileSpec]:
        self._check()
        return {name: p.spec for name, p in self._profiles.items()}

    def put(self, name: str, spec: ProfileSpec) -> Profile:
        """Add or replace `name`; TooManyProfiles (nothing changed) where adding it would pass `limit`."""
        if name == OFF:
            raise ValueError("profile 'off' is built in and cannot be replaced")
        profile = build_profile(name, spec)

        def change() -> None:  # after every worker's changes are in (under the lock): the count is the proxy's
            if self.limit is not None and name not in self._profiles and len(self._profiles) - 1 >= self.limit:
                raise TooManyProfiles(self.limit)
            self._profiles[name] = profile

        self._publish(change)
        return profile

    def delete(self, name: str) -> bool:
        if name == OFF:
            raise ValueError("profile 'off' is built in and cannot be deleted")
        deleted = bool(self._publish(lambda: self._profiles.pop(name, None) is not None))
        if deleted:
            self._gone([name])
        return deleted
