"""The replay's one error type."""

from __future__ import annotations


class ReplayError(RuntimeError):
    """A replay that cannot start or go on (unreachable backend, bad arguments, a foreign results file)."""
