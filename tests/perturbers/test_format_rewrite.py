"""format_rewrite: prompts, history, parsing (seed 002 §5 failure examples) and restore, in-process."""

from __future__ import annotations

import json
import keyword
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import ROOT
from tests.support.callformats import EXTRA_EXAMPLES, SEED_EXAMPLES, Example
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.helpers.callformat_parse import parse_lenient, parse_strict
from toolquake.perturbers.helpers.callformat_render import render_calls
from toolquake.perturbers.helpers.callformats import CONFIGURATIONS, DEFAULT, CallFormat


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


@pytest.mark.processes
def test_formats_lists_the_26_configurations() -> None:
    out = toolquake("formats", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["number"] for r in rows] == list(range(1, 27))
    assert [r["config"] for r in rows] == [c.config_string for c in CONFIGURATIONS]
    table = toolquake("formats")
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 27


@pytest.mark.processes
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


@pytest.mark.processes
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
