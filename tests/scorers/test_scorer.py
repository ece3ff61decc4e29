"""The AST scorer: BFCL's documented verdicts (worked examples of the BFCL v4 spec §9), the decoders,
the fair and semantic modes, the taxonomy, and the `toolquake score` contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolquake.bfcl.decode import DecodeFailure, calls_from_message, decode_python
from toolquake.scorers.ast_checker import check, check_calls
from toolquake.scorers.semantic import SemanticMatcher, normalize
from toolquake.scorers.taxonomy import classify

ROOT = Path(__file__).resolve().parents[2]


def case(case_id: str):
    from toolquake.bfcl.corpus import load_case

    return load_case(case_id)


def verdict_of(case_id: str, text: str, mode: str = "bfcl") -> tuple[bool, str | None]:
    v = check(case(case_id), decode_python(text), mode)
    return v.valid, v.error_type


# --- decoding -------------------------------------------------------------------------------------


def test_python_decoding_keeps_bfcl_quirks() -> None:
    args = decode_python("[f(a=+5, b=~5, c=not True, d=5*2, e=units, g=str(1), h=x[0], i=..., j=2**10)]")
    assert args == [{"name": "f", "arguments": {"a": -5, "b": -5, "c": -1, "d": 10, "e": "units", "g": "str(1)",
                                                "h": "x[0]", "i": "...", "j": 1024}}]
    assert decode_python("f(10, 5)") == [{"name": "f", "arguments": {}}]  # positional arguments dropped
    assert decode_python("a.b.c(x=g(y=1))") == [{"name": "a.b.c", "arguments": {"x": {"g": {"y": 1}}}}]
    assert decode_python("```\n[f(a=1)]\n```") == [{"name": "f", "arguments": {"a": 1}}]
    assert decode_python("[]") == []
    for bad in ("```python\n[f(a=1)]\n```", "[f(a=1)] Hope this helps", "[f(a=lambda: 1)]", "[f(a=math.pi)]",
                "[x]", "f(a=1)\ng(b=2)", "[f(a={**x})]"):
        assert isinstance(decode_python(bad), DecodeFailure), bad
    assert decode_python("<TOOLCALL>[f(a=1)]</TOOLCALL> done", tool_call_tag=True) == [
        {"name": "f", "arguments": {"a": 1}}]
    assert isinstance(decode_python("[f(a=1)]", tool_call_tag=True), DecodeFailure)


def test_python_decoding_never_executes_the_text(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"[f(a=1 + __import__('os').system('touch {marker}'))]"
    assert isinstance(decode_python(text), DecodeFailure)
    assert not marker.exists()
    # evaluated, each would take minutes or gigabytes (1<<10**10 alone is a 1.25 GB integer): the memory the
    # decoding allocated at its peak shows it was not, whatever the machine's speed
    tracemalloc.start()
    try:
        for bomb in ("[f(a=9**9**9)]", "[f(a='x'*10**12)]", "[f(a=1<<10**10)]"):
            assert isinstance(decode_python(bomb), DecodeFailure), bomb
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak


def test_tool_calls_are_decoded_as_bfcl_decodes_fc_answers() -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "math_factorial", "arguments": '{"number": 5}'}},
        {"id": "b", "type": "function", "function": {"name": "other", "arguments": "{}"}}]}
    assert calls_from_message(message, {"math_factorial": "math.factorial"}) == [
        {"name": "math.factorial", "arguments": {"number": 5}}, {"name": "other", "arguments": {}}]
    assert isinstance(calls_from_message({"role": "assistant", "content": "I think 120"}), DecodeFailure)
    assert calls_from_message({"role": "assistant", "content": ""}) == []
    assert calls_from_message({"role": "assistant", "content": None, "tool_calls": []}) == []
    broken = {"tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}
    assert calls_from_message(broken).error_type == "ast_decoder:decoder_failed"
    listed = {"tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}
    assert calls_from_message(listed).error_type == "ast_decoder:decoder_wrong_output_format"


# --- BFCL's worked examples -------------------------------------------------------------------------


@pytest.mark.needs_corpus
@pytest.mark.parametrize("text, expected", [
    ("[calculate_triangle_area(base=10, height=5)]", (True, None)),
    ("calculate_triangle_area(base=10, height=5)", (True, None)),
    ("[calculate_triangle_area(base=10, height=5, unit='  U-n_i.t/s*^ ')]", (True, None)),
    ("[calculate_triangle_area(base=10, height=5, unit='-')]", (True, None)),
    ("[calculate_triangle_area(base=10, height=5, unit=...)]", (True, None)),
    ("[calculate_triangle_area(base=10, height=5, unit=units)]", (True, None)),
    ("[calculate_triangle_area(base=10, height=5, unit='cm')]", (False, "value_error:string")),
    ("[calculate_triangle_area(base=10.0, height=5)]", (False, "type_error:simple")),
    ("[calculate_triangle_area(base=+10, height=5)]", (False, "value_error:others")),
    ("[calculate_triangle_area(base=5*2, height=5)]", (True, None)),
    ("[calculate_triangle_area(10, 5)]", (False, "simple_function_checker:missing_required")),
    ("[calculate_triangle_area(base=10, height=5, extra=1)]", (False, "simple_function_checker:unexpected_param")),
    ("```python\n[calculate_triangle_area(base=10, height=5)]\n```", (False, "ast_decoder:decoder_failed")),
    ("```\n[calculate_triangle_area(base=10, height=5)]\n```", (True, None)),
    ("[calculate_triangle_area(base=10, height=5)] Hope this helps", (False, "ast_decoder:decoder_failed")),
    ("[calculate_triangle_area(base=10, height=5), calculate_triangle_area(base=10, height=5)]",
     (False, "simple_function_checker:wrong_count")),
    ("[Calculate_Triangle_Area(base=10, height=5)]", (False, "simple_function_checker:wrong_func_name")),
])
def test_e1_simple_python_0(text: str, expected: tuple[bool, str | None]) -> None:
    assert verdict_of("simple_python_0", text) == expected


@pytest.mark.needs_corpus
def test_e2_to_e5_types_lists_and_dicts() -> None:
    assert verdict_of("simple_python_14", "[calculate_derivative(function='3x^2 + 2x - 1', x_value=0)]") == (True, None)
    area = "[calculate_area_under_curve(function='x**2', interval={})]"
    assert verdict_of("simple_python_13", area.format("[1.0, 3.0]")) == (True, None)
    assert verdict_of("simple_python_13", area.format("[1, 3]")) == (False, "type_error:nested")
    assert verdict_of("simple_python_13", area.format("(1.0, 3.0)")) == (False, "type_error:simple")
    assert verdict_of("simple_python_13", area.format("[3.0, 1.0]")) == (False, "value_error:list/tuple")
    for coords in ("(33.4484, -112.074)", "[33.4484, -112.074]"):
        text = f"[calculate_distance(coord1={coords}, coord2=[34.0522, -118.2437], unit='miles')]"
        assert verdict_of("simple_python_83", text) == (True, None)
    fetch = "[db_fetch_records(database_name='StudentDB', table_name='students', conditions={}{})]"
    assert verdict_of("simple_python_89", fetch.format(
        "{'department': 'science', 'school': 'bluebird high-school'}", "")) == (True, None)
    assert verdict_of("simple_python_89", fetch.format("{'department': 'Science'}", "")) == (
        False, "value_error:dict_key")
    assert verdict_of("simple_python_89", fetch.format(
        "{'department': 'Science', 'school': 'Bluebird HS', 'x': 1}", "")) == (False, "value_error:dict_key")
    assert verdict_of("simple_python_89", fetch.format(
        "{'department': 'Science', 'school': 'Bluebird HS'}", ", fetch_limit=False")) == (False, "type_error:simple")
    query = ("[database.query(table='user', conditions=[{{'field': 'age', 'operation': '>', 'value': {}}}, "
             "{{'field': 'job', 'operation': '=', 'value': 'engineer'}}])]")
    assert verdict_of("simple_python_96", query.format("'25'")) == (True, None)
    assert verdict_of("simple_python_96", query.format("25")) == (False, "value_error:dict_value")


@pytest.mark.needs_corpus
def test_e6_parallel_matching_is_greedy_in_bfcl_mode_and_fair_in_fair_mode() -> None:
    a, b = "spotify.play(artist='Taylor Swift', duration=20)", "spotify.play(artist='Maroon 5', duration=15)"
    assert verdict_of("parallel_0", f"[{a}, {b}]") == (True, None)
    assert verdict_of("parallel_0", f"[{b}, {a}]") == (True, None)
    assert verdict_of("parallel_0", f"[{a}]") == (False, "parallel_function_checker_no_order:wrong_count")
    assert verdict_of("parallel_0", f"[{a}, {a}]") == (False, "parallel_function_checker_no_order:cannot_find_match")
    stock = "get_stock_price(company_name='{}', date='{}', exchange='NASDAQ')"
    calls = [stock.format("Microsoft", "2022-01-01"), stock.format("Microsoft", "2022-02-01"),
             stock.format("Apple", "2022-01-01"), stock.format("Apple", "2022-02-01")]
    forward, backward = f"[{', '.join(calls)}]", f"[{', '.join(reversed(calls))}]"
    assert verdict_of("parallel_178", forward) == (True, None)
    assert verdict_of("parallel_178", backward) == (False, "parallel_function_checker_no_order:cannot_find_match")
    assert verdict_of("parallel_178", backward, "fair") == (True, None)
    assert verdict_of("parallel_0", f"[{a}, {a}]", "fair")[0] is False


@pytest.mark.needs_corpus
def test_e7_names_of_fc_models() -> None:
    good = [{"name": "triangle_properties.get", "arguments": {"side1": 5, "side2": 4, "side3": 3}}]
    assert check(case("multiple_0"), good).valid
    underscored = [{"name": "triangle_properties_get", "arguments": good[0]["arguments"]}]
    assert check(case("multiple_0"), underscored, underscore_to_dot=True).valid
    assert check(case("multiple_0"), good, underscore_to_dot=True).error_type == \
        "simple_function_checker:wrong_func_name"
    assert check(case("multiple_0"), underscored).error_type == "simple_function_checker:wrong_func_name"
    both = good + [{"name": "circle_properties.get", "arguments": {"radius": 3}}]
    assert check(case("multiple_0"), both).error_type == "multiple_function_checker:wrong_count"


@pytest.mark.needs_corpus
def test_e8_variable_answers_compare_exactly() -> None:
    base = "[aws.lexv2_models.list_exports(botId='my-bot-id', botVersion='v2'{})]"
    assert verdict_of("live_simple_30-8-0", base.format(", filterName=None")) == (True, None)
    assert verdict_of("live_simple_30-8-0", base.format(", filterName=''")) == (True, None)
    assert verdict_of("live_simple_30-8-0", base.format(", filterName='Bot'")) == (False, "value_error:others")
    hotel = "[Hotels_4_SearchHotel(location='Kuala Lumpur, Malaysia'{})]"
    assert verdict_of("live_multiple_306-131-5", hotel.format(", number_of_rooms='dontcare'")) == (True, None)
    for bad in ("'DontCare'", "2"):
        assert verdict_of("live_multiple_306-131-5", hotel.format(f", number_of_rooms={bad}")) == (
            False, "value_error:others")
    assert verdict_of("live_multiple_306-131-5", hotel.format(", smoking_allowed=False")) == (True, None)
    assert verdict_of("live_multiple_306-131-5", hotel.format(", smoking_allowed='false'")) == (
        False, "value_error:others")


@pytest.mark.needs_corpus
def test_e10_relevance_and_irrelevance() -> None:
    for text in ("I cannot answer.", "[]", "hello", "```python\n[f(a=1)]\n```"):
        assert verdict_of("irrelevance_0", text) == (True, None), text
    v = check(case("irrelevance_0"), decode_python("[foo(x=1)]"))
    assert (v.valid, v.error_type, v.taxonomy) == (False, "irrelevance_error:decoder_success", "irrelevance_violation")
    relevance = _relevance_cases()[0]
    assert check(relevance, decode_python("[foo()]")).valid
    miss = check(relevance, decode_python("Sorry."))
    assert (miss.valid, miss.error_type, miss.taxonomy) == (False, "relevance_error:decoder_failed", "relevance_miss")


def _relevance_cases():
    from toolquake.bfcl.corpus import load_category

    return load_category("live_relevance")


@pytest.mark.needs_corpus
def test_e12_java_values_are_source_text() -> None:
    java = case("simple_java_25")
    call = "SmsHomeRecommendSubjectController.updateSort"
    assert check(java, [{"name": call, "arguments": {"id": "42L", "sort": "5"}}]).valid
    assert check(java, [{"name": call, "arguments": {"id": "42", "sort": "5"}}]).error_type == "type_error:simple"
    assert check(java, [{"name": call, "arguments": {"id": 42, "sort": 5}}]).error_type == "type_error:java"
    meta = case("simple_java_64")
    args = {"name": "timestamp", "factory": "dateFactory", "script": "dateScript", "onScriptError": "FAIL"}
    # BFCL's Java decoder reduces any map to its empty form, which passes here (bare-string GT quirk)
    empty = {**args, "meta": "new HashMap<String, String>()"}
    assert check(meta, [{"name": "DateScriptFieldType.createFieldType", "arguments": empty}]).valid
    with_body = {**args, "meta": 'new HashMap<String, String>() {{ put("format", "x"); }}'}
    assert check(meta, [{"name": "DateScriptFieldType.createFieldType", "arguments": with_body}]).error_type == \
        "value_error:dict_value"


# --- taxonomy, modes --------------------------------------------------------------------------------


def test_taxonomy_classes_follow_bfcl_error_types() -> None:
    assert classify("ast_decoder:decoder_failed") == "wrong_syntax"
    assert classify("simple_function_checker:wrong_func_name") == "wrong_function"
    assert classify("multiple_function_checker:wrong_count") == "wrong_count"
    assert classify("simple_function_checker:missing_optional") == "missing_param"
    assert classify("simple_function_checker:unexpected_param") == "unexpected_param"
    assert classify("type_error:nested") == "wrong_type"
    assert classify("value_error:dict_value") == "wrong_param_value"
    assert classify(None) is None


DOCS = [{"name": "weather.get", "description": "", "parameters": {"type": "dict", "required": ["city"], "properties": {
    "city": {"type": "string", "description": ""}, "days": {"type": "integer", "description": ""}}}}]
GT = [{"weather.get": {"city": ["Miami, Florida"], "days": ["", 3]}},
      {"weather.get": {"city": ["New York City"], "days": ["", 3]}}]


def test_unmatched_parallel_calls_are_classified_by_the_closest_call() -> None:
    calls = [{"name": "weather.get", "arguments": {"city": "Miami, Florida"}},
             {"name": "weather.get", "arguments": {"city": "Boston"}}]
    v = check_calls(DOCS, GT, "parallel", calls)
    assert v.error_type == "parallel_function_checker_no_order:cannot_find_match"
    assert v.taxonomy == "wrong_param_value"
    wrong_fn = [calls[0], {"name": "weather.set", "arguments": {"city": "New York City"}}]
    assert check_calls(DOCS, GT, "parallel", wrong_fn).taxonomy == "wrong_function"


def test_number_words_past_any_real_number_stay_words() -> None:
    """A model's "one hundred hundred …" grew one integer without bound: past 4,300 digits str() raised ValueError
    (the semantic scorer's normal form crashed on a model string), and each `*= 100` on a huge integer made the
    loop quadratic. Past 10**18 the run is not a number: its words are kept; real numbers read as before."""
    text = "The answer is one " + "hundred " * 5000 + "and five apples"
    t0 = time.process_time()
    normal = normalize(text)
    assert normal == "answer is one " + "hundred " * 5000 + "and five apples"
    assert normalize("one hundred hundred " * 20000) == ("one hundred hundred " * 20000).strip()
    assert time.process_time() - t0 < 2.0  # about 0.2 s; the unbounded integer was quadratic
    assert normalize("nine hundred ninety nine billion nine hundred ninety nine million and one") == "999999000001"
    assert normalize("one thousand and two") == "1002"
    assert normalize("ten hundred hundred hundred hundred hundred hundred hundred hundred") == str(10**17)
    assert normalize("one hundred hundred hundred hundred hundred hundred hundred hundred hundred hundred") == \
        "one" + " hundred" * 10  # 10**20: over the cap
    matcher = SemanticMatcher(embeddings=False)
    assert matcher(text, text) and not matcher(text, "The answer is one hundred and five apples")


def test_semantic_mode_accepts_equivalent_strings_and_never_replaces_bfcl() -> None:
    matcher = SemanticMatcher(embeddings=False)
    assert normalize("Miami, FL") == normalize("Miami, Florida") == "miami florida"
    assert normalize("twenty-five") == "25" and normalize("the Eiffel Tower") == "eiffel tower"
    assert normalize("check in") != normalize("check Indiana")  # lower-case 'in' is not a state
    calls = [{"name": "weather.get", "arguments": {"city": "New York City", "days": 3}},
             {"name": "weather.get", "arguments": {"city": "Miami, FL"}}]
    assert check_calls(DOCS, GT, "parallel", calls).error_type == \
        "parallel_function_checker_no_order:cannot_find_match"
    assert check_calls(DOCS, GT, "parallel", calls, "fair").valid is False
    assert check_calls(DOCS, GT, "parallel", calls, "semantic", equivalence=matcher).valid
    wrong = [calls[0], {"name": "weather.get", "arguments": {"city": "Miami, OH"}}]
    assert not check_calls(DOCS, GT, "parallel", wrong, "semantic", equivalence=matcher).valid
    dated = [{"name": "weather.get", "arguments": {"city": "Miami, Florida 2"}}, calls[0]]
    assert not check_calls(DOCS, GT, "parallel", dated, "semantic", equivalence=matcher).valid


@pytest.mark.needs_embeddings
def test_semantic_mode_uses_embeddings_beyond_normalisation() -> None:
    matcher = SemanticMatcher()
    assert matcher("New York City", "NYC") and matcher.embeddings_used
    assert not matcher("New York", "Los Angeles")
    assert not matcher("2023-03-01", "2023-03-02")  # digits differ: never by embedding


# --- the CLI contract -----------------------------------------------------------------------------


def run_score(lines: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", "score", "--input", "-", *args], cwd=ROOT,
                          input="".join(line + "\n" for line in lines), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_score_cli_keeps_input_order_and_counts_bad_lines(tmp_path: Path) -> None:
    stock = "get_stock_price(company_name='{}', date='{}', exchange='NASDAQ')"
    backward = [stock.format("Apple", "2022-02-01"), stock.format("Apple", "2022-01-01"),
                stock.format("Microsoft", "2022-02-01"), stock.format("Microsoft", "2022-01-01")]
    lines = [
        json.dumps(
            {
                "id": "simple_python_0",
                "calls": [{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}],
            }
        ),
        "{not json",
        json.dumps({"id": "no_such_case_7", "calls": []}),
        json.dumps({"id": "simple_python_0"}),
        json.dumps({"id": "parallel_178", "text": "[" + ", ".join(backward) + "]"}),
        json.dumps(
            {
                "id": "multiple_0",
                "message": {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {
                                "name": "triangle_properties_get",
                                "arguments": '{"side1":5,"side2":4,"side3":3}',
                            },
                        }
                    ],
                },
            }
        ),
        json.dumps(
            {
                "id": "simple_python_0",
                "calls": [{"name": "calculate_triangle_area", "arguments": '{"base": 10, "height": "5"}'}],
            }
        ),
        json.dumps(["a list"]),
        json.dumps({"id": "multi_turn_base_0", "text": "[]"}),
    ]
    done = run_score(lines, "--output", str(tmp_path / "v.jsonl"))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(x) for x in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [
        "simple_python_0",
        None,
        "no_such_case_7",
        "simple_python_0",
        "parallel_178",
        "multiple_0",
        "simple_python_0",
        None,
        "multi_turn_base_0",
    ]
    assert [r["valid"] for r in rows] == [True, False, False, False, False, True, False, False, False]
    assert [r["error_type"] for r in rows] == [
        None,
        "toolquake:input_error",
        "toolquake:input_error",
        "toolquake:input_error",
        "parallel_function_checker_no_order:cannot_find_match",
        None,
        "type_error:simple",
        "toolquake:input_error",
        "toolquake:input_error",
    ]
    assert rows[6]["taxonomy"] == "wrong_type" and rows[1]["taxonomy"] == "input_error"
    assert all(set(r) >= {"id", "valid", "error_type", "errors", "taxonomy"} for r in rows)
    assert "input_err" in done.stderr and "overall" in done.stderr

    fair = run_score(lines, "--mode", "fair", "--summary")
    summary = json.loads(fair.stdout)
    assert summary["overall"]["total"] == 9 and summary["overall"]["input_errors"] == 5
    assert summary["categories"]["parallel"] == {"total": 1, "valid": 1, "flipped_to_valid": 1, "accuracy": 1.0}


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_score_cli_reads_the_tag_flag_of_format_sensitivity_ids() -> None:
    config = "ret_fmt=python&tool_call_tag=True&func_doc_fmt=xml&prompt_fmt=plaintext&style=classic"
    fs_id = f"format_sensitivity_3:{config}:simple_python_0"
    json_id = fs_id.replace("ret_fmt=python", "ret_fmt=json")
    tagged = "Here: <TOOLCALL>[calculate_triangle_area(base=10, height=5)]</TOOLCALL>"
    lines = [
        json.dumps({"id": fs_id, "text": tagged}),
        json.dumps({"id": fs_id, "text": "[calculate_triangle_area(base=10, height=5)]"}),
        json.dumps({"id": json_id, "text": "[]"}),
    ]
    rows = [json.loads(x) for x in run_score(lines).stdout.splitlines()]
    assert [(r["category"], r["valid"], r["error_type"]) for r in rows] == [
        ("format_sensitivity", True, None),
        ("format_sensitivity", False, "ast_decoder:decoder_failed"),
        ("format_sensitivity", False, "toolquake:input_error"),
    ]


# --- robustness -----------------------------------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("f(a=1, 'x')[]{}*+-~<>TOOLCALL/`\n .:lambda")), max_size=40))
def test_decoding_arbitrary_text_returns_calls_or_a_failure(text: str) -> None:
    out = decode_python(text)
    assert isinstance(out, DecodeFailure) or (isinstance(out, list) and all("name" in c for c in out))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "name": st.sampled_from(["weather.get", "x", ""]),
                "arguments": st.dictionaries(st.sampled_from(["city", "days", "z"]), _json_values, max_size=3),
            }
        ),
        max_size=3,
    ),
    st.sampled_from(["simple_python", "parallel", "multiple", "simple_java", "simple_javascript", "irrelevance"]),
    st.sampled_from(["bfcl", "fair"]),
)
def test_any_json_answer_gets_a_verdict(calls: list, category: str, mode: str) -> None:
    v = check_calls(DOCS, GT if "parallel" in category else GT[:1], category, calls, mode)
    assert v.valid in (True, False)
    assert v.valid or (v.error_type and v.errors)
