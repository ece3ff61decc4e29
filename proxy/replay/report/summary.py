"""The JSON report: the statistics of every arm, then the families' and the papers' sections."""

from __future__ import annotations

from typing import Any

from toolquake.proxy.replay.report.families import family_numbers, recovery_numbers
from toolquake.proxy.replay.report.live import shadow_numbers, with_anytime
from toolquake.proxy.replay.report.paper_tables import sections
from toolquake.proxy.replay.report.remedies import remedy_numbers
from toolquake.proxy.replay.report.rows import Results
from toolquake.proxy.replay.report.stats import BASELINE, arms_summary
from toolquake.proxy.replay.report.sweeps import sweep_numbers


def summarize(res: Results, baseline: str = BASELINE) -> dict[str, Any]:
    """The JSON report: {"arms": {profile: {"n", "accuracy", "by_category", "errors", ...}}, "models": {...}}.

    With one model, `arms` is keyed by profile; with several, by "profile [model]", and `models`
    holds each model's arms keyed by profile. `drop_vs_off` is the relative change against the
    baseline profile, paired: both accuracies on the cases both scored (`paired`; None without a baseline).
    Every arm says its `source` (replay, or live: the store of `--db`, reported under the model "live") and has
    its anytime-valid intervals beside the fixed-sample ones; a live store adds "db", "rows" (its rows, scored or
    not), "consistency", "consistency_ci", "noise", "noise_ci", "conformance" (docs/replay.md#the-json-report).
    """
    summary = arms_summary(res, baseline)
    if res.live_rows:
        summary.update(db=str(res.sources[min(res.live_sources)]),
                       rows=sum(len(found) for found in res.live_rows.values()))
    summary.update(shadow_numbers(res))
    with_anytime(res, summary, baseline)
    summary.update(families=family_numbers(summary), recovery=recovery_numbers(res))
    summary.update(sections(res, baseline, summary))
    summary["remedies"] = remedy_numbers(res, summary)  # remedied arms against their twins (report/remedies.py)
    summary.update(sweep_numbers(res))  # `toolquake sweep` results: "sweeps", "sweep_comparisons"
    summary["sources"] += [str(r.source) for r in res.sweep_runs]
    # what the requests were sent with (the temperature, or `none`: left out, as BFCL does for models that refuse
    # one; the token counter of the budgets), per model as its results files recorded it
    summary["sent_with"] = res.settings
    return summary
