"""Grading one answer to a known case: BFCL's verdict, `fair`, and `semantic` when BFCL says invalid.

What the perturbers did is read through their declared hooks (`expected_answer`: the right answer
became no call; `answer_decodes`: the answer came back as text and was decoded), never by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolquake.perturbers import NO_CALL
from toolquake.proxy.live.usercases import grade_as as grading_category
from toolquake.scorers import consistency

if TYPE_CHECKING:
    from toolquake.proxy.server.pipeline import Applied


#: the error type (and taxonomy) of a request that got no usable answer (BFCL: `Error during inference`)
INFERENCE_ERROR = "inference_error"


@dataclass
class Grade:
    expected: str
    valid: bool
    error_type: str | None
    taxonomy: str | None
    errors: list[str]
    fair_valid: bool | None
    semantic_valid: bool | None


def _role_count(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") in ("assistant", "tool", "function"))


def is_followup(case: Any, request: dict[str, Any]) -> bool:
    """True when the request carries more assistant/tool turns than the case's own first turn."""
    turn = case.turns[0] if case.turns else []
    return _role_count(request.get("messages") or []) > _role_count(turn)


def expects_no_call(case: Any, applied: list[Applied]) -> bool:
    """A step changed the right answer to "no call" (e.g. it removed the tool the ground truth calls)."""
    return any(a.perturber is not None and a.perturber.expected_answer(a.report, case) == NO_CALL for a in applied)


class Grader:
    """BFCL verdicts for answers to known cases (runs in worker threads)."""

    def __init__(self, semantic: bool = True) -> None:
        self.semantic = semantic
        self._maps: dict[str, dict[str, str]] = {}

    def name_map(self, case: Any) -> dict[str, str]:
        m = self._maps.get(case.id)
        if m is None:
            from toolquake.bfcl.convert import to_openai_tools

            m = self._maps[case.id] = to_openai_tools(case.functions)[1]
        return m

    def grade(self, case: Any, answer: dict[str, Any], applied: list[Applied],
              restorers: list[tuple[Any, Any]] | None = None) -> Grade:
        from toolquake.bfcl.decode import calls_from_message
        from toolquake.scorers.ast_checker import check, check_calls

        kind = grading_category(case)
        expected = expected_answer(case, applied)
        message = consistency.answer_message(answer) or {}
        calls = calls_from_message(message, self.name_map(case))
        strict_lenient = rewritten_decodes(restorers or [])
        lenient_calls = calls
        if strict_lenient is not None:
            # the answer came back as text: BFCL's verdict is on the strict decode, `fair` on the lenient one
            strict, lenient = strict_lenient
            calls, lenient_calls = as_calls(strict), as_calls(lenient)
        if expected == "irrelevance" and "irrelevance" not in kind:
            # the expected tool was taken away: scored as BFCL scores irrelevance (valid iff no call)
            v = check_calls(case.functions, None, "irrelevance", calls)
            return Grade(expected, v.valid, v.error_type, v.taxonomy, list(v.errors), v.valid, None)
        v = check(case, calls, mode="bfcl")
        fair = check(case, lenient_calls, mode="fair").valid
        sem = None
        if self.semantic and not v.valid and expected == "ground_truth":
            sem = check(case, calls, mode="semantic").valid
        return Grade(expected, v.valid, v.error_type, v.taxonomy, list(v.errors), fair, sem)


    def failed(self, case: Any, applied: list[Applied]) -> Grade:
        """BFCL's verdict on a request that got no usable answer (its "Error during inference: ..."): that decodes
        to no call, so it is wrong wherever a call is expected and right where none is (irrelevance)."""
        expected = expected_answer(case, applied)
        if expected == "irrelevance":
            return Grade(expected, True, None, None, [], True, None)
        errors = ["the request got no usable answer (scored as BFCL scores an inference error)"]
        return Grade(expected, False, INFERENCE_ERROR, INFERENCE_ERROR, errors, False, None)


def expected_answer(case: Any, applied: list[Applied]) -> str:
    """`ground_truth`, `irrelevance` (the case's category, or a step took the expected tool away) or `relevance`."""
    kind = grading_category(case)
    if "irrelevance" in kind:
        return "irrelevance"
    if kind == "live_relevance":
        return "relevance"
    return "irrelevance" if expects_no_call(case, applied) else "ground_truth"


def rewritten_decodes(restorers: list[tuple[Any, Any]]) -> tuple[Any, Any] | None:
    """The (strict, lenient) decodes of the first choice from the first step that decoded a text answer."""
    for perturber, ctx in restorers:
        decodes = perturber.answer_decodes(ctx)
        if decodes is not None:
            return decodes
    return None


def as_calls(decoded: Any) -> Any:
    """A format_rewrite decode (ok, calls, error) as the scorer's input: calls or a DecodeFailure."""
    from toolquake.bfcl.decode import DECODER_FAILED, DecodeFailure

    if decoded.ok:
        return list(decoded.calls)
    error = decoded.error or DECODER_FAILED
    return DecodeFailure(decoded.detail or error, error if ":" in error else f"ast_decoder:{error}")
