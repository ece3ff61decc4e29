"""`toolquake cases`: check a file of your own cases, make cases from a recording (docs/own-cases.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run_validate(args: argparse.Namespace) -> int:
    from toolquake.proxy.live.usercases import load_files

    loaded = load_files(args.files)
    for problem in loaded.problems:
        print(problem)
    print(f"{len(loaded.cases)} good case(s), {len(loaded.problems)} bad line(s)", file=sys.stderr)
    if any(p.line == 0 for p in loaded.problems):
        return 2
    return 1 if loaded.problems else 0


def run_schema(args: argparse.Namespace) -> int:
    from toolquake.proxy.live.usercases import SCHEMA_PATH

    sys.stdout.write(SCHEMA_PATH.read_text())
    return 0


def _names(text: str | None) -> set[str] | None:
    return None if text is None else {n.strip() for n in text.split(",") if n.strip()}


def _refuse(message: str) -> int:
    print(f"toolquake: {message}; nothing written", file=sys.stderr)
    return 2


def run_from_recording(args: argparse.Namespace) -> int:
    import os

    import regex

    from toolquake.proxy.live.recording import HEADER_KEY, read_recording
    from toolquake.proxy.live.redact import Redactor
    from toolquake.proxy.live.usercases import from_records

    out = Path(args.out)
    if out.resolve() in {Path(p).resolve() for p in args.recordings}:
        return _refuse(f"--out {out} is one of the recordings")
    if (out.exists() or out.is_symlink()) and not args.force:
        return _refuse(f"{out} exists; pass --force to overwrite it")
    try:
        redactor = Redactor(args.redact or [])
    except regex.error as exc:
        return _refuse(f"bad --redact pattern: {exc}")
    records, unredacted = [], 0
    for path in args.recordings:
        try:
            rec = read_recording(path)
        except OSError as exc:
            return _refuse(f"cannot read {path}: {exc.strerror or exc}")
        if not rec.header_first and not args.force:
            return _refuse(f"{path} is not a toolquake recording: its first line is not the recording header "
                           f"({{\"{HEADER_KEY}\": 1, ...}}, written by `toolquake serve --record`). A recording "
                           "written before headers existed, or JSON lines of the same shape from elsewhere: check "
                           "it, then pass --force")
        for line, reason in rec.problems:
            print(f"toolquake: {path}:{line}: skipped, not a record ({reason})", file=sys.stderr)
        if rec.torn:
            print(f"toolquake: {path}: skipped a torn last line (the proxy was stopped mid-write)", file=sys.stderr)
        # redacted again, as the recorder does: an old or foreign file, or one edited by hand, may hold secrets
        for record in rec.records:
            records.append(redactor(record))
            unredacted += records[-1] != record
    prefix = args.id_prefix or Path(args.recordings[0]).stem
    made = from_records(records, prefix=prefix, category=args.category, loosen=args.loosen_strings,
                        tools=_names(args.tools), tags=_names(args.tags), calls_only=args.calls_only)
    for reason in made.invalid:
        print(f"toolquake: left out {reason}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    # 0600 like the recording (the cases hold its conversations); never through an existing file unless --force
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.force else os.O_EXCL)
    try:
        fd = os.open(out, flags, 0o600)
    except OSError as exc:
        return _refuse(f"cannot write {out}: {exc.strerror or exc}")
    with os.fdopen(fd, "w") as f:
        for case in made.cases:
            f.write(json.dumps(case, ensure_ascii=False) + "\n")
    if unredacted:
        print(f"toolquake: {unredacted} exchange(s) held secret-shaped strings the recording had kept; they are "
              "[redacted] in the cases (the recording itself is left as it is)", file=sys.stderr)
    if redactor.timeouts:
        print(f"toolquake: {redactor.timeouts} text(s) took too long to scan and were replaced whole", file=sys.stderr)
    print(f"toolquake: wrote {len(made.cases)} case(s) to {out} from {len(records)} exchange(s): "
          f"{made.duplicates} duplicate(s), {made.conflicts} with another answer to the same conversation "
          f"(the first kept), {made.filtered} filtered out, {len(made.invalid)} unusable. Review the file, "
          f"then `toolquake cases validate {out}`.", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cases", help="your own test cases: validate a file, make cases from a recording",
                       description="Your agent's own test cases (JSON lines; docs/own-cases.md): check a file, "
                                   "print the JSON Schema of a line, or turn a recording (`toolquake serve "
                                   "--record`) into cases to review. Cases are replayed with `toolquake replay "
                                   "--cases FILE` and scored live with `toolquake serve --cases FILE`.")
    cmds = p.add_subparsers(dest="cases_command", metavar="SUBCOMMAND")
    cmds.required = True
    v = cmds.add_parser("validate", help="check cases files: every bad line with its number and reason",
                        description="Print FILE:LINE: reason for every line that is not a usable case. Exit status "
                                    "0 all good, 1 some bad lines (the good ones are still usable), 2 a file cannot "
                                    "be read.")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.set_defaults(func=run_validate)
    s = cmds.add_parser("schema", help="print the JSON Schema of one case line")
    s.set_defaults(func=run_schema)
    r = cmds.add_parser(
        "from-recording", help="turn recorded exchanges into cases",
        description="Each recorded exchange whose answer called tools becomes a case expecting those calls (each "
                    "argument's recorded value as its one acceptable value); a text answer becomes a \"no call\" "
                    "case. Exchanges of the same conversation (same messages and tool names) are kept once. "
                    "Every case is tagged tool:<name> for each tool called, call or no_call, and api:<route>. "
                    "Every string is redacted again on the way (secret shapes become [redacted]), whatever wrote "
                    "the recording. The file is meant to be reviewed and edited by hand.")
    r.add_argument("recordings", nargs="+", metavar="REC", help="recording files (JSON lines of `serve --record`)")
    r.add_argument("--out", required=True, help="the cases file to write (created 0600; an existing file is "
                   "refused unless --force)")
    r.add_argument("--force", action="store_true",
                   help="overwrite an existing --out, and read files that do not start with the recording header "
                        "(recordings made before headers existed)")
    r.add_argument("--redact", metavar="REGEX", action="append",
                   help="replace what this regular expression matches by [redacted] too, on top of the built-in "
                        "secret shapes every string is redacted for (as `[record] redact`; repeatable)")
    r.add_argument("--category", help="category of every case (default: none, so the cases file's stem)")
    r.add_argument("--id-prefix", help="prefix of the case ids (default: the first recording's stem)")
    r.add_argument("--loosen-strings", action="store_true",
                   help="accept case and whitespace variants of each recorded string argument (stripped, spaces "
                        "collapsed, lower, upper, title case) as acceptable values too")
    r.add_argument("--tools", metavar="NAMES", help="only exchanges whose answer calls one of these tools "
                   "(comma-separated; text answers are left out)")
    r.add_argument("--tags", metavar="TAGS", help="only cases with one of these tags (comma-separated, e.g. "
                   "no_call,tool:get_weather)")
    r.add_argument("--calls-only", action="store_true", help="leave out text answers (\"no call\" cases)")
    r.set_defaults(func=run_from_recording)
