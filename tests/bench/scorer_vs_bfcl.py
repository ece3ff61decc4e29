"""Our AST scorer against BFCL's own checker, on the same answers, in one run.

    python -m tests.bench.scorer_vs_bfcl [--mutations 10] [--rounds 5] [--batch 200] [--by-error]
                                         [--key-latency] [--out bench-results] [--embeddings]

Inputs (needs the corpus): every single-turn case of the AST categories with its ground truth as the
answer ("gt"), and the same cases with `--mutations` deterministic mutated answers each ("mutated";
mostly wrong answers, so error paths are measured too). Both checkers get already-decoded calls: ours
`check(case, calls)` → Verdict, BFCL's `ast_checker(...)` → result dict, exactly as its runner calls it.
Every verdict is computed anew (nothing is cached by answer). CPU time (process_time) per verdict,
median over rounds; the ratio is BFCL / ours (> 1: ours is faster). Two ways of feeding the answers:

* stored: all answers built up front and scored in one pass each (like scoring a results file: each
  answer's objects were allocated long before, so reading them misses the CPU caches). Rounds
  alternate ours/BFCL.
* fresh: answers are scored in batches of `--batch`, each batch unpickled just before it is scored
  (like the proxy scoring a response it has just decoded). Each batch is copied and timed for both
  checkers, which goes first alternating batch by batch; only the scoring is timed.

"read only" is a floor, not a checker: a function that only looks up the case and reads every call's
name and every argument (key, value type) the way any checker must; BFCL / floor is the best ratio
any Python checker could reach on those inputs. `--by-error` adds the stored timings per BFCL error
type; `--key-latency` scores each ground truth twice in a row from new copies (what waiting for the
case's data in memory costs each checker). The verdicts are compared too (any disagreement is
printed). Then the extra modes on the same answers plus "reversed" (each ground truth with its calls
in reverse order): how many verdicts `fair` and `semantic` flip against `bfcl` (semantic with
normalisation only unless --embeddings). Writes JSON + Markdown to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from toolquake.bfcl import corpus
from toolquake.scorers import mutations
from toolquake.scorers.ast_checker import CHECKER_ERROR, check, language_of
from toolquake.scorers.bfcl_reference import PLAIN_MODEL, Reference
from toolquake.scorers.semantic import SemanticMatcher

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
            _ENTRIES[id(case)] = case
    return sets


def _time_ours(items: list[tuple[Any, ...]], score: Any = check) -> float:
    start = time.process_time()
    for case, calls, _, _ in items:
        score(case, calls)
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


_ENTRIES: dict[int, Any] = {}  # id(case) → case, for the floor's look-up


def _read_answer(case: Any, calls: list[dict[str, Any]]) -> bool:
    """The floor: find the case's entry and read the answer (names, argument keys, value types)."""
    _ENTRIES.get(id(case))
    for call in calls:
        if type(call) is not dict or type(call.get("arguments")) is not dict or type(call.get("name")) is not str:
            return False
    for call in calls:
        call["name"].isascii()
        for value in call["arguments"].values():
            if type(value) is str:
                value.isascii()
    return True


def _time_floor(items: list[tuple[Any, ...]]) -> float:
    return _time_ours(items, _read_answer)


def _stored(reference: Reference, items: list[tuple[Any, ...]], rounds: int) -> dict[str, float]:
    _time_ours(items), _time_bfcl(reference, items), _time_floor(items)  # warm-up (and our per-case compilation)
    ours, theirs, floor = [], [], []
    for _ in range(rounds):
        ours.append(_time_ours(items))
        theirs.append(_time_bfcl(reference, items))
        floor.append(_time_floor(items))
    return {"ours": statistics.median(ours), "bfcl": statistics.median(theirs), "floor": statistics.median(floor)}


def _fresh(reference: Reference, items: list[tuple[Any, ...]], rounds: int, batch: int) -> dict[str, float]:
    """Per round: every batch unpickled right before each checker scores it; CPU time of the scoring only."""
    batches = [items[i:i + batch] for i in range(0, len(items), batch)]
    frozen = [(b, pickle.dumps([calls for _, calls, _, _ in b]), pickle.dumps([bc for _, _, bc, _ in b]))
              for b in batches]
    totals: dict[str, list[float]] = {"ours": [], "bfcl": [], "floor": []}
    for _ in range(rounds):
        spent = {"ours": 0.0, "bfcl": 0.0, "floor": 0.0}
        for n, (chunk, ours_blob, bfcl_blob) in enumerate(frozen):
            for side in (("ours", "bfcl", "floor") if n % 2 == 0 else ("bfcl", "ours", "floor")):
                if side != "bfcl":
                    fresh = [(c, calls, None, None) for (c, _, _, _), calls in zip(chunk, pickle.loads(ours_blob))]
                    spent[side] += _time_ours(fresh) if side == "ours" else _time_floor(fresh)
                else:
                    fresh = [(c, None, bc, lang) for (c, _, _, lang), bc in zip(chunk, pickle.loads(bfcl_blob))]
                    spent["bfcl"] += _time_bfcl(reference, fresh)
        for side, value in spent.items():
            totals[side].append(value)
    return {side: statistics.median(values) for side, values in totals.items()}


def _key_latency(reference: Reference, items: list[tuple[Any, ...]], rounds: int) -> dict[str, float]:
    """Each answer scored twice in a row, each time from its own new copy (two separate unpickles, so the
    copies lie apart in memory): the first verdict finds the case's data out of cache, the second in it.
    Per-verdict CPU time (timer overhead included alike); median over rounds of the mean."""
    checker = reference._checker.ast_checker

    def bfcl(case: Any, answer: Any, lang: Any) -> None:
        try:
            checker(case.functions, answer, case.ground_truth, lang, case.category, PLAIN_MODEL)
        except Exception:  # noqa: BLE001 — as in _time_bfcl
            pass

    sides = {"ours": (1, lambda case, answer, lang: check(case, answer)), "bfcl": (2, bfcl)}
    clock = time.process_time
    out = {}
    for side, (field, score) in sides.items():
        blobs = [pickle.dumps([item[field] for item in items]) for _ in range(2)]
        firsts, seconds = [], []
        for _ in range(rounds):
            first_copy, second_copy = (pickle.loads(blob) for blob in blobs)
            first = second = 0.0
            for (case, _, _, lang), a, b in zip(items, first_copy, second_copy):
                t0 = clock()
                score(case, a, lang)
                t1 = clock()
                score(case, b, lang)
                second += clock() - t1
                first += t1 - t0
            firsts.append(first)
            seconds.append(second)
        out[f"{side}_first"] = statistics.median(firsts) / len(items) * 1e6
        out[f"{side}_second"] = statistics.median(seconds) / len(items) * 1e6
    return out


def _by_error(reference: Reference, items: list[tuple[Any, ...]], rounds: int) -> list[dict[str, Any]]:
    groups: dict[str, list[tuple[Any, ...]]] = collections.defaultdict(list)
    for item in items:
        groups[check(item[0], item[1]).error_type or "valid"].append(item)
    rows = []
    for error_type, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        timed = _stored(reference, group, rounds)
        rows.append({"error_type": error_type, "verdicts": len(group), "ours_us": timed["ours"] / len(group) * 1e6,
                     "bfcl_us": timed["bfcl"] / len(group) * 1e6, "bfcl_s": timed["bfcl"], "ours_s": timed["ours"]})
    return rows


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
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per protocol (default 5)")
    parser.add_argument("--batch", type=int, default=200,
                        help="answers per freshly unpickled batch in the 'fresh' protocol (default 200)")
    parser.add_argument("--by-error", action="store_true",
                        help="also time the mutated answers grouped by BFCL error type (stored protocol)")
    parser.add_argument("--key-latency", action="store_true",
                        help="also score each ground truth twice in a row from new copies "
                             "(the case's data out of cache, then in cache)")
    parser.add_argument("--out", default="bench-results", help="directory for scorer_vs_bfcl.{json,md}")
    parser.add_argument("--embeddings", action="store_true",
                        help="semantic flips with the embedding model too (slow on CPU; default: normalisation)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="toolquake-bfcl-") as tmp:
        reference = Reference(Path(tmp))
        sets = _inputs(reference, args.mutations)
        rows, by_error, latency = [], [], {}
        for name, items in sets.items():
            stored = _stored(reference, items, args.rounds)
            fresh = _fresh(reference, items, args.rounds, args.batch)
            n = len(items)
            rows.append({"set": name, "verdicts": n,
                         "stored_ours_us": stored["ours"] / n * 1e6, "stored_bfcl_us": stored["bfcl"] / n * 1e6,
                         "stored_ratio": stored["bfcl"] / stored["ours"], "floor_us": stored["floor"] / n * 1e6,
                         "floor_ratio": stored["bfcl"] / stored["floor"],
                         "fresh_ours_us": fresh["ours"] / n * 1e6, "fresh_bfcl_us": fresh["bfcl"] / n * 1e6,
                         "fresh_ratio": fresh["bfcl"] / fresh["ours"], "fresh_floor_us": fresh["floor"] / n * 1e6,
                         "fresh_floor_ratio": fresh["bfcl"] / fresh["floor"],
                         "disagreements": _disagreements(reference, items)})
        if args.by_error:
            by_error = _by_error(reference, sets["mutated"], args.rounds)
        if args.key_latency:
            latency = _key_latency(reference, sets["gt"], args.rounds)
    lines = ["| answers | protocol | verdicts | ours µs | BFCL µs | BFCL/ours | read-only floor µs | BFCL/floor "
             "| disagreements |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for protocol in ("stored", "fresh"):
            floor = "floor" if protocol == "stored" else "fresh_floor"
            lines.append(f"| {r['set']} | {protocol} | {r['verdicts']} | {r[protocol + '_ours_us']:.2f} | "
                         f"{r[protocol + '_bfcl_us']:.2f} | {r[protocol + '_ratio']:.2f}× | {r[floor + '_us']:.2f} | "
                         f"{r[floor + '_ratio']:.1f}× | {r['disagreements']} |")
    if by_error:
        total_bfcl = sum(r["bfcl_s"] for r in by_error)
        lines += ["", "| mutated, by BFCL error type | verdicts | ours µs | BFCL µs | BFCL/ours | share of BFCL time |",
                  "|---|---|---|---|---|---|"]
        for r in by_error:
            lines.append(f"| {r['error_type']} | {r['verdicts']} | {r['ours_us']:.2f} | {r['bfcl_us']:.2f} | "
                         f"{r['bfcl_s'] / r['ours_s']:.2f}× | {r['bfcl_s'] / total_bfcl:.0%} |")
    if latency:
        lines += ["", "| ground truths, each scored twice from new copies | first µs | second µs |",
                  "|---|---|---|",
                  f"| ours | {latency['ours_first']:.2f} | {latency['ours_second']:.2f} |",
                  f"| BFCL | {latency['bfcl_first']:.2f} | {latency['bfcl_second']:.2f} |"]
    flips = _flips(sets, args.embeddings)
    lines += [
        "",
        f"| answers | count | bfcl valid | fair valid | semantic valid{'' if args.embeddings else ' (normalisation)'}"
        " | fair flips | semantic flips |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in flips:
        lines.append(
            f"| {f['set']} | {f['answers']} | {f['bfcl_valid']} | {f['fair_valid']} | {f['semantic_valid']} | "
            f"{f['fair_flips']} | {f['semantic_flips']} |"
        )
    table = "\n".join(lines)
    print(table)
    print(
        f"target: ours ≥ {TARGET_RATIO:.0f}× faster; CPU time, median of {args.rounds} rounds, "
        f"{platform.python_implementation()} {platform.python_version()}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "rows": rows,
        "by_error": by_error,
        "key_latency": latency,
        "rounds": args.rounds,
        "batch": args.batch,
        "flips": flips,
    }
    (out / "scorer_vs_bfcl.json").write_text(json.dumps(report, indent=2))
    (out / "scorer_vs_bfcl.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
