"""Recovery verdicts for one exchange: the answer to a request in which a step replaced tool results with
failures (declared by the step: `Perturber.injected_failures`), classified by `scorers.recovery`.

Shared by live scoring (`toolquake_tool_failure_recovery_total`) and the multi-turn replay (each row's
`perturbers.recovery`). Only failures after the request's last assistant message count: an older one
was answered at its own turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.scorers import consistency, recovery

if TYPE_CHECKING:
    from toolquake.proxy.server.pipeline import Applied


def injected(applied: list[Applied], messages: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(message index, kind) of the failures the next answer reacts to."""
    kinds: dict[int, str] = {}
    for a in applied:
        if a.perturber is None:
            continue
        for f in a.perturber.injected_failures(a.report):
            kinds.setdefault(int(f["index"]), str(f["kind"]))
    if not kinds:
        return []
    return [(i, kinds[i]) for i in recovery.after_last_answer(messages, kinds)]


def verdicts(sent: dict[str, Any] | None, answer: dict[str, Any] | None,
             failures: list[tuple[int, str]]) -> list[recovery.Recovery]:
    """One verdict per failure on the answer (chat-shaped) to the request as sent upstream."""
    if not failures or not isinstance(sent, dict):
        return []
    message = consistency.answer_message(answer)
    if not isinstance(message, dict):  # no answer from the model (an upstream error): nothing to judge
        return []
    seen = recovery.seen_numbers(sent)
    return [recovery.classify(sent, i, kind, message, seen) for i, kind in failures]
