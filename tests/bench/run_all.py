"""Every benchmark in one command (`make bench`): each script in tests/bench/ runs in its own process,
one after another (they share two cores; running them together would measure the contention).

    python -m tests.bench.run_all [--only NAME,...] [--skip NAME,...] [--soak-minutes M] [--out bench-results]

The soak runs only with --soak-minutes (it takes that long); `ab` and `granian_ab` only by hand. Each
script's own output is kept in OUT/<name>.log; OUT/summary.md collects them with their exit status and duration.
"""

from __future__ import annotations

import argparse
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
#: `ab` compares configurations given on its command line, `granian_ab` needs granian (not a dependency):
#: both are run by hand (docs/benchmarks.md has their command lines); `no_metrics` is an arm of proxy_overhead
NOT_BENCHMARKS = {"run_all", "soak", "ab", "granian_ab", "no_metrics"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated benchmark names to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names to skip")
    ap.add_argument("--soak-minutes", type=float, default=0.0, help="also run the soak for this many minutes")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    names = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name not in NOT_BENCHMARKS)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    names = [n for n in names if n not in args.skip.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(n, [sys.executable, "-m", f"tests.bench.{n}"]) for n in names]
    if args.soak_minutes:
        runs.append(("soak", [sys.executable, "-m", "tests.bench.soak", "--minutes", str(args.soak_minutes),
                              "--out", str(out)]))
    summary = ["# Benchmarks", ""]
    failed = 0
    for name, cmd in runs:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent.parent)
        took = time.monotonic() - t0
        text = done.stdout + (f"\n[stderr]\n{done.stderr[-4000:]}" if done.returncode else "")
        (out / f"{name}.log").write_text(text)
        print(done.stdout[-6000:], flush=True)
        failed += done.returncode != 0
        summary += [
            f"## {name} (exit {done.returncode}, {took:.0f} s)",
            "",
            "```",
            done.stdout.strip()[-6000:],
            "```",
            "",
        ]
    (out / "summary.md").write_text("\n".join(summary))
    print(f"wrote {out / 'summary.md'}; {failed} benchmark(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
