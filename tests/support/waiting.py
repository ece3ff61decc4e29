"""Waiting for something to be true, instead of sleeping and hoping it happened."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str = "the condition",
             interval: float = 0.05) -> T:
    """Call `predicate` until it returns something truthy and return that; AssertionError naming `what` (and the
    last value seen) after `timeout` seconds. The timeout is a bound on a hang, not a measure of speed: keep it
    generous (a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {got!r})")
        time.sleep(interval)
