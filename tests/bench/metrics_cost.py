"""What the per-request metrics cost: the exact updates a passthrough answer makes (in flight up and down,
the typed decode's counter, the request counter, four histograms, the conformance check counter; with live
scoring on, as by default, the unlabeled counter too), timed in one process.

    python -m tests.bench.metrics_cost [--n 200000]

Prints the CPU time per request's worth of updates, best of 5 runs, single-process (a `MutexValue` per
sample) — the proxy's one-worker case. Set PROMETHEUS_MULTIPROC_DIR to an empty directory to time the
multi-worker case (a memory-mapped file per sample) instead.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    args = ap.parse_args()
    import os

    from toolquake.proxy.server.metrics import Metrics

    m = Metrics(multiprocess=bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))

    from prometheus_client import Counter

    # live scoring's (proxy/live/metrics.py): an unperturbed request tied to no case is counted as unlabeled
    skipped = Counter("toolquake_scoring_skipped", "", ["profile", "reason"], registry=m.registry)

    # as the request's decode, the plain answer path, the observe and conformance steps and the live scorer do for
    # a 2xx passthrough answer in the default configuration
    def one_request() -> None:
        m.in_flight.inc()
        m.child(m.request_decodes, "typed").inc()
        m.child(m.ttfb, "off", "false").observe(0.0021)
        m.child(m.requests, "off", "chat_completions", "2xx", "false", m.model_label("fake")).inc()
        m.child(m.duration, "off", "chat_completions", "false").observe(0.0021)
        m.child(m.upstream_duration, "chat_completions", "false").observe(0.0017)
        m.child(m.overhead, "chat_completions", "false").observe(0.0004)
        m.in_flight.dec()
        m.child(m.conformance_checks, m.model_label("fake"), "chat_completions", "false").inc()
        m.child(skipped, "off", "unlabeled").inc()

    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(args.n):
            one_request()
        best = min(best, (time.process_time() - t0) / args.n)
    print(f"metric updates per passthrough request: {best * 1e6:.2f} µs CPU (best of 5 × {args.n:,})")


if __name__ == "__main__":
    main()
