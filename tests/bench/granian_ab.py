"""Same-run A/B of the HTTP server under the proxy: uvicorn + httptools (what `toolquake serve` runs) vs granian.

`python -m tests.bench.granian_ab [--seconds 3] [--rounds 3] [--concurrency 1,64]` (needs `pip install granian`;
not a dependency of toolquake). Both arms serve the same app (`create_app` with the packaged profiles, scoring
off, one process, uvloop) in front of one fake upstream; alternating wrk rounds; per arm the medians of req/s,
p50 and the server process's CPU per request (its /proc counters), and granian's ratio to uvicorn. Granian runs
the app with `--factory` from this module (`make`, config from TOOLQUAKE_UPSTREAM like `serve`); it is measured
here only — `toolquake serve` keeps uvicorn (docs/benchmarks.md says why).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from typing import Any

from tests.bench.proxy_overhead import BODY, cpu_per_request, proc_tree, run_asyncio, run_wrk
from tests.conftest import free_port, start_fake_upstream, start_process, start_proxy

CONFIG = "[scoring]\nenabled = false\n"


def make() -> Any:
    """The proxy's ASGI app as `toolquake serve` builds it for one worker (granian's --factory target)."""
    import os
    import tempfile

    from toolquake.proxy import live
    from toolquake.proxy.live import recording
    from toolquake.proxy.server import logs
    from toolquake.proxy.server.app import create_app
    from toolquake.proxy.server.config import PACKAGED_CONFIG, load_config

    path = os.path.join(tempfile.mkdtemp(prefix="toolquake-granian-"), "config.toml")
    with open(path, "w") as f:
        f.write(PACKAGED_CONFIG.read_text() + "\n" + CONFIG)
    config = load_config(path)
    logs.configure(config.server.log_level)
    return create_app(config, extensions=[live.attach, recording.attach])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,64")
    args = ap.parse_args()
    try:
        import granian  # noqa: F401
    except ImportError:
        raise SystemExit("granian is not installed: pip install granian") from None
    load = run_wrk if shutil.which("wrk") else run_asyncio
    fake = start_fake_upstream()
    procs = {}
    try:
        from toolquake.proxy.server.config import PACKAGED_CONFIG

        procs["uvicorn"] = start_proxy(fake.url, PACKAGED_CONFIG.read_text() + "\n" + CONFIG)
        port = free_port()
        procs["granian"] = start_process(
            ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--loop", "uvloop", "--http", "1", "--no-access-log", "--factory", "tests.bench.granian_ab:make"],
            port, env={"TOOLQUAKE_UPSTREAM": f"{fake.url}/v1"})
        for proc in procs.values():
            run_asyncio(proc.url, 4, 1.0)
        payload = json.dumps(BODY).encode()
        for conns in [int(c) for c in args.concurrency.split(",")]:
            rounds: dict[str, list[dict]] = {n: [] for n in procs}
            for _ in range(args.rounds):
                for name, proc in procs.items():
                    rounds[name].append(cpu_per_request(proc.url, proc_tree(proc.popen.pid), conns, args.seconds,
                                                        load, payload=payload))
            med = {n: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "cpu_ms_per_request")}
                   for n, rs in rounds.items()}
            print(f"\npassthrough, {conns} connections, medians of {args.rounds} alternating rounds of "
                  f"{args.seconds:g} s")
            print("| server | req/s | p50 | CPU per request | vs uvicorn (req/s, CPU) | non-2xx |")
            print("|---|---:|---:|---:|---:|---:|")
            for n, m in med.items():
                bad = sum(r["non2xx"] for r in rounds[n])
                u = med["uvicorn"]
                print(f"| {n} | {m['rps']:.0f} | {m['p50_ms']:.3f} ms | {m['cpu_ms_per_request']:.3f} ms | "
                      f"{m['rps'] / u['rps']:.2f}×, {m['cpu_ms_per_request'] / u['cpu_ms_per_request']:.2f}× | {bad} |")
    finally:
        for proc in procs.values():
            proc.stop()
        fake.stop()


if __name__ == "__main__":
    main()
