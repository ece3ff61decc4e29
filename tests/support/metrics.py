"""Prometheus exposition read the way Prometheus reads it (prometheus-client's parser)."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metrics_text(server: Any) -> str:
    """GET /metrics of `server` (a `Proc`, or a base URL)."""
    url = server if isinstance(server, str) else server.url
    return httpx.get(f"{url.rstrip('/')}/metrics", timeout=30.0).text


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample: (name, sorted label pairs) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for (n, lbls), v in metric_samples(text).items():
        d = dict(lbls)
        if n == name and all(d.get(k) == val for k, val in labels.items()):
            total += v
    return total


def scraped(server: Any, name: str, **labels: str) -> float:
    """`metric_value` of `server`'s /metrics right now."""
    return metric_value(metrics_text(server), name, **labels)
