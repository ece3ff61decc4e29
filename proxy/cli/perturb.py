"""`toolquake perturb`: apply a profile to one request without sending it (a dry run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from toolquake.proxy.cli.common import config_from_args, load_request


def run(args: argparse.Namespace) -> int:
    from toolquake.perturbers import ChatRequest, Services, shown_params
    from toolquake.perturbers.helpers.tokens import counter_label, make_counter
    from toolquake.proxy.server.pipeline import perturbation_seed_for, run_profile
    from toolquake.proxy.server.profiles import ProfileStore

    config = config_from_args(args, upstream=args.upstream)
    store = ProfileStore(config.profiles)
    profile = store.get(args.profile)
    if profile is None:
        sys.exit(f"toolquake: unknown profile {args.profile!r} (known: {', '.join(store.names())})")
    body = load_request(args)
    case = None
    if args.case:
        from toolquake.bfcl.cases import case_by_id

        case = case_by_id(args.case)
    raw = json.dumps(body).encode()
    perturbation_seed = (args.seed if args.seed is not None
                         else perturbation_seed_for(None, raw, request=ChatRequest(body)))
    services = Services(token_counter=make_counter(config.server.token_counter, config.server.upstream))
    outcome = asyncio.run(run_profile(profile, ChatRequest(body), perturbation_seed, services, case))
    json.dump(outcome.request.body, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")
    summary = {"profile": profile.name, "seed": perturbation_seed,
               "token_counter": counter_label(services.token_counter),
               "applied": [{"name": a.name, "params": shown_params(a.params), **a.report,
                            **({"kind": a.kind} if a.kind else {})}
                           for a in outcome.applied],
               "skipped": outcome.skipped, "failed": outcome.failed}
    if outcome.remedies_failed:
        summary["remedies_failed"] = outcome.remedies_failed
    print(json.dumps(summary, ensure_ascii=False), file=sys.stderr)
    return 1 if outcome.failed or outcome.remedies_failed else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    perturb = subparsers.add_parser("perturb", help="dry run: print a perturbed request",
                             description="Apply a profile to one request without sending it: the perturbed "
                                         "body (JSON) goes to stdout, what was applied to stderr.")
    perturb.add_argument("--config", help="TOML config file with the profile (default: the packaged profiles)")
    perturb.add_argument("--profile", required=True, help="profile to apply")
    src = perturb.add_mutually_exclusive_group(required=True)
    src.add_argument("--request", help="chat-completions request body (JSON file, or - for stdin)")
    src.add_argument("--case", help="BFCL case id (needs `toolquake corpus pull`)")
    perturb.add_argument("--seed", type=int,
                         help="the perturbation seed, which seeds the perturbers' randomness (default: as the proxy "
                              "derives it from the request: the conversation key, else a hash of the body)")
    perturb.add_argument("--upstream", help="backend base URL, used by the 'upstream' token counter")
    perturb.set_defaults(func=run)
