"""`make demo`: the whole product on this machine, no GPU, with a signal.

Starts the embedded backend (toolquake's own OpenAI-compatible server on llama.cpp, SmolLM2-135M-Instruct,
grammar-constrained tool calling), replays BFCL `multiple` cases through the proxy (started in-process by the
replay) under three arms — unperturbed (`off`), the tool list shuffled (`shuffled`), and three related tools
added to the toolkit (`expanded`, seed 001) — prints the leaderboard and what the drop means, writes the
HTML report, and stops everything. About 4 minutes on 2 cores once installed (docs/backend.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = "off,shuffled,expanded"


def leaderboard(summary: dict[str, Any]) -> str:
    """The arms, best first: accuracy with its 95 % Wilson interval, the drop against `off` with its interval,
    the paired flips and McNemar's exact p (from `toolquake report`'s JSON summary)."""
    from toolquake.proxy.replay.report import ALPHA, drop_ci, p_text, pct_ci

    arms = sorted(summary["arms"].items(), key=lambda kv: -(kv[1]["accuracy"] or 0.0))
    head = ("arm", "n", "accuracy [95 % CI]", "drop vs off [95 % CI]", "valid→invalid", "invalid→valid",
            "McNemar p", f"drop ≠ 0 at {ALPHA}")
    rows = []
    for name, arm in arms:
        cmp = arm.get("paired")
        rows.append((name, str(arm["n"]), pct_ci(arm["accuracy"], arm["accuracy_ci"]),
                     "(baseline)" if name == summary["baseline"] else drop_ci(arm["drop_vs_off"],
                                                                              arm["drop_vs_off_ci"]),
                     *((str(cmp["valid_to_invalid"]), str(cmp["invalid_to_valid"]), p_text(cmp["p_value"]),
                        "yes" if cmp["significant"] else "no") if cmp else ("–", "–", "–", "–"))))
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in (head, *rows))


def any_significant(summary: dict[str, Any]) -> bool:
    """Whether some arm's accuracy fell against the baseline distinguishably from zero (paired test)."""
    return any((a.get("paired") or {}).get("significant") and (a.get("drop_vs_off") or 0) < 0
               for a in summary["arms"].values())


def meaning(summary: dict[str, Any]) -> str:
    """One paragraph: what the changes against `off` say, read through the paired test."""
    from toolquake.proxy.replay.report import ALPHA, drop_ci, p_text

    base = summary["arms"].get(summary["baseline"])
    if base is None or not base["accuracy"]:
        return "No `off` arm with a non-zero accuracy: nothing to compare the perturbed arms with."
    n = base["n"]
    parts = []
    for arm, a in summary["arms"].items():
        cmp = a.get("paired")
        if arm == summary["baseline"] or not cmp:
            continue
        verdict = ("a drop distinguishable from zero" if cmp["significant"] and (a["drop_vs_off"] or 0) < 0 else
                   "a change distinguishable from zero" if cmp["significant"] else
                   "not distinguishable from no change on this sample")
        parts.append(f"`{arm}` {a['accuracy']:.3f} ({drop_ci(a['drop_vs_off'], a['drop_vs_off_ci'])}; "
                     f"{cmp['valid_to_invalid']} cases lost, {cmp['invalid_to_valid']} gained, McNemar p = "
                     f"{p_text(cmp['p_value'])}: {verdict} at {ALPHA})")
    return (f"What it shows: on the same {n} BFCL `multiple` cases the unperturbed arm (`off`) scores "
            f"{base['accuracy']:.3f}; " + "; ".join(parts) + ". Every arm asks for the same calls; only the request "
            "around them changed — the "
            "order of the tools (`shuffled`), or three related but wrong tools added next to the right ones "
            "(`expanded`) — so a drop is the model's brittleness, not a harder task, and the relative drop is the "
            "number seed 001's Table 2 reports; the error table says how it fails (a `wrong_function` share that "
            "grows under `expanded` means the model called a look-alike instead of the right tool). "
            + (f"SmolLM2-135M on a small sample (a case is 1/{n} of the score): "
               + ("at least one drop is distinguishable from zero here. " if any_significant(summary) else
                  "the arms differ, but no drop is distinguishable from zero on this sample — the paired test "
                  "is what tells a real effect from a few cases flipping either way. ")
               + "Run more cases (--cases) or a real backend for numbers to quote."))


def model_args(parser: argparse.ArgumentParser) -> None:
    """The embedded model's options every demo takes: --max-tokens, --parallel."""
    # a call to a BFCL `multiple` function in the grammar's JSON fits in 96 tokens; a cut answer is invalid
    parser.add_argument("--max-tokens", type=int, default=96, help="max_tokens per answer (default 96)")
    parser.add_argument("--parallel", type=int, default=max(1, min(os.cpu_count() or 1, 2)),
                        help="model instances, one CPU thread each (default: 2 on a machine with 2+ CPUs)")


def fresh_dir(path: str | Path) -> Path:
    """The demo's output directory, emptied."""
    out = Path(path)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def start_backend(name: str, out: Path, parallel: int) -> Any:
    """The embedded backend started: `parallel` instances of one CPU thread each (one instance: llama.cpp's own
    threads), its log in out/backend.log; None, the reason printed, when it cannot start. Used by every demo."""
    from toolquake.proxy.backend.local import BackendUnavailable, LocalBackend

    backend = LocalBackend(parallel=parallel, threads=1 if parallel > 1 else None, log_path=out / "backend.log")
    print(f"{name}: starting the embedded backend ({backend.model}, {parallel} instance(s)) ...", flush=True)
    try:
        backend.start()
        print(f"{name}: the embedded backend listens on {backend.url}", flush=True)
        return backend
    except BackendUnavailable as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the embedded model through the proxy and report (make demo).")
    parser.add_argument("--cases", type=int, default=int(os.environ.get("DEMO_CASES", "40")),
                        help="number of BFCL `multiple` cases (default 40, env DEMO_CASES)")
    parser.add_argument("--profiles", default=os.environ.get("DEMO_PROFILES", ARMS),
                        help=f"arms to replay (default {ARMS}, env DEMO_PROFILES)")
    parser.add_argument("--out", default=os.environ.get("DEMO_OUT", str(ROOT / "out" / "demo")),
                        help="output directory (default out/demo; replaced on every run)")
    model_args(parser)
    args = parser.parse_args(argv)

    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.run import Options, run
    from toolquake.proxy.server import logs

    logs.configure("warning")
    out = fresh_dir(args.out)
    t0 = time.monotonic()
    backend = start_backend("demo", out, args.parallel)
    if backend is None:
        return 1
    try:
        print(f"demo: backend ready in {time.monotonic() - t0:.0f} s; replaying {args.cases} `multiple` cases x "
              f"{args.profiles} through the proxy", flush=True)
        summary = run(Options(backend=backend.api_url, profiles=args.profiles, out=out / "results",
                              categories=["multiple"], limit=args.cases, concurrency=args.parallel,
                              max_tokens=args.max_tokens, timeout=300.0))
    except ReplayError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.stop()
        print("demo: backend stopped", flush=True)

    from toolquake.proxy.replay.report import build, load, summarize

    text, _ = build([out / "results"], "md", None, plots=False)
    print()
    print(text)
    numbers = summarize(load([out / "results"]))
    print("Leaderboard (95 % Wilson intervals; paired against `off` on the same cases, McNemar's exact test):")
    print(leaderboard(numbers))
    print()
    print(meaning(numbers))
    print()
    html, _ = build([out / "results"], "html", None)
    (out / "report.html").write_text(html)
    print(f"demo: {summary.sent} requests in {time.monotonic() - t0:.0f} s ({summary.failed} failed); "
          f"HTML report: {out / 'report.html'}; results: {summary.path}")
    return 0 if summary.sent and summary.failed < summary.sent else 1


if __name__ == "__main__":
    sys.exit(main())
