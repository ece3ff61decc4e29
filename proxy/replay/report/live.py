"""What watching traffic adds to the report: the anytime-valid intervals of every arm, and, from a live results
store, the shadow twins' consistency, the noise floor under it and the backend's conformance violations.

The anytime intervals are confidence sequences (proxy/live/anytime.py, the same `Sequences` the live gauges read):
valid however often they are looked at, where the fixed-sample intervals beside them hold only when read once. A
live arm's are fed its store's rows in the store's order (what the gauges showed when the last row came in); a
replay arm's its rows in the order written. `summarize` adds, per arm, `accuracy_cs`, `drop_vs_off_cs` (over
`anytime_pairs`: the first verdict of each case in the arm and in the baseline) and, from a live store,
"consistency", "consistency_ci" (with `disagreement_cs`: a shadow profile's disagreement minus the noise
twins'), "noise", "noise_ci" and "conformance"; `tables` their tables (every format shows them).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from toolquake.perturbers.base import NOT_PERTURBED
from toolquake.proxy.live.anytime import Sequences, finite
from toolquake.proxy.replay.report.rows import Results
from toolquake.proxy.replay.report.stats import ALPHA, BASELINE
from toolquake.proxy.server.config import NOISE_PROFILE
from toolquake.scorers.aggregate import ratio, wilson_ci

_AGREE = {"true": "exact", "semantic": "semantic"}


def agreement(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Twins' agreement with the original per profile: counts and rates, and their Wilson intervals."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["agree"] is None:
            continue
        c = out.setdefault(r["profile"], {"n": 0, "exact": 0, "semantic": 0, "disagree": 0})
        c["n"] += 1
        c[_AGREE.get(r["agree"], "disagree")] += 1
    for c in out.values():
        c["rate_exact"] = ratio(c["exact"], c["n"])
        c["rate_semantic"] = ratio(c["exact"] + c["semantic"], c["n"])
        c["rate_disagree"] = ratio(c["disagree"], c["n"])
    cis = {p: {"rate_exact": wilson_ci(c["exact"], c["n"]),
               "rate_semantic": wilson_ci(c["exact"] + c["semantic"], c["n"]),
               "rate_disagree": wilson_ci(c["disagree"], c["n"])} for p, c in sorted(out.items())}
    return dict(sorted(out.items())), cis


def shadow_numbers(res: Results) -> dict[str, Any]:
    """The live store's shadow consistency per profile, its noise floor (per profile sampled from, and
    `NOISE_PROFILE` for all noise twins pooled) and its conformance violations {model: {rule: count}}; empty
    without a live store. Keyed by profile: a report reads one store (`--db`)."""
    rows = [r for found in res.live_rows.values() for r in found]
    if not res.live_rows:
        return {}
    consistency, consistency_ci = agreement([r for r in rows if r["arm"] != "noise"])
    noise, noise_ci = agreement([r for r in rows if r["arm"] == "noise"])
    if noise:
        pooled, pooled_ci = agreement([{**r, "profile": NOISE_PROFILE} for r in rows if r["arm"] == "noise"])
        noise.update(pooled)
        noise_ci.update(pooled_ci)
    counts = Counter((v["model"] or "none", v["rule"]) for found in res.conformance.values() for v in found)
    conformance: dict[str, dict[str, int]] = {}
    for (model, rule), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
        conformance.setdefault(model, {})[rule] = n
    return {"consistency": consistency, "consistency_ci": consistency_ci, "noise": noise, "noise_ci": noise_ci,
            "conformance": conformance}


def _feed(res: Results, model: str) -> list[tuple[dict[str, Any], bool]]:
    """The rows a model's sequences are fed, in order: a live store's every row (twins too); a replay's rows of
    trial 0 as written."""
    if model in res.live_rows:
        return [(r, r["not_perturbed"]) for r in res.live_rows[model]]
    return [({"profile": r.profile, "arm": "live", "case_id": r.case_id, "agree": None,
              "valid": r.valid if r.status == "scored" else None}, r.status == NOT_PERTURBED)
            for r in res.rows if r.model == model and r.trial == 0]


def with_anytime(res: Results, summary: dict[str, Any], baseline: str = BASELINE) -> None:
    """Each arm's anytime-valid intervals beside its fixed-sample ones, and each shadow profile's disagreement
    beyond the noise floor in `consistency_ci`."""
    for model, data in summary["models"].items():
        seq = Sequences(baseline)
        for row, unchanged in _feed(res, model):
            seq.feed(row, unchanged)
        intervals = seq.intervals(ALPHA)
        for p, arm in data["arms"].items():
            iv = intervals.get(p) or {}
            arm["accuracy_cs"] = finite(iv.get("accuracy_cs"))
            arm["drop_vs_off_cs"] = finite(iv.get("drop_vs_off_cs"))
            arm["anytime_pairs"] = iv.get("pairs", 0)
        for p, c in (summary.get("consistency_ci") or {}).items() if model in res.live_rows else ():
            c["disagreement_cs"] = finite((intervals.get(p) or {}).get("disagreement_cs"))


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f} %"


def bounds(interval: list[float | None] | None, signed: bool = False) -> str:
    """`[48.1, 75.0]` in percent; an unbounded end of a confidence sequence (None) as ±∞."""
    if interval is None:
        return "–"

    def end(x: float | None, inf: str) -> str:
        return inf if x is None else f"{x * 100:+.1f}" if signed else f"{x * 100:.1f}"

    return f"[{end(interval[0], '−∞')}, {end(interval[1], '+∞')}]"


def tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The live store's counts, the anytime-valid table, then the store's consistency, noise floor and conformance
    tables."""
    return [*_store_table(summary), *_anytime_table(summary), *_consistency_table(summary), *_noise_table(summary),
            *_conformance_table(summary)]


def _store_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    if "db" not in summary:
        return []
    arms = [a for a in summary["arms"].values() if a.get("source") == "live"]
    twins = sum(c["n"] for c in (summary.get("consistency") or {}).values())
    noise = ((summary.get("noise") or {}).get(NOISE_PROFILE) or {}).get("n", 0)
    return [("Live results store (rows: every answer stored; scored: tied to a case and graded, the perturbed ones "
             "in the accuracy)", ["store", "rows", "scored", "scored, not perturbed", "profiles scored",
                                  "shadow twins compared", "noise twins compared"],
             [[summary["db"], str(summary["rows"]), str(sum(a["n"] + a["not_perturbed"] for a in arms)),
               str(sum(a["not_perturbed"] for a in arms)), str(len(arms)), str(twins), str(noise)]])]


def _anytime_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    baseline = summary["baseline"]
    rows = []
    for model, data in summary["models"].items():
        for p, arm in data["arms"].items():
            if arm.get("accuracy_cs") is None:
                continue
            cmp = p != baseline and arm.get("paired")
            rows.append([model, p, arm.get("source", "replay"), str(arm["n"]), _pct(arm["accuracy"]),
                         bounds(arm.get("accuracy_ci")), bounds(arm.get("accuracy_cs")),
                         "–" if not cmp else f"{_pct(arm['drop_vs_off'])} {bounds(arm.get('drop_vs_off_ci'), True)}",
                         "–" if not cmp else str(arm["paired"]["n"]),
                         "–" if not cmp else bounds(arm.get("drop_vs_off_cs"), True),
                         "–" if not cmp else str(arm.get("anytime_pairs", 0))])
    if not rows:
        return []
    return [(f"Fixed-sample and anytime-valid {1 - ALPHA:.0%} intervals: \"95 % CI\" holds at this sample size only "
             "(read once, at the end); \"anytime 95 %\" is a confidence sequence, valid however often it is looked "
             "at (the live gauges and alerts use it; its drop is over the first verdict of each case in the arm and "
             f"in `{baseline}`)",
             ["model", "profile", "source", "n", "accuracy", "accuracy 95 % CI", "accuracy anytime 95 %",
              f"drop vs {baseline} [95 % CI]", "paired cases", "drop anytime 95 %", "anytime pairs"], rows)]


def _consistency_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    floor = (summary.get("noise") or {}).get(NOISE_PROFILE)
    cis = summary.get("consistency_ci") or {}
    rows = []
    for p, c in (summary.get("consistency") or {}).items():
        ci = cis.get(p) or {}
        net = "–" if floor is None else f"{(c['rate_disagree'] - floor['rate_disagree']) * 100:+.1f} %"
        rows.append([p, str(c["n"]), str(c["exact"]), str(c["semantic"]), str(c["disagree"]),
                     f"{_pct(c['rate_semantic'])} {bounds(ci.get('rate_semantic'))}",
                     f"{_pct(c['rate_exact'])} {bounds(ci.get('rate_exact'))}",
                     f"{_pct(c['rate_disagree'])} {bounds(ci.get('rate_disagree'))}",
                     "–" if floor is None else _pct(floor["rate_disagree"]), net,
                     bounds(ci.get("disagreement_cs"), True)])
    if not rows:
        return []
    return [("Shadow consistency (live: each twin's answer against the original's; 95 % Wilson intervals; net of "
             "the noise floor with its anytime-valid 95 % interval)",
             ["profile", "n", "exact", "semantic", "disagree", "consistent [95 % CI]", "exact [95 % CI]",
              "disagree [95 % CI]", "noise floor (all noise twins)", "net of noise", "net of noise, anytime 95 %"],
             rows)]


def _noise_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = []
    for p, c in (summary.get("noise") or {}).items():
        ci = (summary.get("noise_ci") or {}).get(p) or {}
        rows.append([f"all ({p})" if p == NOISE_PROFILE else p, str(c["n"]), str(c["exact"]), str(c["semantic"]),
                     str(c["disagree"]), f"{_pct(c['rate_disagree'])} {bounds(ci.get('rate_disagree'))}"])
    if not rows:
        return []
    return [("Noise floor (live: unperturbed twins, the model disagreeing with itself; 95 % Wilson intervals)",
             ["sampled from", "n", "exact", "semantic", "disagree", "disagree [95 % CI]"], rows)]


def _conformance_table(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = [[model, rule, str(n)] for model, by_rule in (summary.get("conformance") or {}).items()
            for rule, n in by_rule.items()]
    if not rows:
        return []
    return [("Backend conformance (live: tool-call format rules broken; docs/conformance.md)",
             ["model", "rule", "violations"], rows)]
