"""`make demo`: the whole product on this machine, no GPU.

Starts the embedded llama.cpp backend (SmolLM2-135M-Instruct), replays a slice of BFCL `multiple`
through the proxy (started in-process by the replay) under three arms — unperturbed, a toolkit
expanded with related tools (seed 001), and BFCL's default prompt-based format (seed 002) — prints
the leaderboard table, writes the HTML report, and stops everything. A 135M model scores low: the
point is a real model through the real pipeline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = "off,expanded,format-python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the embedded model through the proxy and report (make demo).")
    parser.add_argument("--cases", type=int, default=int(os.environ.get("DEMO_CASES", "30")),
                        help="number of BFCL `multiple` cases (default 30, env DEMO_CASES)")
    parser.add_argument("--profiles", default=os.environ.get("DEMO_PROFILES", ARMS),
                        help=f"arms to replay (default {ARMS}, env DEMO_PROFILES)")
    parser.add_argument("--out", default=os.environ.get("DEMO_OUT", str(ROOT / "out" / "demo")),
                        help="output directory (default out/demo; replaced on every run)")
    # a call in python syntax fits in 64 tokens; longer answers are prose, and cost time on 2 cores
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per answer (default 64)")
    args = parser.parse_args(argv)

    from toolquake.proxy.backend.local import BackendUnavailable, LocalBackend
    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.run import Options, run
    from toolquake.proxy.server import logs

    logs.configure("warning")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    backend = LocalBackend(log_path=out / "llama-server.log")
    print(f"demo: starting the embedded backend ({backend.model}, llama.cpp) on {backend.url} ...", flush=True)
    try:
        backend.start()
    except BackendUnavailable as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"demo: backend ready in {time.monotonic() - t0:.0f} s; replaying {args.cases} `multiple` cases x "
              f"{args.profiles} through the proxy", flush=True)
        summary = run(Options(backend=backend.api_url, profiles=args.profiles, out=out / "results",
                              categories=["multiple"], limit=args.cases, concurrency=2, max_tokens=args.max_tokens,
                              timeout=300.0))
    except ReplayError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.stop()
        print("demo: backend stopped", flush=True)

    from toolquake.proxy.replay.report import build

    text, _ = build([out / "results"], "md", None, plots=False)
    print()
    print(text)
    html, _ = build([out / "results"], "html", None)
    (out / "report.html").write_text(html)
    print(f"demo: {summary.sent} requests in {time.monotonic() - t0:.0f} s ({summary.failed} failed); "
          f"HTML report: {out / 'report.html'}; results: {summary.path}")
    return 0 if summary.sent and summary.failed < summary.sent else 1


if __name__ == "__main__":
    sys.exit(main())
