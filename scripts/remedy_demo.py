"""`make remedy-demo`: a remedy winning back accuracy on padded catalogs, measured on this machine, no GPU.

Starts the embedded backend (SmolLM2-135M-Instruct on llama.cpp, grammar-constrained tool calling), replays BFCL
`multiple` cases through the in-process proxy under three arms — `off`, the catalog padded to a number of tools
(`pad`: catalog_padding with `tools`, the case's own in the middle; a tool costs this model about 230 prompt tokens
and its 8,192-token context holds about 30, so the padding is counted in tools, not seed 003's 8K-120K budgets), and
the same padding followed by `tool_search` (`search-pad`) — prints the report's remedies section (accuracy off /
padded / remedied, the share of the loss won back with its interval, McNemar, cases won and lost, tokens saved),
writes the HTML report, and stops everything (docs/remedies.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.demo import fresh_dir, model_args, start_backend  # noqa: E402

CONFIG = """
[profiles.pad]
description = "The catalog padded with BFCL tools to {tools} tools, the case's own in the middle."
mode = "perturb"
perturbers = [{{ name = "catalog_padding", params = {{ tools = {tools}, position = 0.5 }} }}]

[profiles.search-pad]
description = "pad, then tool_search: the {k} tools most related to the conversation kept."
mode = "perturb"
perturbers = [{{ name = "catalog_padding", params = {{ tools = {tools}, position = 0.5 }} }}]
remedies = [{{ name = "tool_search", params = {{ k = {k} }} }}]
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Replay BFCL `multiple` cases on the embedded model with a padded "
                                                 "catalog, without and with tool_search (docs/remedies.md).")
    parser.add_argument("--cases", type=int, default=int(os.environ.get("REMEDY_DEMO_CASES", "20")),
                        help="the first N `multiple` cases (default 20, env REMEDY_DEMO_CASES)")
    parser.add_argument("--tools", type=int, default=int(os.environ.get("REMEDY_DEMO_TOOLS", "12")),
                        help="tools in the padded request (default 12, env REMEDY_DEMO_TOOLS; the embedded model's "
                             "context holds about 30)")
    parser.add_argument("--k", type=int, default=int(os.environ.get("REMEDY_DEMO_K", "4")),
                        help="tools tool_search keeps (default 4, env REMEDY_DEMO_K: a `multiple` case brings 2 to 4 "
                             "of its own)")
    parser.add_argument("--out", default=os.environ.get("REMEDY_DEMO_OUT", "out/remedy-demo"),
                        help="output directory (default out/remedy-demo, env REMEDY_DEMO_OUT; emptied first)")
    model_args(parser)
    args = parser.parse_args(argv)

    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.run import Options, run
    from toolquake.proxy.server import logs

    logs.configure("warning")
    out = fresh_dir(args.out)
    config = out / "remedy-demo.toml"
    config.write_text(CONFIG.format(tools=args.tools, k=args.k))
    t0 = time.monotonic()
    backend = start_backend("remedy-demo", out, args.parallel)
    if backend is None:
        return 1
    try:
        print(f"remedy-demo: backend ready in {time.monotonic() - t0:.0f} s; replaying {args.cases} `multiple` cases "
              f"x off, pad ({args.tools} tools), search-pad (tool_search k={args.k})", flush=True)
        summary = run(Options(backend=backend.api_url, profiles="off,pad,search-pad", out=out / "results",
                              config=str(config), categories=["multiple"], limit=args.cases,
                              concurrency=args.parallel, max_tokens=args.max_tokens, timeout=600.0))
    except ReplayError as exc:
        print(f"remedy-demo: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.stop()
        print("remedy-demo: backend stopped", flush=True)

    from toolquake.proxy.replay.report import build, load, summarize

    numbers = summarize(load([out / "results"]))
    print()
    for e in numbers["remedies"]:
        print(what_it_won(e))
    html, _ = build([out / "results"], "html", None)
    (out / "report.html").write_text(html)
    text, _ = build([out / "results"], "md", None, plots=False)
    (out / "report.md").write_text(text)
    print(f"remedy-demo: {summary.sent} requests in {time.monotonic() - t0:.0f} s ({summary.failed} failed); "
          f"reports: {out / 'report.md'}, {out / 'report.html'}; results: {summary.path}")
    return 0 if summary.sent and summary.failed < summary.sent else 1


def what_it_won(e: dict) -> str:
    """One remedied arm in words: the three accuracies, the share won back, the paired test."""
    def pct(x: float | None, ci: list[float] | None = None) -> str:
        if x is None:
            return "–"
        return f"{x * 100:.1f} %" + ("" if ci is None else f" [{ci[0] * 100:.1f}, {ci[1] * 100:.1f}]")

    share = ("undefined (the padding lost nothing)" if e["won_back"] is None else
             f"{e['won_back'] * 100:.0f} %" + (" [interval unbounded]" if e["won_back_ci"] is None else
                                               f" [{e['won_back_ci'][0] * 100:.0f}, {e['won_back_ci'][1] * 100:.0f}]"))
    saved = "" if e["tokens_saved"] is None else f"; {e['tokens_saved']:.0f} prompt tokens saved per request"
    p = "–" if e["p_value"] is None else f"{e['p_value']:.2g}"
    return (f"{e['profile']} ({' + '.join(e['remedies'])}) on {e['n']} cases: off "
            f"{pct(e['accuracy_off'], e['accuracy_off_ci'])}, "
            f"padded {pct(e['accuracy_perturbed'], e['accuracy_perturbed_ci'])}, remedied "
            f"{pct(e['accuracy_remedied'], e['accuracy_remedied_ci'])}; loss won back {share}; "
            f"{e['cases_won']} cases won, {e['cases_lost']} lost (McNemar p = {p}){saved}.")


if __name__ == "__main__":
    sys.exit(main())
