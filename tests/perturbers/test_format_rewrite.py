"""format_rewrite: prompts, history, parsing (seed 002 §5 failure examples) and restore, in-process."""

from __future__ import annotations

import json
import keyword
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import ROOT
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.helpers.callformat_parse import parse_lenient, parse_strict
from toolquake.perturbers.helpers.callformat_render import render_calls
from toolquake.perturbers.helpers.callformats import CONFIGURATIONS, DEFAULT, CallFormat

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


def _typed(calls: list[dict[str, Any]]) -> str:
    """Calls compared with their types (1 == 1.0 == True under ==, not under repr)."""
    return repr(calls)


@pytest.mark.parametrize("ex", SEED_EXAMPLES + EXTRA_EXAMPLES, ids=lambda e: e.name)
def test_failure_examples_are_classified_as_bfcl_does_and_recovered_where_intended(ex: Example) -> None:
    strict = parse_strict(ex.text, ex.return_format, ex.tag)
    assert strict.error == ex.strict_error, strict.detail
    assert strict.ok == (ex.strict_error is None)
    assert _typed(strict.calls) == _typed(ex.strict_calls)
    lenient = parse_lenient(ex.text, ex.return_format, ex.tag, ex.schemas)
    if ex.lenient_calls is None:  # nothing to recover: lenient agrees with strict and names no leniency
        assert (lenient.ok, lenient.error, _typed(lenient.calls)) == (strict.ok, strict.error, _typed(strict.calls))
        assert lenient.leniencies == ()
    else:
        assert lenient.ok, lenient.detail
        assert _typed(lenient.calls) == _typed(ex.lenient_calls)
        assert lenient.leniencies == ex.leniencies


# --- configurations and prompts -------------------------------------------------------------------


def test_the_26_configurations_are_bfcls_in_bfcls_order() -> None:
    assert len(CONFIGURATIONS) == 26 == len({c.config_string for c in CONFIGURATIONS})
    assert CONFIGURATIONS[0].config_string == (
        "ret_fmt=python&tool_call_tag=True&func_doc_fmt=python&prompt_fmt=plaintext&style=classic"
    )
    assert CONFIGURATIONS[5] == DEFAULT
    assert CONFIGURATIONS[12] == CallFormat("verbose_xml", True, "python")
    assert CONFIGURATIONS[23] == CallFormat("concise_xml", False, "json")
    assert CONFIGURATIONS[24] == CallFormat(prompt_format="markdown")
    assert CONFIGURATIONS[25] == CallFormat(prompt_style="experimental")
    for n, c in enumerate(CONFIGURATIONS, 1):
        assert CallFormat.parse(str(n)) == c == CallFormat.parse(c.config_string)
    with pytest.raises(ValueError):
        CallFormat.parse("27")
    with pytest.raises(ValueError):
        CallFormat.parse("ret_fmt=yaml&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic")


FACTORIAL = [
    {
        "name": "math.factorial",
        "description": "Calculate the factorial of a given number.",
        "parameters": {
            "type": "dict",
            "properties": {
                "number": {"type": "integer", "description": "The number for which factorial needs to be calculated."}
            },
            "required": ["number"],
        },
    }
]


def test_prompt_layouts_and_doc_formats_follow_seed_002() -> None:
    plain = CallFormat("verbose_xml", True, "xml").system_prompt(FACTORIAL)
    assert plain.startswith("You are an expert in composing functions.You are given a question")  # no separator
    assert 'you MUST put it in the format of <TOOLCALL><functions><function name="func_name1">' in plain
    assert "must be one of: string, integer, float, boolean, array, dict, or tuple." in plain
    assert (
        '<function name="math.factorial">\n  <desc>Calculate the factorial of a given number.</desc>\n'
        '  <params>\n    <param name="number" type="integer" required="true">\n'
    ) in plain
    py = CallFormat("python", False, "python").system_prompt(FACTORIAL)
    assert "format of [func_name1(params_name1=params_value1" in py and "<TOOLCALL>" not in py
    assert '# Function: math.factorial\n    """\n    Calculate the factorial' in py
    assert "        number (int): The number for which factorial needs to be calculated.\n" in py
    assert (
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)].  You SHOULD" in py
    )
    md = CallFormat(prompt_format="markdown").system_prompt(FACTORIAL)
    assert md.startswith("You are an expert in composing functions.\n\n## Task\nYou are given")
    for section in (
        "## Tool Call Format\n",
        "## Multi-turn Behavior\n",
        "## Available Tools\nHere is a list of "
        'functions in json format that you can invoke.\n[\n    {\n        "name": "math.factorial"',
    ):
        assert section in md
    exp = CallFormat(prompt_style="experimental").system_prompt(FACTORIAL)
    assert exp.startswith("You are an expert in generating structured function calls.")
    assert "Below is a list of callable functions in the json style:\n" in exp


# --- the perturber in-process ---------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "math_factorial",
            "description": "Factorial of a number.",
            "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    },
]


@dataclass
class FakeCase:
    """What the perturber reads of a corpus case: its function docs (with the dotted names)."""

    functions: list[dict[str, Any]]


def context(case: Any = None, seed: int = 7) -> PerturbContext:
    return PerturbContext(perturbation_seed=seed, rng=random.Random(seed), services=Services(), case=case)


def completion(text: str | None, **message: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text, **message}, "finish_reason": "stop"}
        ],
    }


def test_upstream_gets_no_tools_and_the_docs_in_a_system_prompt_before_the_clients_own() -> None:
    p = build("format_rewrite", {"return_format": "json", "function_doc_format": "python", "tool_call_tag": True})
    req = ChatRequest(
        {
            "model": "m",
            "tools": TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "5!?"}],
        }
    )
    ctx = context(FakeCase([{"name": "math.factorial"}]))
    sent = p.apply(req, ctx).body
    assert "tools" not in sent and "tool_choice" not in sent and "parallel_tool_calls" not in sent
    assert req.body["tools"] == TOOLS  # the client's request is not mutated
    system = sent["messages"][0]
    assert system["role"] == "system" and system["content"].endswith("\n\nBe brief.")
    assert "# Function: math.factorial" in system["content"]  # the model sees the dotted name
    assert "# Function: get_weather" in system["content"]
    assert sent["messages"][1:] == [{"role": "user", "content": "5!?"}]
    assert ctx.report["config"] == (
        "ret_fmt=json&tool_call_tag=True&func_doc_fmt=python&prompt_fmt=plaintext&style=classic"
    )


def test_history_calls_and_tool_results_are_rendered_as_text_in_the_chosen_format() -> None:
    p = build("format_rewrite", {"return_format": "verbose_xml"})
    messages = [
        {"role": "user", "content": "5! and the weather in Paris"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "math_factorial", "arguments": '{"number": 5}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "120"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "user", "content": "thanks"},
    ]
    sent = p.apply(
        ChatRequest({"model": "m", "tools": TOOLS, "messages": messages}),
        context(FakeCase([{"name": "math.factorial"}])),
    ).body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "user"]
    assistant = sent[2]
    assert "tool_calls" not in assistant
    assert assistant["content"] == render_calls(
        [
            {"name": "math.factorial", "arguments": {"number": 5}},
            {"name": "get_weather", "arguments": {"city": "Paris"}},
        ],
        "verbose_xml",
    )
    assert parse_strict(assistant["content"], "verbose_xml").calls[0] == {
        "name": "math.factorial",
        "arguments": {"number": 5},
    }
    assert sent[3]["content"] == repr(
        [
            {"role": "tool", "name": "math.factorial(number=5)", "content": "120"},
            {"role": "tool", "name": "get_weather(city='Paris')", "content": "sunny"},
        ]
    )


def test_restore_turns_decoded_text_into_tool_calls_with_the_clients_names() -> None:
    p = build("format_rewrite", {})
    ctx = context(FakeCase([{"name": "math.factorial"}]))
    p.apply(ChatRequest({"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": "x"}]}), ctx)
    text = "[math.factorial(number=5), get_weather(city='Paris', days=2)]"
    out = p.restore(completion(text), ctx)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["math_factorial", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"number": 5}, {"city": "Paris", "days": 2}]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert ctx.report["decode"]["strict"] == {"ok": True, "calls": 2}
    assert ctx.report["decode"]["used"] == "strict" and ctx.report["decode"]["wrong_syntax"] is False
    # deterministic: the same request and answer give the same ids
    ctx2 = context(FakeCase([{"name": "math.factorial"}]))
    p.apply(ChatRequest({"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": "x"}]}), ctx2)
    assert [c["id"] for c in p.restore(completion(text), ctx2)["choices"][0]["message"]["tool_calls"]] == [
        c["id"] for c in calls
    ]


def test_undecodable_text_reaches_the_client_as_content_and_counts_as_wrong_syntax() -> None:
    p = build("format_rewrite", {"parse": "lenient"})
    ctx = context()
    p.apply(ChatRequest({"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": "hi"}]}), ctx)
    out = p.restore(completion("I cannot help with that."), ctx)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "I cannot help with that."}
    assert out["choices"][0]["finish_reason"] == "stop"
    decode = ctx.report["decode"]
    assert decode["wrong_syntax"] is True and decode["used"] == "text"
    assert decode["strict"]["error"] == "decoder_failed" and decode["lenient"]["ok"] is False


def test_lenient_parse_gives_the_client_the_recovered_calls_and_reports_the_leniency() -> None:
    text = "```python\n[get_weather(city='Oslo')]\n```"
    for mode, expect_calls in (("strict", False), ("lenient", True)):
        p = build("format_rewrite", {"parse": mode})
        ctx = context()
        p.apply(ChatRequest({"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": "w"}]}), ctx)
        message = p.restore(completion(text), ctx)["choices"][0]["message"]
        assert bool(message.get("tool_calls")) is expect_calls
        assert ctx.report["decode"]["lenient"]["leniencies"] == ["code_fence"]
        assert ctx.report["decode"]["wrong_syntax"] is True


def test_nothing_changes_without_tools_or_with_tool_choice_none() -> None:
    p = build("format_rewrite", {})
    plain = ChatRequest({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ctx = context()
    assert p.apply(plain, ctx) is plain and ctx.report["skipped"]
    assert p.restore(completion("[f(a=1)]"), ctx) == completion("[f(a=1)]")
    none = ChatRequest({"model": "m", "tools": TOOLS, "tool_choice": "none", "messages": []})
    assert p.apply(none, context()) is none


@pytest.mark.parametrize(
    "params",
    [
        {"return_format": "yaml"},
        {"function_doc_format": "md"},
        {"parse": "loose"},
        {"prompt_format": "html"},
        {"prompt_style": "casual"},
        {"tag": True},
    ],
)
def test_bad_parameters_are_rejected(params: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        build("format_rewrite", params)


# --- toolquake formats ----------------------------------------------------------------------------


def toolquake(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolquake", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60
    )


def test_formats_lists_the_26_configurations() -> None:
    out = toolquake("formats", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["number"] for r in rows] == list(range(1, 27))
    assert [r["config"] for r in rows] == [c.config_string for c in CONFIGURATIONS]
    table = toolquake("formats")
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 27


def test_formats_renders_a_configuration_for_a_request() -> None:
    body = json.dumps({"model": "m", "tools": TOOLS, "messages": [{"role": "user", "content": "5!"}]})
    out = toolquake("formats", "--request", "-", "--config", "20", "--show", "body", stdin=body)
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout)
    assert "tools" not in sent and sent["messages"][1] == {"role": "user", "content": "5!"}
    assert sent["messages"][0]["content"] == CONFIGURATIONS[19].system_prompt(
        [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "parameters": {**t["function"]["parameters"], "type": "dict"},
            }
            for t in TOOLS
        ]
    )
    text = toolquake("formats", "--request", "-", "--config", CONFIGURATIONS[24].config_string, stdin=body)
    assert text.returncode == 0 and "## Tool Call Format" in text.stdout and "=== user ===\n5!" in text.stdout
    bad = toolquake("formats", "--request", "-", "--config", "27", stdin=body)
    assert bad.returncode != 0 and "1…26" in bad.stderr


@pytest.mark.needs_corpus
def test_formats_renders_a_configuration_for_a_bfcl_case() -> None:
    out = toolquake("formats", "--case", "simple_python_0", "--config", "1")
    assert out.returncode == 0, out.stderr
    assert "# Function: calculate_triangle_area" in out.stdout and "<TOOLCALL>[func_name1(" in out.stdout
    assert "Find the area of a triangle" in out.stdout


# --- any calls round-trip (property) --------------------------------------------------------------

_xml_char = st.characters(blacklist_categories=("Cs", "Cc"), whitelist_characters="\n\t\r")
_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(_xml_char, max_size=20)
)
_value = st.recursive(
    _scalar,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(_xml_char, max_size=6), c, max_size=3),
    max_leaves=8,
)
_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(lambda n: not keyword.iskeyword(n))
_call = st.fixed_dictionaries(
    {
        "name": st.lists(_ident, min_size=1, max_size=3).map(".".join),
        "arguments": st.dictionaries(_ident, _value, max_size=4),
    }
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    calls=st.lists(_call, min_size=1, max_size=3),
    fmt=st.sampled_from(["python", "json", "verbose_xml", "concise_xml"]),
    tag=st.booleans(),
)
def test_any_calls_written_in_a_format_parse_back_to_the_same_calls(calls, fmt, tag) -> None:
    text = render_calls(calls, fmt, tag)
    strip = fmt == "concise_xml"  # BFCL strips the text of concise params
    want = [
        {
            "name": c["name"],
            "arguments": {k: v.strip() if strip and isinstance(v, str) else v for k, v in c["arguments"].items()},
        }
        for c in calls
    ]
    lenient = parse_lenient(text, fmt, tag)
    assert lenient.ok and _typed(lenient.calls) == _typed(want), text
    strict = parse_strict(text, fmt, tag)
    json_cut = False
    if fmt == "json":  # BFCL's regex ends at the first `}]`: inside an argument it cuts the list (no calls)
        array = text[text.index("[{") : text.rindex("]") + 1]
        json_cut = re.search(r"}\s*]", array).end() != len(array)
    assert strict.ok and _typed(strict.calls) == ("[]" if json_cut else _typed(want)), text
