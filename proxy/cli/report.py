"""`toolquake report`: tables and heatmaps from replay results (proxy/replay/report.py) or the live results store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    if not args.dirs and not args.db:
        print("toolquake: give one or more replay directories (or --db PATH for the live results store)",
              file=sys.stderr)
        return 2
    from toolquake.proxy.live.results import StoreError
    from toolquake.proxy.replay.report import build

    try:
        text, written = build(args.dirs, args.format, out, baseline=args.baseline, plots=not args.no_plots,
                             csv_stats=args.csv_stats, csv_cases=args.csv_cases, csv_tables=args.csv_tables,
                             db=args.db)
    except StoreError as exc:  # a missing, foreign or newer results store: say so, no traceback
        print(f"toolquake: cannot read the results store {args.db}: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"toolquake: {exc.name or exc} is needed for the heatmaps: pip install -e '.[replay]', or pass "
              "--no-plots", file=sys.stderr)
        return 2
    _emit(text, out)
    for path in written:
        print(f"toolquake: wrote {path}", file=sys.stderr)
    return 0


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"toolquake: wrote {out}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="tables and heatmaps from replay results and the live results store",
        description="Merge the results of one or more replay directories (shards of one run, or runs of several "
                    "models) and report: accuracy per arm with the relative change against the baseline in "
                    "brackets (seed 001 Table 2), the error-type breakdown of each perturbed arm, per-category "
                    "tables, a BFCL-style CSV, and heatmaps (catalog size × position like seed 003 Fig. 3, each budget "
                    "labelled with the tokens reached; format configuration × model like seed 002 Fig. 2) when the "
                    "arms support them; seed 003's Tables 1, 5, 6 (catalog padding), 7 with Fig. 4's line plots "
                    "(long tool responses) and 2 (long conversations); for `@faults` and "
                    "`@metadata` arms, accuracy per kind and the recovered share after failed tool results "
                    "(multi-turn replays, 95 % Wilson intervals). Requests that failed on the backend's side "
                    "(refused, e.g. context_length_exceeded; timed out or 500 after retries; unreadable) count as "
                    "wrong answers, as BFCL counts them, listed by code, with the accuracy over the answered "
                    "requests beside; pairs not scored yet (the proxy's or network's failures) are in no number. "
                    "`toolquake sweep` results (sweep*.sqlite) add, per model and axis, the "
                    "survival curve with pointwise 95 % intervals, the median breaking point with its interval, the "
                    "censored and non-monotone cases, per category and per case, runs overlaid and compared pairwise "
                    "(docs/sweep.md).")
    p.add_argument("dirs", nargs="*", metavar="DIR", help="replay or sweep --out directories (or replay*.sqlite, "
                   "sweep*.sqlite files)")
    p.add_argument("--format", choices=("md", "html", "json", "csv"), default="md",
                   help="md (default; heatmap PNGs written next to --out), html (one file, heatmaps embedded), "
                        "json ({\"arms\": {profile: {n, accuracy, by_category, errors, ...}}}), csv (BFCL's "
                        "leaderboard columns: Rank, Overall Acc, Model, Profile, N, one column per category)")
    p.add_argument("--out", help="write the report to this file (default: stdout)")
    p.add_argument("--baseline", default="off", help="profile the relative changes are computed against "
                   "(default off)")
    p.add_argument("--csv-stats", action="store_true", help="csv: append the 95 %% interval and paired-test "
                   "columns (accuracy CI, drop vs baseline with CI, flips, McNemar p) after the BFCL columns")
    p.add_argument("--csv-cases", action="store_true", help="csv: the per-case diffs instead of the leaderboard "
                   "(one row per case whose verdict flipped against the baseline: model, profile, case, category, "
                   "direction, error type, perturbation applied, expected calls, the arm's and the baseline's calls)")
    p.add_argument("--csv-tables", action="store_true", help="csv: seed 003's tables instead of the leaderboard, "
                   "in long form (Table, Model, Group, Held Fixed, Statistic, Value, Arm, N, CI Low, CI High): "
                   "Max / Min / %% Deg. of Tables 1, 5, 6 and 7, Fig. 4's points and Table 2's cells")
    p.add_argument("--no-plots", action="store_true", help="skip the heatmaps (no matplotlib needed)")
    p.add_argument("--db", metavar="PATH", help="the live results store of `toolquake serve --results-db`: its "
                   "arms (model \"live\") in every table and format, with its shadow consistency, noise floor, "
                   "conformance and anytime-valid intervals; alone, or beside replay DIRs")
    p.set_defaults(func=run)
