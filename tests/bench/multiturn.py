"""Cost of multi-turn scoring in the sandboxed worker, against BFCL's own in-process checker.

    python -m tests.bench.multiturn [--cases 50] [--calls 2000] [--out bench-results]

Needs the corpus and the simulators (`toolquake corpus pull --with-backends`). Three measurements:
* worker start (spawn, import the simulators, install the audit hook, first answer);
* one call dispatched to the worker (`pwd()` on the file system; pickle + pipe + JSON each way) against
  the same call through BFCL's `execute_multi_turn_func_call` in process (regex rewrite + `eval`);
* `scorers.multiturn.check` on the ground-truth trajectories of `--cases` cases per category against
  BFCL's `multi_turn_checker` on the same trajectories (both re-execute model and ground truth).
Prints a Markdown table with ours / BFCL ratios and writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _bfcl(root: Path) -> tuple[Any, Any]:
    sys.path.insert(0, str(root))
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    return multi_turn_checker, multi_turn_utils


def _fc_strings(calls: list[dict[str, Any]]) -> list[str]:
    return [f"{c['name']}({','.join(f'{k}={v!r}' for k, v in c['arguments'].items())})" for c in calls]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=50, help="cases per multi-turn category (default 50)")
    ap.add_argument("--calls", type=int, default=2000, help="single calls timed for dispatch (default 2000)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()

    from toolquake.bfcl.corpus import MULTI_TURN_CATEGORIES, load_category
    from toolquake.bfcl.simulators import Backends, Call, ensure_installed
    from toolquake.scorers.multiturn import check, ground_truth_result

    try:
        root = ensure_installed()
    except FileNotFoundError as exc:
        print(f"multiturn benchmark skipped: {exc}")
        return 0
    checker, utils = _bfcl(root)
    rows: list[dict[str, Any]] = []

    starts = []
    for _ in range(3):
        t0 = time.perf_counter()
        with Backends() as b:
            b.request("ping")
            starts.append((time.perf_counter() - t0) * 1000)
    rows.append({"what": "worker start", "ours_ms": statistics.median(starts), "bfcl_ms": None})

    case = load_category("multi_turn_base")[0]
    classes, config = case.extra["involved_classes"], case.extra["initial_config"]
    with Backends() as backends:
        world = backends.world(classes, config)
        world.execute([Call("cd", (), {"folder": "document"})])
        t0 = time.perf_counter()
        for _ in range(args.calls):
            world.execute([Call("pwd")])
        ours = (time.perf_counter() - t0) / args.calls * 1000
        utils.execute_multi_turn_func_call(["cd(folder='document')"], config, classes, "bench", case.id)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            utils.execute_multi_turn_func_call(["pwd()"], config, classes, "bench", case.id)
        theirs = (time.perf_counter() - t0) / args.calls * 1000
        rows.append({"what": "one call (pwd)", "ours_ms": ours, "bfcl_ms": theirs})

        cases = [c for cat in MULTI_TURN_CATEGORIES for c in load_category(cat)[:args.cases]]
        trajectories = [(c, ground_truth_result(c, backends)) for c in cases]
        t0 = time.perf_counter()
        valid = sum(check(c, r, backends=backends).valid for c, r in trajectories)
        ours = (time.perf_counter() - t0) / len(cases) * 1000
        t0 = time.perf_counter()
        theirs_valid = 0
        for n, (c, r) in enumerate(trajectories):
            decoded = [[_fc_strings(s.calls) for s in turn if s.calls] for turn in r.turns]
            entry = {"id": c.id, "initial_config": c.extra["initial_config"],
                     "involved_classes": c.extra["involved_classes"]}
            model = f"bench_{n}"
            theirs_valid += bool(checker.multi_turn_checker(decoded, c.ground_truth, entry, c.category,
                                                            model)["valid"])
            for key in [k for k in vars(utils) if k.startswith(model)]:
                del vars(utils)[key]
        theirs = (time.perf_counter() - t0) / len(cases) * 1000
        rows.append({"what": f"check one case ({len(cases)} ground-truth trajectories; valid: ours {valid}, "
                             f"BFCL {theirs_valid})", "ours_ms": ours, "bfcl_ms": theirs})

    lines = ["| measurement | ours (ms) | BFCL in process (ms) | ours / BFCL |", "|---|---:|---:|---:|"]
    for r in rows:
        ratio = "" if not r["bfcl_ms"] else f"{r['ours_ms'] / r['bfcl_ms']:.2f}"
        bfcl = "" if r["bfcl_ms"] is None else f"{r['bfcl_ms']:.3f}"
        lines.append(f"| {r['what']} | {r['ours_ms']:.3f} | {bfcl} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "cases_per_category": args.cases,
            "calls": args.calls}
    (out / "multiturn.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "multiturn.md").write_text(f"# Multi-turn scoring cost\n\n{json.dumps(meta)}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
