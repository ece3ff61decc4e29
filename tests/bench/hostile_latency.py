"""Another client's `/healthz` latency while a hostile client sends the inputs that made two packaged profiles'
perturbers scan in quadratic time (issue 28 item 1; tests/server/test_hostile_latency.py asserts the behaviour:
every poll answered, no stall of the event loop of that size). This measures the speed the test no longer asserts.

    python -m tests.bench.hostile_latency [--rounds 3] [--polls 50]

Each round: the fake upstream and `toolquake serve` with the packaged profiles, the hostile requests repeated until
/healthz was polled `--polls` times. Prints one JSON line per round: the polls, their p50/p99/max in ms, the
hostile requests answered, and the slowest event-loop lag bucket the proxy recorded.
"""

from __future__ import annotations

import argparse
import json


def one_round(polls: int) -> dict[str, object]:
    import httpx

    from tests.support import metric_samples, start_fake_upstream, start_proxy
    from tests.support.server import hostile_attack

    fake = start_fake_upstream()
    proxy = start_proxy(fake.url)
    try:
        got = hostile_attack(proxy.url, polls)
        lat = sorted(got["latencies"])
        samples = metric_samples(httpx.get(f"{proxy.url}/metrics").text)
    finally:
        proxy.stop()
        fake.stop()
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
                     if name == "toolquake_event_loop_lag_seconds_bucket")
    total = max(v for _, v in buckets)
    slowest = next(le for le, v in buckets if v == total)  # the smallest bucket edge holding every observation

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(len(lat) * q))] * 1000, 1)

    return {"polls": len(lat), "healthz_p50_ms": pct(0.5), "healthz_p99_ms": pct(0.99),
            "healthz_max_ms": round(lat[-1] * 1000, 1), "hostile_answered": len(got["answered"]),
            "errors": [repr(e) for e in got["errors"]], "loop_lag_at_most_s": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--polls", type=int, default=50)
    args = ap.parse_args()
    for _ in range(args.rounds):
        print(json.dumps(one_round(args.polls)), flush=True)


if __name__ == "__main__":
    main()
