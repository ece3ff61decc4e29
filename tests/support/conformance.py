"""Reading `toolquake conformance`'s report."""

from __future__ import annotations


def rule_rows(out: str) -> dict[str, tuple[str, str]]:
    """rule → (result, where) from the probe's rule table."""
    from toolquake.proxy.server.conformance import RULES

    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in RULES:
            rows[cells[0]] = (cells[1], cells[2])
    return rows
