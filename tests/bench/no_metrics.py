"""`toolquake` with every Prometheus metric update a no-op: the arm of `proxy_overhead` that says what the default
configuration's metrics cost per request (counters, gauges and histograms still exist and are scraped; their
`inc`, `dec`, `set` and `observe` do nothing, so what is left of them per request is the look-up of a child).
Not a benchmark itself (`run_all` skips it); never used outside the benchmarks.

    python -m tests.bench.no_metrics serve --upstream URL ...
"""

from __future__ import annotations

import sys

from prometheus_client import Counter, Gauge, Histogram


def _nothing(*_args: object, **_kwargs: object) -> None:
    return None


def switch_off() -> None:
    for kind, methods in ((Counter, ("inc",)), (Gauge, ("inc", "dec", "set")), (Histogram, ("observe",))):
        for name in methods:
            setattr(kind, name, _nothing)


if __name__ == "__main__":
    switch_off()
    from toolquake.proxy.cli import main

    sys.exit(main(sys.argv[1:]))
