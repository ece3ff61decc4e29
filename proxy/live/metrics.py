"""The live-scoring metrics, registered in the server's registry. Names and labels are a contract."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SCORING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class ScoringMetrics:
    """The scoring metrics, registered in the app's registry. Names and labels are a contract."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.scored = Counter("toolquake_scored", "Answers scored against BFCL ground truth (BFCL-compatible "
                              "verdict).", ["profile", "model", "category", "verdict"], registry=r)
        self.errors = Counter("toolquake_errors", "Invalid answers by error type (taxonomy: wrong_function, "
                              "wrong_count, wrong_param_value, ...).", ["profile", "model", "error_type"], registry=r)
        self.semantic_flips = Counter("toolquake_semantic_flips", "Invalid BFCL verdicts that the semantic "
                                      "mode accepts.", ["profile", "model"], registry=r)
        self.consistency = Counter("toolquake_consistency", "Shadow twins compared with the original answer: "
                                   "agree = true (same calls), semantic (equivalent arguments), false.",
                                   ["profile", "model", "agree"], registry=r)
        self.queue_depth = Gauge("toolquake_scoring_queue_depth", "Jobs waiting in the scoring queue.", registry=r,
                                 multiprocess_mode="livesum")
        self.dropped = Counter("toolquake_scoring_dropped", "Jobs dropped because the scoring queue was full.",
                               ["profile"], registry=r)
        self.skipped = Counter("toolquake_scoring_skipped", "Answers not scored, by reason (unlabeled, unknown_case, "
                               "followup, no_answer, unsupported_category, scorer_error).", ["profile", "reason"],
                               registry=r)
        self.duration = Histogram("toolquake_scoring_duration_seconds", "Time to score one answer (in a worker).",
                                  buckets=SCORING_BUCKETS, registry=r)
        self.shadow = Counter("toolquake_shadow_requests", "Shadow twins by outcome (answered, failed, busy, "
                              "sampled_out).", ["profile", "outcome"], registry=r)
        self.recovery = Counter("toolquake_tool_failure_recovery", "Answers after a tool result the tool_failure "
                                "perturber replaced, by failure kind and verdict (retried, requeried, reported, "
                                "answered, invented, other_call, no_answer).", ["profile", "kind", "verdict"],
                                registry=r)
        self.store_errors = Counter("toolquake_results_store_errors", "Rows the results store could not write.",
                                    registry=r)
        # anytime-valid 95 % intervals (confidence sequences, proxy/live/anytime.py) read from the results store:
        # every worker reads the same store, so across workers the tightest end is the one to keep
        def bounds(name: str, what: str) -> tuple[Gauge, Gauge]:
            return (Gauge(f"toolquake_live_{name}_lower", f"Lower end of the anytime-valid 95 % interval of {what}.",
                          ["profile"], registry=r, multiprocess_mode="livemax"),
                    Gauge(f"toolquake_live_{name}_upper", f"Upper end of the anytime-valid 95 % interval of {what}.",
                          ["profile"], registry=r, multiprocess_mode="livemin"))

        self.live_accuracy = bounds("accuracy", "the profile's accuracy (scored answers)")
        self.live_drop = bounds("drop", "the profile's relative drop against off, acc / acc_off - 1, on the cases "
                                "both scored (below 0: the profile hurts accuracy)")
        self.live_disagreement = bounds("disagreement", "the share of the profile's shadow twins that disagree "
                                        "with the original, minus the noise twins' (above 0: beyond the model's "
                                        "own noise)")
        self.live_pairs = Gauge("toolquake_live_pairs", "Cases scored under both off and the profile (the pairs "
                                "of its drop interval).", ["profile"], registry=r, multiprocess_mode="livemax")
        self.corpus_cases = Gauge("toolquake_corpus_cases", "BFCL cases available for content matching "
                                  "(0 until the index is loaded).", registry=r,
                                  multiprocess_mode="max")  # every worker loads the same index
