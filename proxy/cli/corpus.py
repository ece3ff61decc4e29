"""`toolquake corpus pull|path|list`: fetch and inspect the BFCL v4 corpus."""

from __future__ import annotations

import argparse
import json
import sys


def run_pull(args: argparse.Namespace) -> int:
    from toolquake.bfcl.corpus import CorpusError, pull

    try:
        path = pull(with_backends=args.with_backends, log=lambda msg: print(msg, file=sys.stderr))
    except CorpusError as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def run_path(args: argparse.Namespace) -> int:
    from toolquake.bfcl.corpus import data_dir

    try:
        print(data_dir())
    except FileNotFoundError as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    return 0


def run_list(args: argparse.Namespace) -> int:
    from toolquake.bfcl.corpus import CorpusError, category_counts

    try:
        counts = category_counts()
    except (FileNotFoundError, CorpusError) as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(counts))
        return 0
    width = max(len(name) for name in counts)
    for name, n in counts.items():
        print(f"{name:<{width}}  {n:>5}")
    print(f"{'total':<{width}}  {sum(counts.values()):>5}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from toolquake.bfcl.corpus import CORPUS_VERSION

    corpus = subparsers.add_parser(
        "corpus", help="fetch and inspect the BFCL v4 corpus",
        description=f"The BFCL v4 corpus (bfcl-eval=={CORPUS_VERSION} data files), kept under "
                    "$TOOLQUAKE_CACHE/bfcl/ (default ~/.cache/toolquake/bfcl/).")
    sub = corpus.add_subparsers(dest="corpus_command", metavar="ACTION")
    sub.required = True

    pull = sub.add_parser(
        "pull", help="download and extract the corpus (idempotent)",
        description="Download the bfcl-eval wheel with `pip download --no-deps` (your pip configuration "
                    "decides the index), keep it in the cache and extract its bfcl_eval/data/ files. Does "
                    "nothing when the corpus is already there. Prints the data directory.")
    pull.add_argument("--with-backends", action="store_true",
                      help="also install the wheel --no-deps into the cache, for the multi-turn API "
                           "simulators used by multi-turn scoring")
    pull.set_defaults(func=run_pull)

    path = sub.add_parser("path", help="print the data directory",
                          description="Print the corpus data directory; exit 1 when it was never pulled.")
    path.set_defaults(func=run_path)

    lst = sub.add_parser("list", help="print categories and entry counts",
                         description="Print every loadable category with its number of entries.")
    lst.add_argument("--json", action="store_true", help="print one JSON object {category: count} instead")
    lst.set_defaults(func=run_list)
