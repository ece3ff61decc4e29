"""Replay throughput: pairs per second through the in-process proxy, against sending the same bodies
straight to the upstream (the floor), plus the cost of a resume with nothing left and of one commit.

    python -m tests.bench.replay_throughput [--cases 200] [--rounds 2] [--concurrency 4]

The fake upstream answers instantly, so the numbers are replay's own cost: proxy, grading, SQLite.
Rounds alternate direct / replay; medians are printed with their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support import start_fake_upstream


async def _direct(url: str, bodies: list[dict], concurrency: int) -> float:
    queue = list(bodies)
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        async def worker() -> None:
            while queue:
                body = queue.pop()
                r = await client.post(f"{url}/v1/chat/completions", json=body)
                r.raise_for_status()
                r.json()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200, help="BFCL `multiple` cases per arm (default 200)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()

    from toolquake.bfcl.corpus import case_request
    from toolquake.proxy.replay.run import Options, run
    from toolquake.proxy.replay.selection import select_cases
    from toolquake.proxy.replay.store import Record, ResultsFile
    from toolquake.proxy.server import logs

    logs.configure("warning")
    try:
        cases = select_cases(["multiple"], args.cases, None)
    except FileNotFoundError as exc:
        print(f"needs the corpus: {exc}")
        return 1
    profiles = "off,reversed"
    pairs = len(cases) * 2
    bodies = [case_request(c, model="fake-model") for c in cases for _ in range(2)]
    fake = start_fake_upstream()
    direct, replayed, resumed = [], [], []
    try:
        for i in range(args.rounds):
            direct.append(asyncio.run(_direct(fake.url, bodies, args.concurrency)))
            out = Path(tempfile.mkdtemp(prefix="toolquake-bench-replay-"))
            opts = Options(backend=f"{fake.url}/v1", profiles=profiles, out=out, limit=args.cases,
                           concurrency=args.concurrency, progress=False)
            t0 = time.perf_counter()
            summary = run(opts, log=lambda _m: None)
            replayed.append(time.perf_counter() - t0)
            assert summary.sent == pairs and summary.failed == 0, summary
            t0 = time.perf_counter()
            again = run(opts, log=lambda _m: None)
            resumed.append(time.perf_counter() - t0)
            assert again.sent == 0
            print(f"round {i + 1}: direct {direct[-1]:.2f} s, replay {replayed[-1]:.2f} s, "
                  f"resume with nothing left {resumed[-1]:.2f} s", flush=True)
    finally:
        fake.stop()

    f = ResultsFile(Path(tempfile.mkdtemp(prefix="toolquake-bench-commit-")) / "replay.sqlite")
    n = 500
    t0 = time.perf_counter()
    for i in range(n):
        f.record(Record(f"case_{i}", "off", "multiple", "scored", valid=True, answer={"choices": [{"message": {}}]}))
    commit_ms = (time.perf_counter() - t0) / n * 1000
    f.close()

    d, r, z = statistics.median(direct), statistics.median(replayed), statistics.median(resumed)
    print()
    print(f"pairs per run: {pairs} ({len(cases)} cases x {profiles}), concurrency {args.concurrency}")
    print(f"direct to upstream : {pairs / d:8.1f} requests/s")
    print(f"replay (end to end): {pairs / r:8.1f} pairs/s  (includes start-up of the in-process proxy)")
    print(f"ratio replay/direct: {d / r:8.3f}  (1.0 = replay costs nothing over the bare requests)")
    print(f"replay cost per pair over direct: {(r - d) / pairs * 1000:.2f} ms")
    print(f"resume with nothing left: {z:.2f} s; one SQLite commit: {commit_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
