"""`toolquake score`: BFCL-compatible verdicts for answers to corpus cases, one JSON line per input line."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from typing import Any, TextIO

INPUT_ERROR = "toolquake:input_error"

HELP = """\
Input: JSON lines, one answer each, identified by a corpus case id:
  {"id": "simple_python_0", "calls": [{"name": "calculate_triangle_area", "arguments": {"base": 10}}]}
  {"id": "simple_python_0", "text": "[calculate_triangle_area(base=10, height=5)]"}
  {"id": "multiple_0", "message": {"role": "assistant", "tool_calls": [...]}}
"calls" use the corpus's (dotted) function names; "arguments" may be an object or a JSON string.
"text" is BFCL's python call syntax, decoded with a safe AST walk (never evaluated).
"message" is an OpenAI assistant message; tool names are mapped back to the corpus's names.
Output: one JSON line per input line, in input order, with id, category, mode, valid, error_type,
errors and taxonomy (in fair/semantic modes also bfcl_valid). A line that cannot be scored (malformed
JSON, unknown id, missing fields, a multi-turn case) gets valid=false, error_type "toolquake:input_error"
and taxonomy "input_error", and is counted apart in the summary.
"""


def _input_error(case_id: Any, message: str, mode: str, category: str | None = None) -> dict[str, Any]:
    return {"id": case_id if isinstance(case_id, (str, int)) else None, "category": category, "mode": mode,
            "valid": False, "error_type": INPUT_ERROR, "errors": [message], "taxonomy": "input_error"}


def _calls_from_record(record: dict[str, Any], case: Any) -> Any:
    """The answer of one input record as calls or a DecodeFailure; ValueError for unusable input."""
    from toolquake.bfcl.convert import to_openai_tools
    from toolquake.bfcl.decode import DecodeFailure, calls_from_message, decode_python

    if "calls" in record:
        calls = record["calls"]
        if not isinstance(calls, list):
            raise ValueError("'calls' must be a list of {name, arguments}")
        out = []
        for call in calls:
            if not isinstance(call, dict) or "name" not in call:
                raise ValueError("each call needs a 'name' and 'arguments'")
            args = call.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError as exc:
                    return DecodeFailure(f"arguments are not JSON: {exc}")
            out.append({"name": call["name"], "arguments": args})
        return out
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError("'text' must be a string")
        tag = False
        if case.category == "format_sensitivity":
            config = dict(part.split("=", 1) for part in case.extra["format_config"].split("&") if "=" in part)
            if config.get("ret_fmt") != "python":
                raise ValueError(f"return format {config.get('ret_fmt')!r} is not decoded by `score` "
                                 "(only the python call syntax is)")
            tag = config.get("tool_call_tag") == "True"
        elif case.category in ("simple_java", "simple_javascript"):
            raise ValueError("Java/JavaScript text is not decoded by `score`: give 'calls' whose argument "
                             "values are the source text of each value")
        return decode_python(text, tool_call_tag=tag)
    if "message" in record:
        _, name_map = to_openai_tools(case.functions)
        return calls_from_message(record["message"], name_map)
    raise ValueError("a line needs 'calls', 'text' or 'message'")


def score_line(line: str, mode: str, underscore_to_dot: bool = False) -> dict[str, Any]:
    """The verdict line for one input line (never raises on bad input)."""
    from toolquake.bfcl.corpus import load_case
    from toolquake.scorers.ast_checker import check

    try:
        record = json.loads(line)
    except ValueError as exc:
        return _input_error(None, f"malformed JSON line: {exc}", mode)
    if not isinstance(record, dict):
        return _input_error(None, "each line must be a JSON object", mode)
    case_id = record.get("id")
    if not isinstance(case_id, str):
        return _input_error(case_id, "missing or non-string 'id'", mode)
    try:
        case = load_case(case_id)
    except LookupError as exc:
        return _input_error(case_id, str(exc).strip("'\""), mode)
    try:
        calls = _calls_from_record(record, case)
        verdict = check(case, calls, mode, underscore_to_dot=underscore_to_dot)
        bfcl = verdict if mode == "bfcl" else check(case, calls, "bfcl", underscore_to_dot=underscore_to_dot)
    except ValueError as exc:
        return _input_error(case_id, str(exc), mode, case.category)
    out = {"id": case_id, "category": case.category, "mode": mode, "valid": verdict.valid,
           "error_type": verdict.error_type, "errors": verdict.errors, "taxonomy": verdict.taxonomy}
    if mode != "bfcl":
        out["bfcl_valid"] = bfcl.valid
    return out


class Summary:
    def __init__(self, mode: str):
        self.mode = mode
        self.by_category: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, row: dict[str, Any]) -> None:
        counts = self.by_category[row["category"] or "(input error)"]
        counts["total"] += 1
        if row["error_type"] == INPUT_ERROR:
            counts["input_errors"] += 1
            return
        counts["valid"] += row["valid"]
        if row["taxonomy"]:
            counts[f"taxonomy:{row['taxonomy']}"] += 1
        if "bfcl_valid" in row and row["bfcl_valid"] != row["valid"]:
            counts["flipped_to_valid" if row["valid"] else "flipped_to_invalid"] += 1

    def as_dict(self) -> dict[str, Any]:
        categories = {}
        overall: Counter[str] = Counter()
        for name in sorted(self.by_category):
            counts = self.by_category[name]
            overall.update(counts)
            scored = counts["total"] - counts["input_errors"]
            categories[name] = {**counts, "accuracy": round(counts["valid"] / scored, 4) if scored else None}
        scored = overall["total"] - overall["input_errors"]
        out = {"mode": self.mode, "categories": categories,
               "overall": {**overall, "accuracy": round(overall["valid"] / scored, 4) if scored else None}}
        if self.mode == "semantic":
            from toolquake.scorers.semantic import default_equivalence

            matcher = default_equivalence()
            out["embeddings"] = ("used" if matcher.embeddings_used else
                                 f"unavailable ({matcher.embeddings_error})" if matcher.embeddings_error else
                                 "not needed")
        return out

    def table(self) -> str:
        data = self.as_dict()
        flips = self.mode != "bfcl"
        head = f"{'category':<26}{'total':>7}{'valid':>7}{'acc':>8}{'input_err':>10}"
        head += f"{'+valid':>8}{'-valid':>8}" if flips else ""
        lines = [f"mode: {self.mode}", head]
        rows = list(data["categories"].items()) + [("overall", data["overall"])]
        for name, c in rows:
            acc = f"{c['accuracy'] * 100:.2f}%" if c["accuracy"] is not None else "n/a"
            line = f"{name:<26}{c.get('total', 0):>7}{c.get('valid', 0):>7}{acc:>8}{c.get('input_errors', 0):>10}"
            if flips:
                line += f"{c.get('flipped_to_valid', 0):>8}{c.get('flipped_to_invalid', 0):>8}"
            lines.append(line)
        if flips:
            lines.append("+valid / -valid: verdicts this mode flips to valid / to invalid, against bfcl mode")
        if "embeddings" in data:
            lines.append(f"embeddings: {data['embeddings']}")
        return "\n".join(lines)


def score_stream(source: TextIO, sink: TextIO | None, mode: str, underscore_to_dot: bool = False) -> Summary:
    summary = Summary(mode)
    for raw in source:
        line = raw.rstrip("\n")
        row = score_line(line, mode, underscore_to_dot)
        summary.add(row)
        if sink is not None:
            sink.write(json.dumps(row, ensure_ascii=False, default=repr) + "\n")
    return summary


def run(args: argparse.Namespace) -> int:
    from toolquake.bfcl.corpus import data_dir

    try:
        data_dir()
    except FileNotFoundError as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 1
    try:
        source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as exc:
        print(f"toolquake: cannot read {args.input}: {exc}", file=sys.stderr)
        return 1
    try:
        sink = open(args.output, "w", encoding="utf-8") if args.output else (None if args.summary else sys.stdout)
    except OSError as exc:
        print(f"toolquake: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    with source:
        summary = score_stream(source, sink, args.mode, args.underscore_to_dot)
    if args.output and sink is not None:
        sink.close()
    if args.summary:
        print(json.dumps(summary.as_dict()))
    else:
        print(summary.table(), file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    score = subparsers.add_parser(
        "score", help="score answers to corpus cases (BFCL AST rules)", description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    score.add_argument("--input", required=True, help="JSON-lines file of answers, or - for stdin")
    score.add_argument("--mode", choices=("bfcl", "fair", "semantic"), default="bfcl",
                       help="bfcl: BFCL's verdict exactly (default); fair: parallel calls matched in any "
                            "order (backtracking); semantic: fair + equivalent strings accepted "
                            "(normalisation, then embeddings when the embeddings extra is installed)")
    score.add_argument("--output", help="write the verdict lines to this file instead of stdout")
    score.add_argument("--summary", action="store_true",
                       help="print the per-category summary as one JSON object on stdout (verdict lines "
                            "then go only to --output); without it the summary is a table on stderr")
    score.add_argument("--underscore-to-dot", action="store_true",
                       help="the calls use OpenAI-style names (dots as underscores), as BFCL's "
                            "underscore_to_dot FC models do; default: the corpus's dotted names")
    score.set_defaults(func=run)
