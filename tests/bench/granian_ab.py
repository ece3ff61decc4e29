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
from typing import Any

from tests.bench.ab import compare
from tests.bench.proxy_overhead import BODY, run_asyncio, run_wrk
from tests.support import start_fake_upstream, start_process, start_proxy
from tests.support.ports import held_port

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
        with held_port("127.0.0.1") as port:  # granian cannot say which port it got: held until it binds it
            procs["granian"] = start_process(
                ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                 "--loop", "uvloop", "--http", "1", "--no-access-log", "--factory", "tests.bench.granian_ab:make"],
                port, env={"TOOLQUAKE_UPSTREAM": f"{fake.url}/v1"})
        for proc in procs.values():
            run_asyncio(proc.url, 4, 1.0)
        payload = json.dumps(BODY).encode()
        for conns in [int(c) for c in args.concurrency.split(",")]:
            compare(procs, "passthrough", payload, conns, args.rounds, args.seconds, load)
    finally:
        for proc in procs.values():
            proc.stop()
        fake.stop()


if __name__ == "__main__":
    main()
