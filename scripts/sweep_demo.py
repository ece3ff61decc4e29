"""`make sweep-demo`: breaking points of a real model on this machine, no GPU.

Starts the embedded backend (SmolLM2-135M-Instruct on llama.cpp, grammar-constrained tool calling), sweeps BFCL
`multiple` cases along the `tools` axis (the request's tools grown by catalog padding, the case's own tools in the
middle) by bisection through the in-process proxy, prints the per-case breaking points and the survival curve,
writes the HTML report, and stops everything (docs/sweep.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sweep BFCL `multiple` cases along one axis on the embedded model "
                                                 "and report the breaking points (docs/sweep.md).")
    parser.add_argument("--cases", type=int, default=int(os.environ.get("SWEEP_DEMO_CASES", "6")),
                        help="the first N `multiple` cases (default 6, env SWEEP_DEMO_CASES)")
    parser.add_argument("--axis", default=os.environ.get("SWEEP_DEMO_AXIS", "tools"),
                        help="the axis (default tools, env SWEEP_DEMO_AXIS)")
    parser.add_argument("--min", type=float, default=float(os.environ.get("SWEEP_DEMO_MIN", "2")),
                        help="the lowest intensity (default 2 tools, env SWEEP_DEMO_MIN: a `multiple` case brings 2 "
                             "to 4 tools of its own, so below that the request is the case's own)")
    parser.add_argument("--max", type=float, default=float(os.environ.get("SWEEP_DEMO_MAX", "12")),
                        help="the highest intensity (default 12 tools, env SWEEP_DEMO_MAX; each tool costs the "
                             "embedded model about 230 prompt tokens, and its 8,192-token context holds about 30)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per answer (default 900)")
    parser.add_argument("--out", default=os.environ.get("SWEEP_DEMO_OUT", "out/sweep-demo"),
                        help="output directory (default out/sweep-demo, env SWEEP_DEMO_OUT; emptied first)")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_tokens per answer (default 96)")
    parser.add_argument("--parallel", type=int, default=max(1, min(os.cpu_count() or 1, 2)),
                        help="model instances, one CPU thread each (default: 2 on a machine with 2+ CPUs)")
    args = parser.parse_args(argv)

    from scripts.demo import fresh_dir, start_backend
    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.sweep import SweepOptions, run_sweep
    from toolquake.proxy.server import logs

    logs.configure("warning")
    out = fresh_dir(args.out)
    t0 = time.monotonic()
    backend = start_backend("sweep-demo", out, args.parallel)
    if backend is None:
        return 1
    try:
        print(f"sweep-demo: backend ready in {time.monotonic() - t0:.0f} s; sweeping {args.cases} `multiple` cases "
              f"along {args.axis} from {args.min:g} to {args.max:g}", flush=True)
        summary = run_sweep(SweepOptions(backend=backend.api_url, profiles="off", out=out / "results",
                                         categories=["multiple"], limit=args.cases, concurrency=args.parallel,
                                         max_tokens=args.max_tokens, timeout=args.timeout, axis=args.axis,
                                         low=args.min, high=args.max,
                                         position=0.5 if args.axis == "tools" else None))
    except ReplayError as exc:
        print(f"sweep-demo: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.stop()
        print("sweep-demo: backend stopped", flush=True)

    from toolquake.proxy.replay.report import build

    text, _ = build([out / "results"], "md", None, plots=False)
    print()
    print(text)
    html, _ = build([out / "results"], "html", None)
    (out / "report.html").write_text(html)
    print(f"sweep-demo: {summary.sent} requests in {time.monotonic() - t0:.0f} s ({summary.failed} failed); "
          f"HTML report: {out / 'report.html'}; results: {summary.path}")
    return 0 if summary.sent and not summary.failed else 1


if __name__ == "__main__":
    sys.exit(main())
