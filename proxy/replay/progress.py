"""Replay progress per arm: a rich live display on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Progress per arm with ETA and running accuracy: a rich live display on a terminal, lines otherwise."""

    def __init__(self, arms: list[str], totals: dict[str, int], done: dict[str, tuple[int, int]],
                 enabled: bool = True, stream: Any = None, command: str = "replay", unit: str = "pairs") -> None:
        #: how the lines name the run and what it counts (`toolquake sweep`: "sweep", "cases")
        self.command, self.unit = command, unit
        self.arms = arms
        self.totals = totals
        self.tally = {a: list(done.get(a, (0, 0))) for a in arms}
        self.failed = {a: 0 for a in arms}
        self.stream = stream or sys.stderr
        self.todo = sum(totals.values()) - sum(n for n, _ in self.tally.values())
        self.finished = 0
        self._rich = None
        self._next_line = 0.0
        self._t0 = time.monotonic()
        if not enabled:
            self.stream = None
            return
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                      TimeRemainingColumn(), console=Console(file=self.stream), transient=False)
            self._overall = self._rich.add_task(f"all {unit}", total=max(self.todo, 0), acc="")
            self._tasks = {a: self._rich.add_task(a, total=totals.get(a, 0), completed=self.tally[a][0],
                                                  acc=self._acc(a)) for a in arms}

    def _acc(self, arm: str) -> str:
        n, v = self.tally[arm]
        text = f"acc {v / n:.3f} (n={n})" if n else "acc -"
        return text + (f" failed {self.failed[arm]}" if self.failed[arm] else "")

    def __enter__(self) -> Progress:
        if self._rich is not None:
            self._rich.start()
        elif self.stream is not None:
            print(f"{self.command}: {self.todo} {self.unit} to send", file=self.stream, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.stream is not None and self.finished < self.todo:
            self._line(force=True)

    def advance(self, arm: str, valid: bool | None) -> None:
        self.finished += 1
        if valid is None:
            self.failed[arm] += 1
        else:
            self.tally[arm][0] += 1
            self.tally[arm][1] += int(valid)
        if self._rich is not None:
            self._rich.update(self._tasks[arm], completed=self.tally[arm][0] + self.failed[arm], acc=self._acc(arm))
            self._rich.advance(self._overall)
        elif self.stream is not None:
            self._line()

    def _line(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_line and self.finished < self.todo:
            return
        self._next_line = now + 10.0
        rate = self.finished / max(now - self._t0, 1e-9)
        eta = (self.todo - self.finished) / rate if rate > 0 else float("inf")
        arms = "; ".join(f"{a} {self._acc(a)}" for a in self.arms)
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        print(f"{self.command}: {self.finished}/{self.todo} {self.unit}, ETA {eta_text} | {arms}", file=self.stream,
              flush=True)
