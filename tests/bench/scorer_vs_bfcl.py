"""Our AST scorer against BFCL's own checker, on the same answers, in one run.

    python -m tests.bench.scorer_vs_bfcl [--mutations 10] [--rounds 5] [--out bench-results]

Inputs (needs the corpus): every single-turn case of the AST categories with its ground truth as the
answer ("gt"), and the same cases with `--mutations` deterministic mutated answers each ("mutated";
mostly wrong answers, so error paths are measured too). Both checkers get already-decoded calls: ours
`check(case, calls)` → Verdict, BFCL's `ast_checker(...)` → result dict, exactly as its runner calls it.
Rounds alternate ours/BFCL; CPU time (process_time) per verdict, median over rounds; the ratio is
BFCL / ours (> 1: ours is faster). The verdicts are compared too (any disagreement is printed).
Then the extra modes on the same answers plus "reversed" (each ground truth with its calls in reverse
order): how many verdicts `fair` and `semantic` flip against `bfcl` (semantic with normalisation only
unless --embeddings). Writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from scorers import corpus, mutations
from scorers.ast_checker import CHECKER_ERROR, check, language_of
from scorers.semantic import SemanticMatcher
from scorers.bfcl_reference import PLAIN_MODEL, Reference

TARGET_RATIO = 10.0


def _inputs(reference: Reference, count: int) -> dict[str, list[tuple[Any, ...]]]:
    from bfcl_eval.constants.enums import Language  # importable once Reference is loaded

    langs = {"python": Language.PYTHON, "java": Language.JAVA, "javascript": Language.JAVASCRIPT}
    sets: dict[str, list[tuple[Any, ...]]] = {"gt": [], "mutated": []}
    for category in corpus.AST_CATEGORIES:
        for case in corpus.load_category(category):
            lang = langs[language_of(category)]
            for i, calls in enumerate(mutations.answers(case, count)):
                item = (case, calls, reference.bfcl_calls(calls), lang)
                sets["gt" if i == 0 else "mutated"].append(item)
    return sets


def _time_ours(items: list[tuple[Any, ...]]) -> float:
    start = time.process_time()
    for case, calls, _, _ in items:
        check(case, calls)
    return time.process_time() - start


def _time_bfcl(reference: Reference, items: list[tuple[Any, ...]]) -> float:
    checker = reference._checker.ast_checker
    start = time.process_time()
    for case, _, bfcl_calls, lang in items:
        try:
            checker(case.functions, bfcl_calls, case.ground_truth, lang, case.category, PLAIN_MODEL)
        except Exception:  # noqa: BLE001 — BFCL crashes on a few odd answers; timed all the same
            pass
    return time.process_time() - start


def _disagreements(reference: Reference, items: list[tuple[Any, ...]]) -> int:
    bad = 0
    for case, calls, _, _ in items:
        ours = check(case, calls)
        theirs = reference.check(case.functions, case.ground_truth, case.category, calls, language_of(case.category))
        mine = (ours.valid, ours.error_type)
        if ours.error_type == CHECKER_ERROR and (theirs[1] or "").startswith("crash:"):
            mine = theirs
        if mine != theirs:
            bad += 1
            if bad <= 5:
                print(f"  disagreement on {case.id}: ours {mine}, BFCL {theirs}")
    return bad


def _flips(sets: dict[str, list[tuple[Any, ...]]], embeddings: bool) -> list[dict[str, Any]]:
    matcher = SemanticMatcher(embeddings=embeddings)
    answers = dict(sets)
    answers["reversed"] = [(case, list(reversed(calls)), None, None) for case, calls, _, _ in sets["gt"]
                           if len(calls) > 1]
    rows = []
    for name, items in answers.items():
        counts = {"set": name, "answers": len(items), "bfcl_valid": 0, "fair_valid": 0, "semantic_valid": 0,
                  "fair_flips": 0, "semantic_flips": 0}
        for case, calls, _, _ in items:
            base = check(case, calls).valid
            fair = check(case, calls, "fair").valid
            sem = check(case, calls, "semantic", equivalence=matcher).valid
            counts["bfcl_valid"] += base
            counts["fair_valid"] += fair
            counts["semantic_valid"] += sem
            counts["fair_flips"] += fair != base
            counts["semantic_flips"] += sem != base
        rows.append(counts)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=10, help="mutated answers per case (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--out", default="bench-results", help="directory for scorer_vs_bfcl.{json,md}")
    parser.add_argument("--embeddings", action="store_true",
                        help="semantic flips with the embedding model too (slow on CPU; default: normalisation)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="toolquake-bfcl-") as tmp:
        reference = Reference(Path(tmp))
        sets = _inputs(reference, args.mutations)
        rows = []
        for name, items in sets.items():
            _time_ours(items), _time_bfcl(reference, items)  # warm-up (and our per-case compilation)
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(_time_ours(items))
                theirs.append(_time_bfcl(reference, items))
            o, t = statistics.median(ours), statistics.median(theirs)
            rows.append({"set": name, "verdicts": len(items), "ours_us": o / len(items) * 1e6,
                         "bfcl_us": t / len(items) * 1e6, "ratio": t / o,
                         "disagreements": _disagreements(reference, items)})
    lines = ["| answers | verdicts | ours µs/verdict | BFCL µs/verdict | BFCL/ours | disagreements |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['verdicts']} | {r['ours_us']:.2f} | {r['bfcl_us']:.2f} | "
                     f"{r['ratio']:.2f}× | {r['disagreements']} |")
    flips = _flips(sets, args.embeddings)
    lines += ["", f"| answers | count | bfcl valid | fair valid | semantic valid{'' if args.embeddings else ' (normalisation)'}"
              " | fair flips | semantic flips |", "|---|---|---|---|---|---|---|"]
    for f in flips:
        lines.append(f"| {f['set']} | {f['answers']} | {f['bfcl_valid']} | {f['fair_valid']} | {f['semantic_valid']} | "
                     f"{f['fair_flips']} | {f['semantic_flips']} |")
    table = "\n".join(lines)
    print(table)
    print(f"target: ours ≥ {TARGET_RATIO:.0f}× faster; CPU time, median of {args.rounds} alternating rounds, "
          f"{platform.python_implementation()} {platform.python_version()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scorer_vs_bfcl.json").write_text(json.dumps({"rows": rows, "rounds": args.rounds, "flips": flips},
                                                        indent=2))
    (out / "scorer_vs_bfcl.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
