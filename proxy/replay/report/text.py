"""How the report writes numbers and stored values as text: accuracies, intervals, drops, p-values, short JSON.

The bottom of the report's layers (proxy/replay/report/): it imports nothing else of the report.
"""

from __future__ import annotations

import json
from typing import Any

#: stored texts (calls, perturbations) longer than this are cut, with " …"
MAX_TEXT = 1500


def short(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " …"


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def acc(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def rel(x: float | None) -> str:
    return "" if x is None else f" ({x * 100:+.0f}%)"


def ci(interval: list[float] | None) -> str:
    """[lo, hi] in the 0..1 scale of the tables beside it."""
    return "" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def pct_ci(x: float | None, ci: list[float] | None) -> str:
    """`62.5 % [48.1, 75.0]`."""
    if x is None:
        return "–"
    return f"{x * 100:.1f} %" + ("" if ci is None else f" [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]")


def drop_ci(x: float | None, ci: list[float] | None) -> str:
    """`-12.0 % [-25.3, +1.2]`."""
    if x is None:
        return "–"
    return f"{x * 100:+.1f} %" + ("" if ci is None else f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]")


def p_text(p: float | None) -> str:
    if p is None:
        return "–"
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"
