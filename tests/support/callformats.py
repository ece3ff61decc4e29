"""Calls as models write them, for the call-format tests: seed 002 §5's failure examples and the other
near-misses (each with what BFCL's decoder and lenient parsing make of it), and every ground truth of the BFCL
corpus as concrete calls."""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any, Iterator

# --- the failure examples of seed 002 §5 ----------------------------------------------------------
# Each: the answer text, the return format and tag of its variation, what BFCL's decoder makes of it
# (strict: None = decodes, else the error; and the calls it decodes), and what lenient parsing
# recovers (None = nothing more than strict) with the leniency that must fire.


@dataclass
class Example:
    name: str
    text: str
    return_format: str
    tag: bool
    strict_error: str | None
    strict_calls: list[dict[str, Any]]
    lenient_calls: list[dict[str, Any]] | None = None
    leniencies: tuple[str, ...] = ()
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


GCD_SCHEMA = {"math.gcd": {"num1": {"type": "integer"}, "num2": {"type": "integer"}}}
USER_INFO_SCHEMA = {"update_user_info": {"user_id": {"type": "integer"}, "update_info": {"type": "object"},
                                         "database": {"type": "string"}}}
PAINT = [call("paint_color_mixture", paint_type="Watercolor", color="magenta"),
         call("paint_color_mixture", paint_type="Acrylic", color="navy")]
ALIMONY = [call("alimony_calculator.ca.calculate", payor_income=10000, recipient_income=3000, duration=10),
           call("alimony_calculator.ca.calculate", payor_income=10000, recipient_income=3000, duration=20)]
SERVICE = [call("get_service_id", service_id=2, province_id=1, district_name="Chatuchak", rating=4.5)]
USER_INFO = {"user_id": 43523, "update_info": {"name": "John Doe", "email": "johndoe@email.com"}}
HOUSE = [call("predict_house_price", area=2000, rooms=4, year=1985, location="San Francisco"),
         call("lawsuit_search", entity="Mr. John Doe", county="San Francisco", state="California"),
         call("calculate_probability", total_outcomes=1000, favorable_outcomes=5, round_to=3)]
LAWSUIT = [call("lawsuit_search", company="Google", start_date="01-01-2021", location="California",
                status="ongoing")]

SEED_EXAMPLES = [
    Example("type_int_instead_of_integer (simple_19, claude-3.7-sonnet)",
            '<TOOLCALL>\n<functions>\n<function name="math.gcd">\n<params>\n'
            '<param name="num1" value="40" type="int"/>\n<param name="num2" value="50" type="int"/>\n'
            '</params>\n</function>\n</functions>\n</TOOLCALL>',
            "verbose_xml", True, None, [call("math.gcd", num1="40", num2="50")],
            [call("math.gcd", num1=40, num2=50)], ("xml_type_from_schema",), GCD_SCHEMA),
    Example("type_integer (simple_19, DeepSeek-R1)",
            '<TOOLCALL>\n<functions>\n<function name="math.gcd">\n<params>\n'
            '<param name="num1" value="40" type="integer"/>\n<param name="num2" value="50" type="integer"/>\n'
            '</params>\n</function>\n</functions>\n</TOOLCALL>',
            "verbose_xml", True, None, [call("math.gcd", num1=40, num2=50)], schemas=GCD_SCHEMA),
    Example("each call in its own <functions> (parallel_36, claude-3.7-sonnet)",
            "\n".join('<functions>\n<function name="paint_color_mixture">\n<params>\n'
                      f'<param name="paint_type" value="{c["arguments"]["paint_type"]}" type="string"/>\n'
                      f'<param name="color" value="{c["arguments"]["color"]}" type="string"/>\n'
                      '</params>\n</function>\n</functions>' for c in PAINT),
            "verbose_xml", False, None, PAINT[:1], PAINT, ("per_call_functions",)),
    Example("all calls in one <functions> (parallel_36, mistral-large)",
            "<functions>\n" + "\n".join(
                '<function name="paint_color_mixture">\n<params>\n'
                f'<param name="paint_type" value="{c["arguments"]["paint_type"]}" type="string"/>\n'
                f'<param name="color" value="{c["arguments"]["color"]}" type="string"/>\n'
                '</params>\n</function>' for c in PAINT) + "\n</functions>",
            "verbose_xml", False, None, PAINT),
    Example("each call in its own <TOOLCALL>, no brackets (parallel_23, gemini-2.0-flash-lite)",
            "<TOOLCALL>\nalimony_calculator.ca.calculate(payor_income=10000, recipient_income=3000,\nduration=10)\n"
            "</TOOLCALL>\n<TOOLCALL>\nalimony_calculator.ca.calculate(payor_income=10000, recipient_income=3000,\n"
            "duration=20)\n</TOOLCALL>",
            "python", True, None, ALIMONY[:1], ALIMONY, ("per_call_toolcall",)),
    Example("all calls in one <TOOLCALL> list (parallel_23, gemini-2.5-pro)",
            "<TOOLCALL>\n[alimony_calculator.ca.calculate(payor_income=10000, recipient_income=3000, duration=10),\n"
            "alimony_calculator.ca.calculate(payor_income=10000, recipient_income=3000, duration=20)]\n</TOOLCALL>",
            "python", True, None, ALIMONY),
    Example("misplaced quotes in json keys (live_simple_181-106-0, Llama-3.1-70B)",
            '<TOOLCALL>\n[{"function":"get_service_id","parameters":{"service_id:"\\2","province_id:"\\1",'
            '"district_name:Chatuchak","rating:"\\4.5"}}]\n</TOOLCALL>',
            "json", True, None, []),
    Example("fenced json inside <TOOLCALL> (live_simple_181-106-0, Qwen3-32B)",
            '<TOOLCALL>\n```json\n[{"function":"get_service_id","parameters":{"service_id":2,"province_id":1,'
            '"district_name":"Chatuchak","rating":4.5}}]\n```\n</TOOLCALL>',
            "json", True, None, SERVICE),
    Example("backslash-escaped quotes in an xml attribute (simple_94, gemma-3-27b)",
            '<TOOLCALL>\n<functions>\n<function name="update_user_info">\n<params>\n'
            '<param name="user_id" value="43523" type="integer"/>\n'
            '<param name="update_info" value="{\\"name\\": \\"John Doe\\", \\"email\\": \\"johndoe@email.com\\"}" '
            'type="dict"/>\n</params>\n</function>\n</functions>\n</TOOLCALL>',
            "verbose_xml", True, "decoder_failed", [], schemas=USER_INFO_SCHEMA),
    Example("python-literal dict in an xml attribute (simple_94, gpt-4o)",
            '<TOOLCALL>\n<functions>\n<function name="update_user_info">\n<params>\n'
            '<param name="user_id" value="43523" type="integer"/>\n'
            "<param name=\"update_info\" value=\"{'name':'John Doe', 'email':'johndoe@email.com'}\" type=\"dict\"/>\n"
            '<param name="database" value="" type="string"/>\n</params>\n</function>\n</functions>\n</TOOLCALL>',
            "verbose_xml", True, None, [call("update_user_info", **USER_INFO, database="")], schemas=USER_INFO_SCHEMA),
    Example("function names as xml tags, no <functions> (parallel_multiple_154, watt-tool-70B)",
            "<predict_house_price>\n<area>2000</area>\n<rooms>4</rooms>\n<year>1985</year>\n"
            "<location>San Francisco</location>\n</predict_house_price>\n<lawsuit_search>\n"
            "<entity>Mr. John Doe</entity>\n<county>San Francisco</county>\n<state>California</state>\n"
            "</lawsuit_search>",
            "concise_xml", False, "decoder_failed", []),
    Example("concise xml (parallel_multiple_154, Llama-3.1-70B)",
            "<functions>\n" + "\n".join(
                f'<function name="{c["name"]}">\n' + "\n".join(
                    f'<param name="{k}" type="{"integer" if isinstance(v, int) else "string"}">{v}</param>'
                    for k, v in c["arguments"].items()) + "\n</function>" for c in HOUSE) + "\n</functions>",
            "concise_xml", False, None, HOUSE),
    Example("<params> never closed (simple_94, gemma-3-27b)",
            '<TOOLCALL>\n<functions>\n<function name="update_user_info">\n<params>\n'
            '<param name="user_id" value="43523" type="integer"/>\n'
            "<param name=\"update_info\" value=\"{'name': 'John Doe', 'email': 'johndoe@email.com'}\" type=\"dict\"/>\n"
            '<param name="database" value="the database" type="string"/>\n</function>\n</functions>\n</TOOLCALL>',
            "verbose_xml", True, "decoder_failed", [],
            [call("update_user_info", **USER_INFO, database="the database")], ("unclosed_tag",), USER_INFO_SCHEMA),
    Example("python calls where json was asked (simple_168, watt-tool-70B)",
            '<TOOLCALL>\n[lawsuit_search(company="Google", start_date="01-01-2021", location="California")]\n'
            "</TOOLCALL>",
            "json", True, None, []),
    Example("fenced json inside <TOOLCALL> (simple_168, claude-3.5-haiku)",
            '<TOOLCALL>\n```json\n[{"function":"lawsuit_search","parameters":{"company":"Google",'
            '"start_date":"01-01-2021",\n"location":"California","status":"ongoing"}}]\n```\n</TOOLCALL>',
            "json", True, None, LAWSUIT),
]

# near-misses the issue names besides those of §5, and BFCL quirks from the spec's worked examples
TRIANGLE = [call("calculate_triangle_area", base=10, height=5)]
EXTRA_EXAMPLES = [
    Example(
        "python fence with a language tag (spec E1)",
        "```python\n[calculate_triangle_area(base=10, height=5)]\n```",
        "python",
        False,
        "decoder_failed",
        [],
        TRIANGLE,
        ("code_fence",),
    ),
    Example(
        "python fence without a language tag (spec E1)",
        "```\n[calculate_triangle_area(base=10, height=5)]\n```",
        "python",
        False,
        None,
        TRIANGLE,
    ),
    Example(
        "python without brackets (spec E1)",
        "calculate_triangle_area(base=10, height=5)",
        "python",
        False,
        None,
        TRIANGLE,
    ),
    Example(
        "python trailing prose (spec E1)",
        "[calculate_triangle_area(base=10, height=5)] Hope this helps",
        "python",
        False,
        "decoder_failed",
        [],
    ),
    Example(
        "python calls one per line",
        "f(a=1)\ng(b='x')",
        "python",
        False,
        "decoder_failed",
        [],
        [call("f", a=1), call("g", b="x")],
        ("python_no_brackets",),
    ),
    Example(
        "python positional args are dropped (spec E1)",
        "[calculate_triangle_area(10, 5)]",
        "python",
        False,
        None,
        [call("calculate_triangle_area")],
    ),
    Example("python tag missing (spec E9)", "[f(a=1)]", "python", True, "decoder_failed", []),
    Example(
        "python prose around the tag (spec E9)",
        "Sure. <TOOLCALL>[f(a=1)]</TOOLCALL> Done.",
        "python",
        True,
        None,
        [call("f", a=1)],
    ),
    Example(
        "<TOOLCALL> never closed",
        "<TOOLCALL>[f(a=1)]",
        "python",
        True,
        "decoder_failed",
        [],
        [call("f", a=1)],
        ("unclosed_tag",),
    ),
    Example(
        "json single object without a list (spec E9)",
        '{"function": "f", "parameters": {"a": 1}}',
        "json",
        False,
        None,
        [call("f", a=1)],
    ),
    Example(
        "json single object inside <TOOLCALL> (spec E9)",
        '<TOOLCALL>{"function": "f", "parameters": {"a": 1}}</TOOLCALL>',
        "json",
        True,
        None,
        [],
        [call("f", a=1)],
        ("json_bare_object",),
    ),
    Example(
        "json 'name' instead of 'function' (spec E9)",
        '[{"name": "f", "parameters": {"a": 1}}]',
        "json",
        False,
        "decoder_failed",
        [],
    ),
    Example(
        "json list of objects as an argument (spec §4.4 bug)",
        '```json\n[{"function": "q", "parameters": {"conditions": [{"field": "age"}]}}]\n```',
        "json",
        False,
        None,
        [],
        [call("q", conditions=[{"field": "age"}])],
        ("json_nested_objects",),
    ),
    Example(
        "json one list per call",
        '[{"function": "f", "parameters": {"a": 1}}]\n[{"function": "g", "parameters": {}}]',
        "json",
        False,
        None,
        [call("f", a=1)],
        [call("f", a=1), call("g")],
        ("per_call_block",),
    ),
    Example(
        "verbose xml integer written as 20.0 (spec E9)",
        '<functions><function name="f"><params><param name="n" value="20.0" type="integer"/></params>'
        "</function></functions>",
        "verbose_xml",
        False,
        "decoder_failed",
        [],
        [call("f", n=20)],
        ("xml_type_from_schema",),
        {"f": {"n": {"type": "integer"}}},
    ),
    Example(
        "concise xml with a verbose <params> wrapper (spec E9)",
        '<functions><function name="f"><params><param name="n" type="integer">2</param></params></function>'
        "</functions>",
        "concise_xml",
        False,
        None,
        [call("f")],
    ),
    Example(
        "xml with an unescaped & (spec E9)",
        '<functions><function name="f"><param name="s" type="string">A & B</param></function></functions>',
        "concise_xml",
        False,
        "decoder_failed",
        [],
    ),
    Example(
        "reasoning before the calls",
        "<think>\nThe user wants 5!, so f.\n</think>\n\n[f(a=5)]",
        "python",
        False,
        "decoder_failed",
        [],
        [call("f", a=5)],
        ("reasoning_block",),
    ),
    Example(
        "a draft call in the reasoning",
        '<think>maybe <functions><function name="g"></function></functions></think>'
        '<functions><function name="f"><param name="a" type="integer">5</param></function></functions>',
        "concise_xml",
        False,
        None,
        [call("g")],
        [call("f", a=5)],
        ("reasoning_block",),
    ),
    Example(
        "xml <functions> never closed",
        '<functions><function name="f"><param name="s" type="string">x</param></function>',
        "concise_xml",
        False,
        "decoder_failed",
        [],
        [call("f", s="x")],
        ("unclosed_tag",),
    ),
]


AST_CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
                  "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


# --- ground truth as a model would write it -------------------------------------------------------

def _first(alternatives: list[Any]) -> Any:
    return next(_concrete(a) for a in alternatives if a != "")


def _concrete(value: Any) -> Any:
    """One acceptable value: the first non-optional alternative, inside dicts and lists of dicts too."""
    if isinstance(value, dict):
        return {k: _first(v) if isinstance(v, list) and any(a != "" for a in v) else v for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return [_concrete(x) for x in value]
    return value


def ground_truth_calls(case: Any) -> list[dict[str, Any]]:
    calls = []
    for item in case.ground_truth:
        ((name, params),) = item.items()
        args = {p: _first(alts) for p, alts in params.items() if any(a != "" for a in alts)}
        calls.append({"name": name, "arguments": args})
    return calls


def all_ground_truths() -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    from toolquake.bfcl import corpus
    from toolquake.bfcl.decode import decode_python

    for category in AST_CATEGORIES:
        for case in corpus.load_category(category):
            yield case, ground_truth_calls(case)
    for category in MULTI_TURN:
        for case in corpus.load_category(category):
            for turn in case.ground_truth:
                calls = [c for text in turn for c in decode_python(text)]
                if calls:
                    yield case, calls


def python_can_write(calls: list[dict[str, Any]]) -> bool:
    """Python call syntax needs every parameter name to be an identifier that is not a keyword."""
    return all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
               for c in calls for k in c["arguments"])
