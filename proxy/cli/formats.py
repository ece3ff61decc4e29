"""`toolquake formats`: the 26 call-format configurations of BFCL V4 format sensitivity, and what they send."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DESCRIPTION = """\
List the 26 prompt configurations of BFCL V4's format-sensitivity study (return format × tool-call
tag × function-doc format, plus the markdown layout and the experimental wording), numbered in
BFCL's order, or show what one of them sends upstream for a BFCL case or a request of your own:
the format_rewrite perturber's system prompt, with the conversation history rewritten as text.
A configuration is named by its number (1…26) or by BFCL's string
'ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic'.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("formats", help="list the 26 BFCL V4 call-format configurations, or render one",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--case", help="render the configuration for this BFCL case id (needs `toolquake corpus pull`)")
    src.add_argument("--request", help="render it for this chat-completions request (JSON file with 'messages' "
                                       "and 'tools', or - for stdin)")
    p.add_argument("--config", default="6", help="the configuration to render: number 1…26 or BFCL's config "
                                                 "string (default: 6, BFCL's default prompt)")
    p.add_argument("--show", choices=("prompt", "body"), default="prompt",
                   help="'prompt' prints the messages as text (default); 'body' prints the upstream request JSON")
    p.add_argument("--json", action="store_true", help="list the configurations as JSON lines instead of a table")
    p.set_defaults(func=run)


def _table(as_json: bool) -> int:
    from toolquake.perturbers.helpers.callformats import CONFIGURATIONS

    if not as_json:
        print(f"{'#':>2}  {'return_format':<13} {'tag':<5} {'doc_format':<10} {'prompt':<9} {'style':<12} config")
    for n, c in enumerate(CONFIGURATIONS, 1):
        if as_json:
            print(json.dumps({"number": n, "return_format": c.return_format, "tool_call_tag": c.tool_call_tag,
                              "function_doc_format": c.function_doc_format, "prompt_format": c.prompt_format,
                              "prompt_style": c.prompt_style, "config": c.config_string}))
        else:
            print(f"{n:>2}  {c.return_format:<13} {str(c.tool_call_tag):<5} {c.function_doc_format:<10} "
                  f"{c.prompt_format:<9} {c.prompt_style:<12} {c.config_string}")
    return 0


def _source(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The request to render (from --request or --case) and its BFCL case (None for --request)."""
    from toolquake.proxy.cli.common import load_request

    body = load_request(args)
    if not args.case:
        return body, None
    from toolquake.bfcl.cases import case_by_id

    return body, case_by_id(args.case)


def _render(args: argparse.Namespace) -> int:
    import random

    from toolquake.perturbers import ChatRequest, PerturbContext, Services
    from toolquake.perturbers.format_rewrite import FormatRewrite
    from toolquake.perturbers.helpers.callformats import CallFormat

    try:
        fmt = CallFormat.parse(args.config)
    except ValueError as exc:
        sys.exit(f"toolquake: --config: {exc}")
    body, case = _source(args)
    perturber = FormatRewrite(return_format=fmt.return_format, function_doc_format=fmt.function_doc_format,
                              tool_call_tag=fmt.tool_call_tag, prompt_format=fmt.prompt_format,
                              prompt_style=fmt.prompt_style)
    ctx = PerturbContext(perturbation_seed=0, rng=random.Random(0), services=Services(), case=case)
    sent = perturber.apply(ChatRequest(body), ctx).body
    if "skipped" in ctx.report:
        print(f"toolquake: nothing to render: {ctx.report['skipped']}", file=sys.stderr)
    if args.show == "body":
        json.dump(sent, sys.stdout, ensure_ascii=False, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"# configuration: {fmt.config_string}")
    for msg in sent.get("messages") or []:
        content = msg.get("content")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        print(f"\n=== {msg.get('role')} ===\n{text}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.case or args.request:
            return _render(args)
        return _table(args.json)
    except BrokenPipeError:  # `toolquake formats | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
