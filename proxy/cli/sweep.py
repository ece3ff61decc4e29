"""`toolquake sweep`: per case, the breaking point along one perturbation axis, found by bisection
(proxy/replay/sweep.py); replay's selection and sending options, with the same names."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolquake.proxy.cli.replay import how_to_send, what_to_send

if TYPE_CHECKING:
    from toolquake.proxy.replay.sweep import SweepSummary

#: the categories swept when neither --categories nor --cases is given: the responses and conversations to grow
#: are in the multi-turn cases
DEFAULT_CATEGORIES = {"response_tokens": "multi_turn_base", "conversation_tokens": "multi_turn_base"}


def _position(text: str) -> int | float:
    """--position as written: a whole number stays an integer (a 1-based block index for the lengthening axes),
    anything else is a fraction (1 is the first block, 1.0 the end)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _remedy(text: str) -> dict[str, Any]:
    """--remedy NAME or NAME:{JSON parameters}, e.g. tool_search:{"k": 8}."""
    name, sep, params = text.partition(":")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:{{json}}, got {text!r}")
    try:
        decoded = json.loads(params) if sep else {}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--remedy {name}: the parameters are not JSON: {params!r}") from None
    if not isinstance(decoded, dict):
        raise argparse.ArgumentTypeError(f"--remedy {name}: the parameters must be a JSON object")
    return {"name": name.strip(), "params": decoded}


def run(args: argparse.Namespace) -> int:
    from toolquake.proxy.replay.breaking import remedy_moves
    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.selection import parse_shard
    from toolquake.proxy.replay.sweep import SweepOptions, run_sweep
    from toolquake.proxy.server import logs

    logs.configure("warning")
    categories = args.categories
    if categories is None:
        categories = "" if args.cases else DEFAULT_CATEGORIES.get(args.axis, "multiple")
    try:
        options = SweepOptions(
            backend=args.backend, profiles="off", out=Path(args.out), config=args.config,
            categories=[c.strip() for c in categories.split(",") if c.strip()], cases=list(args.cases or []),
            limit=args.limit, concurrency=args.concurrency, model=args.model, shard=parse_shard(args.shard),
            proxy=args.proxy, timeout=args.timeout, temperature=args.temperature,
            trials=args.trials, max_tokens=args.max_tokens,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None, headers=dict(args.header or []),
            semantic=args.semantic, fail_open=args.fail_open, progress=not args.no_progress,
            token_counter=args.token_counter, allow_estimate=args.allow_estimate, axis=args.axis, low=args.min,
            high=args.max,
            resolution=args.resolution, position=args.position, rule=args.rule,
            admin_token=args.admin_token or os.environ.get("TOOLQUAKE_ADMIN_TOKEN") or None,
            remedies=list(args.remedy or []))
        summary = run_sweep(options)
    except ReplayError as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("toolquake: interrupted; what was recorded is kept, rerun the same command to resume.", file=sys.stderr)
        return 130
    if summary.twin is not None:
        _print(summary.twin)
    _print(summary)
    if summary.twin is not None:
        print(remedy_moves(summary.remedies, _median(summary.twin), _median(summary), summary.points[-1],
                           summary.unit))
    if summary.aborted:
        print(f"toolquake: {summary.aborted}", file=sys.stderr)
        return 3
    runs = [summary] if summary.twin is None else [summary.twin, summary]
    return 1 if any(s.failed or len(s.outcomes) + s.not_comparable < s.cases for s in runs) else 0


def _median(summary: SweepSummary) -> float | None:
    """The median first wrong intensity of the finished cases (None: above the maximum, or no case done)."""
    points, done = summary.points, summary.outcomes
    broken = sorted(points[o.first_wrong] for o in done.values() if o.first_wrong is not None)
    return broken[(len(done) - 1) // 2] if done and (len(done) + 1) // 2 <= len(broken) else None


def _print(summary: SweepSummary) -> None:
    points = summary.points
    done = summary.outcomes
    censored = sum(1 for o in done.values() if o.censored)
    odd = sum(1 for o in done.values() if o.right_after)
    median = _median(summary)
    label = f" with {' + '.join(summary.remedies)}" if summary.remedies else ""
    print(f"{summary.axis}{label}: {len(done)} of {summary.cases} cases done; {censored} right even at "
          f"{points[-1]:g}; "
          f"{odd} not monotone; median first wrong "
          + (f"{median:g}" if median is not None else f"> {points[-1]:g}" if done else "-"))
    print(f"results: {summary.path} (sent {summary.sent}, failed {summary.failed}); `toolquake report "
          f"{summary.path.parent}` for the survival curve and the per-case table", file=sys.stderr)
    if summary.not_comparable:
        print(f"toolquake: {summary.not_comparable} case(s) stopped where the backend refused the request for its "
              "shape (too many tools, a parameter it does not accept): not comparable, no breaking point; lower "
              "--max below the API's limit", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep", help="per case, the breaking point along one perturbation axis (bisection)",
        description="For every case, find by bisection the largest intensity along one axis at which the model's "
                    "call is still right and the smallest at which it is wrong: --axis tools (tools in the request, "
                    "grown by catalog padding), related (related tools added by toolkit expansion), response_tokens "
                    "(tokens of the last tool response, grown as response_lengthening does), conversation_tokens "
                    "(tokens of the request, the conversation grown before the final turn), or any numeric axis a "
                    "perturber declares (`<perturber>.<param>`). The content at a higher intensity holds the content "
                    "at a lower one (the same additions in the same order, grown). About 15 requests per case over "
                    "a range of 200 points: the maximum, the minimum, the bisection, then checkpoints at each eighth "
                    "of the range that confirm the boundary (a case right again after breaking is reported as not "
                    "monotone). Multi-turn cases (multi_turn_base, the default for the token axes) are swept as whole "
                    "conversations, every step perturbed. A request the backend refuses (e.g. 400 "
                    "context_length_exceeded) or that keeps timing out is a wrong answer, as in replay. Every "
                    "request is recorded once in --out; rerunning the same command resumes. "
                    "`toolquake report DIR` draws the survival curve. Exit status as replay's: 0 every case done, 1 "
                    "some requests failed (rerun to retry), 2 bad arguments or unreachable backend, 3 the backend "
                    "went away.")
    p.add_argument("--axis", required=True, help="tools | related | response_tokens | conversation_tokens | any "
                   "declared axis (a perturber's `numeric_axes`), also as <perturber>.<param>, e.g. "
                   "catalog_padding.budget_tokens")
    p.add_argument("--min", type=float, default=None, help="lowest intensity (default: the axis' own, e.g. 1 tool, "
                   "0 related tools, 0 tokens; below the parameter's lowest value the request is sent as it is)")
    p.add_argument("--max", type=float, default=None, help="highest intensity (default: the axis' own, e.g. 200 "
                   "tools, 20 related tools, 80000 tokens)")
    p.add_argument("--resolution", type=float, default=None, help="the grid's step: breaking points are exact to it "
                   "(default: 1 for tools and related, which are always whole numbers; 500 response tokens; 1000 "
                   "conversation tokens)")
    p.add_argument("--position", type=_position, default=None, help="where the original content stays while the "
                   "rest grows: the perturber's `position` (catalog padding: the fraction of distractors before the "
                   "original tools, 0-1; lengthening: a whole number is a 1-based block index, a decimal a fraction: "
                   "1 is first, 1.0 last); default: the perturber's")
    p.add_argument("--trials", type=int, default=1, metavar="K", help="send each point K times (trial t with the "
                   "sampling seed trial_sampling_seed(case, t)) and take the --rule's verdict: for noisy backends "
                   "(--temperature > 0). Default 1")
    p.add_argument("--rule", choices=("majority", "all"), default="majority", help="with --trials: a point is right "
                   "when more than half of its K trials are (majority, default) or when all K are (all)")
    p.add_argument("--remedy", action="append", type=_remedy, metavar="NAME[:JSON]", help="a remedy applied after "
                   "the axis' step at every point, e.g. tool_search:'{\"k\": 8}' (repeatable, applied in order; "
                   "docs/remedies.md): the sweep then also runs its unremedied twin first (sweep.sqlite, then "
                   "sweep-remedied.sqlite in --out), prints how the median breaking point moves, and `toolquake "
                   "report` draws both survival curves on one plot")
    p.add_argument("--admin-token", help="with --proxy: that proxy's admin token (default: env "
                   "TOOLQUAKE_ADMIN_TOKEN); the sweep puts its profiles (sweep-<axis>-<x>) there through the admin "
                   "API. Never logged")
    what_to_send(p, "sweep")
    how_to_send(p)
    p.set_defaults(func=run)
