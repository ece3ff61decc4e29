"""format_rewrite for live agent traffic: tool_choice / parallel_tool_calls in the prompt, and parse = "live"."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.support import Proc, recorded
from toolquake.bfcl.convert import from_openai_tools
from toolquake.perturbers import ChatRequest, PerturbContext, Services, build
from toolquake.perturbers.helpers.callformat_parse import parse_lenient, parse_strict
from toolquake.perturbers.helpers.callformat_render import render_calls
from toolquake.perturbers.helpers.callformats import CONFIGURATIONS, CallFormat

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "City name."},
                                          "days": {"type": "integer", "description": "Days ahead."},
                                          "unit": {"type": "string", "enum": ["C", "F"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]

# sha256 over the 26 system prompts (one per configuration, "\0" after each) that format_rewrite rendered for
# TOOLS before tool_choice / parallel_tool_calls were honoured (commit 89bde7a): auto must keep them exact
PROMPTS_BEFORE = "e479e983a0f296d91dc0863999377e383dc0124252293937c49f8bb33226406c"

REQUIRED = "You MUST answer with at least one function call, in the format above. Do not answer in plain text."
REQUIRED_ONE = "You MUST answer with exactly one function call, in the format above. Do not answer in plain text."
AT_MOST_ONE = "If you call a function, make at most one function call in your response."


def named(name: str, once: bool = False) -> str:
    if once:
        return (f"You MUST call the function {name} exactly once, in the format above, and no other function. "
                "Do not answer in plain text.")
    return (f"You MUST call the function {name}, in the format above, and no other function. "
            "Do not answer in plain text.")


def force(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@dataclass
class FakeCase:
    functions: list[dict[str, Any]]


def context(case: Any = None) -> PerturbContext:
    return PerturbContext(perturbation_seed=1, rng=random.Random(1), services=Services(), case=case)


def params_of(cfg: CallFormat, **extra: Any) -> dict[str, Any]:
    return {"return_format": cfg.return_format, "tool_call_tag": cfg.tool_call_tag,
            "function_doc_format": cfg.function_doc_format, "prompt_format": cfg.prompt_format,
            "prompt_style": cfg.prompt_style, **extra}


def rendered(params: dict[str, Any], tools: list[dict[str, Any]] = TOOLS, case: Any = None,
             **body: Any) -> tuple[dict[str, Any], PerturbContext]:
    """The request body format_rewrite sends upstream, and its context."""
    ctx = context(case)
    sent = build("format_rewrite", params).apply(ChatRequest({"model": "m", "tools": tools, "messages": USER, **body}),
                                                 ctx).body
    return sent, ctx


def system_of(params: dict[str, Any], **body: Any) -> str:
    sent, _ = rendered(params, **body)
    assert sent["messages"][0]["role"] == "system"
    assert "tools" not in sent and "tool_choice" not in sent and "parallel_tool_calls" not in sent
    return sent["messages"][0]["content"]


def completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def restored(text: str, params: dict[str, Any] | None = None, tools: list[dict[str, Any]] = TOOLS, case: Any = None,
             **body: Any) -> tuple[dict[str, Any], PerturbContext, Any]:
    """(the first choice the client gets, the context, the perturber) for an upstream answer `text`."""
    p = build("format_rewrite", {"parse": "live", **(params or {})})
    ctx = context(case)
    p.apply(ChatRequest({"model": "m", "tools": tools, "messages": USER, **body}), ctx)
    return p.restore(completion(text), ctx)["choices"][0], ctx, p


def client_calls(choice: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(tc["function"]["name"], json.loads(tc["function"]["arguments"]))
            for tc in choice["message"].get("tool_calls") or []]


# --- tool_choice and parallel_tool_calls in the rendered instructions -----------------------------

def test_auto_or_absent_tool_choice_keeps_all_26_prompts_byte_identical_to_before() -> None:
    digest = hashlib.sha256()
    for cfg in CONFIGURATIONS:
        params = params_of(cfg)
        base = system_of(params)
        for body in ({"tool_choice": "auto"}, {"parallel_tool_calls": True},
                     {"tool_choice": "auto", "parallel_tool_calls": True}):
            assert system_of(params, **body) == base, (cfg.config_string, body)
        assert base == cfg.system_prompt(from_openai_tools(TOOLS))
        digest.update(base.encode() + b"\0")
        _, ctx = rendered(params, tool_choice="auto", parallel_tool_calls=True)
        assert not {"tool_choice", "parallel_tool_calls", "tool_choice_dropped"} & set(ctx.report)
    assert digest.hexdigest() == PROMPTS_BEFORE


@pytest.mark.parametrize("body,rule,report", [
    ({"tool_choice": "required"}, REQUIRED, {"tool_choice": "required"}),
    ({"tool_choice": force("get_time")}, named("get_time"), {"tool_choice": force("get_time")}),
    ({"parallel_tool_calls": False}, AT_MOST_ONE, {"parallel_tool_calls": False}),
    ({"tool_choice": "required", "parallel_tool_calls": False}, REQUIRED_ONE,
     {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"tool_choice": force("get_weather"), "parallel_tool_calls": False}, named("get_weather", once=True),
     {"tool_choice": force("get_weather"), "parallel_tool_calls": False}),
])
def test_each_tool_choice_mode_adds_its_sentence_after_the_call_instructions_in_every_configuration(
        body: dict[str, Any], rule: str, report: dict[str, Any]) -> None:
    for cfg in CONFIGURATIONS:
        params = params_of(cfg)
        base, changed = system_of(params), system_of(params, **body)
        assert changed.count(rule) == 1, cfg.config_string
        # the rule is one paragraph of its own, right after the tool-call instructions; the rest is BFCL's prompt
        assert changed.replace("\n\n" + rule, "", 1) == base
        before, after = changed.split(rule)
        assert before.endswith("in the response.\n\n") or before.endswith("other text.\n\n")
        assert after.startswith("\n\n## Multi-turn Behavior\n" if cfg.prompt_format == "markdown" else "\n\nAt ")
        _, ctx = rendered(params, **body)
        assert {k: ctx.report[k] for k in report} == report and "tool_choice_dropped" not in ctx.report


def test_a_named_function_is_shown_under_the_name_the_model_sees() -> None:
    tools = TOOLS + [{"type": "function", "function": {"name": "math_factorial", "parameters": {
        "type": "object", "properties": {"number": {"type": "integer"}}}}}]
    sent, ctx = rendered({}, tools, FakeCase([{"name": "math.factorial"}]), tool_choice=force("math_factorial"))
    assert named("math.factorial") in sent["messages"][0]["content"]
    assert ctx.report["tool_choice"] == force("math_factorial")


@pytest.mark.parametrize("choice", [force("send_email"), {"type": "allowed_tools", "allowed_tools": {
    "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}])
def test_a_tool_choice_that_cannot_be_honoured_is_reported_dropped_and_the_prompt_stays_bfcls(choice: Any) -> None:
    assert system_of({}, tool_choice=choice) == system_of({})
    _, ctx = rendered({}, tool_choice=choice)
    assert ctx.report["tool_choice_dropped"] == choice and "tool_choice" not in ctx.report


def test_tool_choice_none_still_skips_the_step() -> None:
    request = ChatRequest({"model": "m", "tools": TOOLS, "tool_choice": "none", "messages": USER})
    ctx = context()
    assert build("format_rewrite", {"parse": "live"}).apply(request, ctx) is request
    assert ctx.report["skipped"] == "tool_choice is none"


# --- parse = "live" -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,calls", [
    ("[get_weather('Paris')]", [("get_weather", {"city": "Paris"})]),
    ("Sure: [get_weather(city='Paris')]", [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n```python\nget_weather(city='Paris', days=2)\n```\nDone.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("I'll look both up: [get_weather('Oslo', 3), get_time(city='Tokyo')] and then answer.",
     [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {"city": "Tokyo"})]),
    ("<think>maybe get_time('Lima')</think>\nget_weather('Rome', unit='F')",
     [("get_weather", {"city": "Rome", "unit": "F"})]),
])
def test_live_gives_the_client_every_offered_call_in_the_answer(text: str, calls: list[Any]) -> None:
    choice, ctx, _ = restored(text)
    assert client_calls(choice) == calls
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert ctx.report["decode"]["used"] == "live" and ctx.report["decode"]["live"]["calls"] == len(calls)


def test_live_reports_what_it_did_beyond_bfcls_decoder() -> None:
    _, ctx, _ = restored("[get_weather('Paris')]")
    assert ctx.report["decode"]["live"]["leniencies"] == ["positional_args"]
    _, ctx, _ = restored("Sure: [get_weather(city='Paris')]")
    assert ctx.report["decode"]["live"]["leniencies"] == ["outside_format"]
    assert ctx.report["decode"]["wrong_syntax"] is True and ctx.report["decode"]["lenient"]["ok"] is False


def test_a_call_to_a_function_the_client_did_not_offer_stays_text() -> None:
    choice, ctx, _ = restored("[print('hi')]")
    assert choice["message"] == {"role": "assistant", "content": "[print('hi')]"}
    assert choice["finish_reason"] == "stop"
    assert ctx.report["decode"]["used"] == "text"
    assert ctx.report["decode"]["live"]["leniencies"] == ["unoffered_function"]
    # BFCL's decoder does decode it (a call to print): that verdict is untouched
    assert ctx.report["decode"]["strict"] == {"ok": True, "calls": 1}
    # next to an offered call, only the offered one reaches the client
    choice, _, _ = restored("[print('hi'), get_time(city='Lima')]")
    assert client_calls(choice) == [("get_time", {"city": "Lima"})]


def test_prose_without_a_call_stays_text() -> None:
    choice, ctx, _ = restored("Which city do you mean? I could call get_weather once I know.")
    assert choice["message"]["content"].startswith("Which city") and "tool_calls" not in choice["message"]
    assert ctx.report["decode"]["live"]["ok"] is False and ctx.report["decode"]["used"] == "text"


def test_positional_arguments_follow_the_schemas_parameter_order_not_the_required_list() -> None:
    tools = [{"type": "function", "function": {"name": "convert", "parameters": {"type": "object", "properties": {
        "unit": {"type": "string"}, "amount": {"type": "number"}, "to": {"type": "string"}},
        "required": ["amount", "to", "unit"]}}}]
    choice, _, _ = restored("[convert('kg', 2.5, 'lb')]", tools=tools)
    assert client_calls(choice) == [("convert", {"unit": "kg", "amount": 2.5, "to": "lb"})]
    choice, _, _ = restored("[convert('kg', to='lb')]", tools=tools)
    assert client_calls(choice) == [("convert", {"unit": "kg", "to": "lb"})]
    # more positional values than parameters, or one given twice: not a call the client can run
    for text in ("[convert('kg', 2.5, 'lb', 1)]", "[convert('kg', unit='lb')]"):
        choice, ctx, _ = restored(text, tools=tools)
        assert "tool_calls" not in choice["message"] and ctx.report["decode"]["live"]["leniencies"] == ["unfit_call"]


def test_a_positional_value_may_fill_a_parameter_named_like_a_python_keyword() -> None:
    tools = [{"type": "function", "function": {"name": "route", "parameters": {"type": "object", "properties": {
        "from": {"type": "string"}, "to": {"type": "string"}}}}}]
    choice, _, _ = restored("[route('Paris', to='Lyon')]", tools=tools)
    assert client_calls(choice) == [("route", {"from": "Paris", "to": "Lyon"})]


@pytest.mark.parametrize("fmt,text", [("json", "[" * 50_000 + "]" * 50_000),
                                      ("python", "get_weather(" + "[" * 5_000 + "]" * 5_000 + ")"),
                                      ("python", "get_weather('Paris" * 20_000)])
def test_degenerate_answers_stay_text_without_raising(fmt: str, text: str) -> None:
    choice, ctx, _ = restored(text, {"return_format": fmt})
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"
    assert ctx.report["decode"]["used"] == "text"


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    text = "[get_weather(city='Oslo'), get_time(city='Tokyo')]"
    choice, ctx, _ = restored(text, parallel_tool_calls=False)
    assert client_calls(choice) == [("get_weather", {"city": "Oslo"})]
    assert ctx.report["decode"]["live"]["leniencies"] == ["first_call_only"]
    assert ctx.report["decode"]["strict"]["calls"] == 2  # BFCL's view keeps both
    choice, _, _ = restored(text)
    assert len(client_calls(choice)) == 2


def test_live_json_finds_call_objects_in_prose_and_fences() -> None:
    text = ('Checking the forecast.\n```json\n[{"function": "get_weather", "parameters": {"city": "Paris", "days": 2}},'
            ' {"function": "print", "parameters": {"x": 1}}]\n```\nand {"name": "get_time", "arguments": "{\\"city\\": '
            '\\"Tokyo\\"}"}')
    choice, ctx, _ = restored(text, {"return_format": "json"})
    assert client_calls(choice) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"city": "Tokyo"})]
    assert ctx.report["decode"]["used"] == "live"


def test_live_xml_ignores_a_missing_toolcall_tag_and_unoffered_functions() -> None:
    text = ('Here you go: <functions><function name="get_weather"><params><param name="city" value="Paris" '
            'type="string"/><param name="days" value="2" type="int"/></params></function><function name="rm">'
            '<params/></function></functions>')
    choice, ctx, _ = restored(text, {"return_format": "verbose_xml", "tool_call_tag": True})
    assert client_calls(choice) == [("get_weather", {"city": "Paris", "days": 2})]
    assert ctx.report["decode"]["strict"]["ok"] is False  # BFCL: no <TOOLCALL> block


def test_live_accepts_the_name_shown_to_the_model_and_the_clients_own() -> None:
    tools = [{"type": "function", "function": {"name": "math_factorial", "parameters": {
        "type": "object", "properties": {"number": {"type": "integer"}}}}}]
    for text in ("[math.factorial(5)]", "[math_factorial(5)]"):
        choice, _, _ = restored(text, tools=tools, case=FakeCase([{"name": "math.factorial"}]))
        assert client_calls(choice) == [("math_factorial", {"number": 5})], text


@pytest.mark.parametrize("fmt", ["python", "json", "verbose_xml", "concise_xml"])
@pytest.mark.parametrize("tag", [False, True])
def test_strict_decode_stays_bfcls_and_live_agrees_on_answers_bfcl_accepts(fmt: str, tag: bool) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
             {"name": "get_time", "arguments": {"city": "Tokyo"}}]
    text = render_calls(calls, fmt, tag)
    choice, ctx, p = restored(text, {"return_format": fmt, "tool_call_tag": tag})
    strict, lenient = p.answer_decodes(ctx)
    assert strict == parse_strict(text, fmt, tag) and strict.ok and strict.calls == calls
    assert lenient == parse_lenient(text, fmt, tag)
    assert client_calls(choice) == [(c["name"], c["arguments"]) for c in calls]
    assert ctx.state["decoded"][0]["strict"] is strict and ctx.state["decoded"][0]["live"].calls == calls


def test_grading_gets_bfcls_decode_even_where_live_names_positional_values() -> None:
    choice, ctx, p = restored("[get_weather('Paris')]")
    strict, lenient = p.answer_decodes(ctx)
    assert client_calls(choice) == [("get_weather", {"city": "Paris"})]
    # BFCL drops positional arguments: the strict verdict is a call with no arguments, as BFCL scores it
    assert strict == parse_strict("[get_weather('Paris')]", "python")
    assert strict.calls == [{"name": "get_weather", "arguments": {}}] and lenient == strict


def test_live_is_a_parse_mode_and_unknown_modes_are_rejected() -> None:
    assert build("format_rewrite", {"parse": "live"}).parse == "live"
    with pytest.raises(ValueError, match="strict, lenient, live"):
        build("format_rewrite", {"parse": "loose"})


# --- through the proxy --------------------------------------------------------------------------

CONFIG = """
[profiles.fmt-live]
mode = "perturb"
perturbers = [{ name = "format_rewrite", params = { parse = "live" } }]
"""


@pytest.fixture(scope="module")
def live_proxy(fake_upstream: Proc) -> Proc:
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, CONFIG)
    yield proc
    proc.stop()


def sdk(proxy: Proc, answer: str, tag: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/p/fmt-live/v1", api_key="k", default_headers={
        "X-Fake-Answer": json.dumps({"text": answer}), "X-Test-Tag": tag})


def upstream_body(fake: Proc, tag: str) -> dict[str, Any]:
    (req,) = [r for r in recorded(fake, tag) if r["method"] == "POST"]
    return json.loads(req["body"])


def test_sdk_gets_live_decoded_calls_and_the_upstream_is_told_the_tool_choice(live_proxy, fake_upstream) -> None:
    tag = uuid.uuid4().hex
    answer = "Sure! [get_weather('Paris', 3), get_time(city='Tokyo')]"
    resp = sdk(live_proxy, answer, tag).chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    sent = upstream_body(fake_upstream, tag)
    assert "tools" not in sent and "tool_choice" not in sent and "parallel_tool_calls" not in sent
    assert REQUIRED_ONE in sent["messages"][0]["content"]


def test_sdk_gets_text_when_the_answer_calls_nothing_it_offered(live_proxy, fake_upstream) -> None:
    tag = uuid.uuid4().hex
    resp = sdk(live_proxy, "[print('hi')]", tag).chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, tool_choice=force("get_time"))
    choice = resp.choices[0]
    assert choice.message.content == "[print('hi')]" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert named("get_time") in upstream_body(fake_upstream, tag)["messages"][0]["content"]


def test_streaming_sdk_gets_the_live_call_as_tool_call_deltas(live_proxy) -> None:
    stream = sdk(live_proxy, "Sure: [get_weather('Paris')]", uuid.uuid4().hex).chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    # the prose before the call streams through as it arrives; the call comes as tool_call deltas
    assert (content, finish) == ("Sure: ", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
