"""The acceptance test: our scorer against BFCL's own code, on the same inputs, verdict for verdict.

BFCL v4 (`bfcl-eval`, from the corpus cache) is installed `--no-deps` into a temporary directory and only
its AST checker (plus, for the decoder and tools checks, its model-handler helpers) is imported, with
stub modules for the model registry, tenacity and tree-sitter (see scorers/bfcl_reference.py).
Compared: every ground truth of the single-turn AST categories as an answer, ≥ 50,000 deterministic
mutations of those answers, the python call-syntax decoder on rendered and mangled texts, the relevance
rule, and the OpenAI tools conversion.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from toolquake.bfcl import corpus
from toolquake.bfcl.convert import to_openai_tools, with_language_hints
from toolquake.bfcl.decode import DecodeFailure, decode_python
from toolquake.scorers import mutations
from toolquake.scorers.ast_checker import CHECKER_ERROR, check, language_of
from toolquake.scorers.bfcl_reference import Reference

# every test here uses the module's `reference`, whose set-up runs pip (a process)
pytestmark = [pytest.mark.needs_corpus, pytest.mark.processes]

MUTATIONS_PER_CASE = 21  # 2,501 AST cases × 21 = 52,521 mutated answers


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("bfcl-eval"))


def _ast_cases() -> list[Any]:
    return corpus.load_cases(corpus.AST_CATEGORIES)


def _compare(reference: Reference, case: Any, calls: list[dict[str, Any]], u2d: bool = False
             ) -> tuple[tuple[bool, str | None], tuple[bool, str | None]]:
    ours = check(case, calls, underscore_to_dot=u2d)
    theirs = reference.check(case.functions, case.ground_truth, case.category, calls, language_of(case.category),
                             underscore_to_dot=u2d)
    mine = (ours.valid, ours.error_type)
    if ours.error_type == CHECKER_ERROR and (theirs[1] or "").startswith("crash:"):
        mine = theirs  # both refuse the input: BFCL by raising, ours with an invalid verdict
    return mine, theirs


def test_every_ground_truth_answer_gets_bfcl_verdict(reference: Reference) -> None:
    cases = _ast_cases()
    assert len(cases) == 2501
    disagreements, valid = [], 0
    for case in cases:
        calls = next(mutations.answers(case, 0))
        mine, theirs = _compare(reference, case, calls)
        valid += theirs[0]
        if mine != theirs:
            disagreements.append((case.id, mine, theirs))
    assert disagreements == []
    # the published unsolvable entries fail (spec §1.5); nearly everything else passes
    assert 2400 < valid < 2501


def test_mutated_answers_get_bfcl_verdicts_and_error_types(reference: Reference) -> None:
    compared, disagreements = 0, []
    error_types: Counter[str] = Counter()
    for case in _ast_cases():
        answers = mutations.answers(case, MUTATIONS_PER_CASE)
        next(answers)  # the ground truth: the test above
        for calls in answers:
            mine, theirs = _compare(reference, case, calls)
            compared += 1
            error_types[theirs[1] or "valid"] += 1
            if mine != theirs:
                disagreements.append((case.id, calls, mine, theirs))
    assert compared >= 50_000
    assert disagreements[:5] == [] and len(disagreements) == 0
    # the mutations reach every kind of verdict, not only the easy ones
    for kind in ("valid", "simple_function_checker:wrong_count", "simple_function_checker:wrong_func_name",
                 "simple_function_checker:missing_required", "simple_function_checker:unexpected_param",
                 "simple_function_checker:missing_optional", "type_error:simple", "type_error:nested",
                 "type_error:java", "type_error:js", "value_error:string", "value_error:list/tuple",
                 "value_error:dict_key", "value_error:dict_value", "value_error:list_dict_count",
                 "value_error:others", "multiple_function_checker:wrong_count",
                 "parallel_function_checker_no_order:wrong_count",
                 "parallel_function_checker_no_order:cannot_find_match"):
        assert error_types[kind] > 0, kind
    assert error_types["valid"] > 5_000


def test_openai_style_names_agree_with_underscore_to_dot_models(reference: Reference) -> None:
    checked = 0
    for case in _ast_cases():
        if not any("." in d["name"] for d in case.functions):
            continue
        for calls in mutations.answers(case, 3):
            underscored = [{"name": c["name"].replace(".", "_"), "arguments": c["arguments"]} for c in calls]
            for variant in (calls, underscored):
                mine, theirs = _compare(reference, case, variant, u2d=True)
                assert mine == theirs, (case.id, variant)
                checked += 1
    assert checked > 1_000


# --- decoding ---------------------------------------------------------------------------------------

def _render(calls: list[dict[str, Any]], rng: random.Random) -> str:
    parts = []
    for call in calls:
        args = ", ".join(f"{k}={v!r}" for k, v in call["arguments"].items() if isinstance(k, str))
        parts.append(f"{call['name']}({args})")
    text = ", ".join(parts)
    return f"[{text}]" if rng.random() < 0.8 else text


_TEXT_EDITS = (
    lambda t: f"```\n{t}\n```", lambda t: f"```python\n{t}\n```", lambda t: t + " Hope this helps",
    lambda t: "Sure! " + t, lambda t: t.replace("=", " = "), lambda t: t.replace(", ", "\n"),
    lambda t: t + "\r\n", lambda t: "`" + t + "`", lambda t: t.replace("[", "(", 1),
    lambda t: t.replace("'", '"'), lambda t: f"<TOOLCALL>{t}</TOOLCALL>", lambda t: t.replace("(", "(1, ", 1),
    lambda t: t.replace("=1", "=+1").replace("=2", "=-2"), lambda t: t.replace("=5", "=2+3").replace("=3", "=9//3"),
    lambda t: t.replace("=10", "=5*2").replace("=4", "=2**2"), lambda t: t.replace("='", "=f'"),
    lambda t: t.replace("True", "not True"), lambda t: t.replace("=1", "=x[0]").replace("=0", "=len(x)"),
    lambda t: t.replace(")", ", extra=lambda: 1)", 1), lambda t: t.replace(")", ", more=a.b)", 1),
    lambda t: t.replace(")", ", k=g(h=1))", 1), lambda t: t.replace(")", ", **kw)", 1), lambda t: t[:-1],
    lambda t: t.replace("[", "{", 1).replace("]", "}"), lambda t: t.replace(")", ", z={1, 2})", 1),
    lambda t: t.replace(")", ", z=1 < 2)", 1), lambda t: t.replace(")", ", z=-'a')", 1),
    lambda t: t.replace(")", ", z=[1] + [2] * 2)", 1), lambda t: t.replace(")", ", z='ab' * 2 + 'c')", 1),
    lambda t: t.replace(")", ", z=(1, 2) + (3,))", 1), lambda t: t.replace(")", ", z=1 / 0)", 1),
    lambda t: t.replace(")", ", z=7 % 3 - 2 ** -1)", 1), lambda t: t.replace(")", ", z=None)", 1),
    lambda t: t.replace(")", ", z=...)", 1), lambda t: t.replace(")", ", z=1e400)", 1), lambda t: "[]",
    lambda t: "I cannot do that.", lambda t: t + ", print('hi')", lambda t: t.replace(")", ", z=b'x')", 1),
    lambda t: t.replace(")", ", z=f'{1:>3}' + 'x')", 1), lambda t: t.replace(")", ", z=[1, 2][0] * 3)", 1),
    lambda t: t.replace(")", ", z=[*[1], 2] + [])", 1), lambda t: t.replace(")", ", z='abc'[::-1] + '')", 1),
    lambda t: t.replace(")", ", z=(1 if 2 > 1 else 0) + 1)", 1), lambda t: t.replace(")", ", z=~5 + 1)", 1),
)


def _texts(case: Any, rng: random.Random) -> list[str]:
    out = []
    for i, calls in enumerate(mutations.answers(case, 3, seed=7)):
        text = _render(calls, rng)
        out.append(text)
        for _ in range(2 if i == 0 else 1):
            edited = text
            for _ in range(rng.choice((1, 1, 2))):
                edited = rng.choice(_TEXT_EDITS)(edited)
            out.append(edited)
    return out


def test_python_decoder_agrees_with_bfcl_on_rendered_and_mangled_texts(reference: Reference) -> None:
    rng = random.Random(11)
    compared = failures = 0
    categories = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
                  "live_parallel", "live_parallel_multiple")
    for case in corpus.load_cases(categories):
        for text in _texts(case, rng):
            theirs = reference.decode_python(text)
            ours = decode_python(text)
            compared += 1
            if theirs is None:
                failures += 1
                assert isinstance(ours, DecodeFailure), text
            else:
                assert ours == theirs, text
                assert [type(v) for c in ours for v in c["arguments"].values()] == \
                       [type(v) for c in theirs for v in c["arguments"].values()], text
                # and the verdicts on what was decoded agree too
                mine, bfcl = _compare(reference, case, ours)
                assert mine == bfcl, text
    assert compared > 10_000 and 0.1 < failures / compared < 0.9


def test_relevance_rule_agrees_with_bfcl(reference: Reference) -> None:
    from bfcl_eval.utils import is_empty_output

    rng = random.Random(5)
    texts = [t for c in corpus.load_category("simple_python")[:60] for t in _texts(c, rng)]
    texts += ["", "[{}]", "None", "[print('hi')]", "foo(x=1)", "[f()]"]
    for category in corpus.RELEVANCE_CATEGORIES:
        case = corpus.load_category(category)[0]
        for text in texts:
            decoded = reference.decode_python(text)
            has_call = decoded is not None and not is_empty_output(Reference.bfcl_calls(decoded))
            expected = (not has_call) if "irrelevance" in category else has_call
            assert check(case, decode_python(text)).valid == expected, (category, text)


# --- tools ------------------------------------------------------------------------------------------

def test_tools_conversion_and_language_hints_match_bfcl(reference: Reference) -> None:
    reference.decode_python("[]")  # loads BFCL's model-handler helpers
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import _func_doc_language_specific_pre_processing

    cases = corpus.load_cases(corpus.SINGLE_TURN_CATEGORIES + corpus.MULTI_TURN_CATEGORIES)
    for case in cases:
        if not case.functions:
            continue
        hinted = with_language_hints(case.functions, case.category)
        assert hinted == _func_doc_language_specific_pre_processing(
            [dict(d, parameters=_deep(d["parameters"])) for d in case.functions], case.category), case.id
        ours, name_map = to_openai_tools(hinted)
        theirs = convert_to_tool(hinted, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)
        assert ours == theirs, case.id
        assert sorted(name_map.values()) == sorted(d["name"] for d in case.functions)


def _deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    return value


def test_format_sensitivity_cases_dispatch_on_their_original_id(reference: Reference) -> None:
    config = "ret_fmt=python&tool_call_tag=True&func_doc_fmt=json&prompt_fmt=plaintext&style=classic"
    compared = 0
    for i, (category, ids) in enumerate(corpus.format_sensitivity_ids().items()):
        for original in ids[:5]:
            case = corpus.load_case(f"format_sensitivity_{i}:{config}:{original}")
            assert case.category == "format_sensitivity" and case.extra["original_id"] == original
            for calls in mutations.answers(case, 5):
                ours = check(case, calls)
                theirs = reference.check(case.functions, case.ground_truth, case.category, calls, "python",
                                         dispatch=original)
                assert (ours.valid, ours.error_type) == theirs, (case.id, calls)
                compared += 1
    assert compared == 8 * 5 * 6


def test_odd_schemas_and_answers_fail_where_bfcl_fails(reference: Reference) -> None:
    from toolquake.scorers.ast_checker import check_calls

    doc = {"name": "f", "description": "", "parameters": {"type": "dict", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "array"}, "c": {"type": "weird"}, "d": {"type": "string"}}}}
    no_required = {"name": "f", "description": "",
                   "parameters": {"type": "dict", "properties": doc["parameters"]["properties"]}}
    gts = [
        [{"f": {"a": [1], "b": [[1]], "c": [1], "d": ["x", ""]}}],
        [{"f": {"a": [1], "d": 5}}],
        [{"g": {"a": [1]}}],
        [{"f": {"a": [1], "d": [["x"], "y"]}}],
    ]
    answers = [
        [],
        [{"name": "f", "arguments": {"a": 1}}],
        [{"name": "f", "arguments": {"a": 1, "b": [1]}}],
        [{"name": "f", "arguments": {"a": 1, "c": 1}}],
        [{"name": "f", "arguments": {"a": 1, "d": "x"}}],
        [{"name": "f", "arguments": {"a": 2, "c": 1}}],
        [{"name": "g", "arguments": {"a": 1}}],
        [{"name": "f", "arguments": {"a": 1, "d": ["x"]}}],
    ]
    compared = 0
    for docs in ([doc], [no_required]):
        for gt in gts:
            for category in ("simple_python", "multiple", "parallel", "simple_java", "simple_javascript"):
                for calls in answers:
                    lang = language_of(category)
                    ours = check_calls(docs, gt, category, calls)
                    theirs = reference.check(docs, gt, category, calls, lang)
                    mine = (ours.valid, ours.error_type)
                    if ours.error_type == CHECKER_ERROR and (theirs[1] or "").startswith("crash:"):
                        mine = theirs
                    assert mine == theirs, (docs[0]["parameters"].keys(), gt, category, calls)
                    compared += 1
    assert compared == 2 * 4 * 5 * 8
