"""Call formats of BFCL V4's format-sensitivity study: the 26 configurations and their system prompts.

A configuration is five choices: the return format the model must write calls in (python, json,
verbose_xml, concise_xml), whether calls go inside `<TOOLCALL>…</TOOLCALL>`, the format of the
function docs (python, xml, json), the prompt layout (plaintext, markdown) and its wording (classic,
experimental). The prompt components are the ones BFCL V4 publishes as its method (the wording of
the bfcl-eval 2026.3.23 release). Call rendering lives in `callformat_render`, parsing in
`callformat_parse`, doc rendering in `callformat_docs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from toolquake.perturbers.helpers.callformat_docs import DOC_FORMATS, render_docs

RETURN_FORMATS = ("python", "json", "verbose_xml", "concise_xml")
PROMPT_FORMATS = ("plaintext", "markdown")
PROMPT_STYLES = ("classic", "experimental")
PARSE_MODES = ("strict", "lenient", "live")

# what the model is told to write, per return format
OUTPUT_FORMATS = {
    "python": "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
    "json": '```json\n[{"function":"func_name1","parameters":{"param1":"value1","param2":"value2"...}},'
            '{"function":"func_name2","parameters":{"param":"value"}}]\n```',
    "verbose_xml": '<functions><function name="func_name1"><params><param name="param1" value="value1" '
                   'type="type1"/><param name="param2" value="value2" type="type2"/>...</params></function>'
                   '<function name="func_name2"><params><param name="param3" value="value3" type="type3"/>'
                   '</params></function></functions>',
    "concise_xml": '<functions><function name="func_name1"><param name="param1" type="type1">value1</param>'
                   '<param name="param2" type="type2">value2</param>...</function><function name="func_name2">'
                   '<param name="param3" type="type3">value</param></function></functions>',
}
_XML_TYPES = ("The type fields of the parameters in your function calls must be one of: string, integer, float, "
              "boolean, array, dict, or tuple.")
PARAM_TYPE_SENTENCES = {"python": "", "json": "", "verbose_xml": _XML_TYPES, "concise_xml": _XML_TYPES}

STYLES: dict[str, dict[str, str]] = {
    "classic": {
        "persona": "You are an expert in composing functions.",
        "task": "You are given a question and a set of possible functions. Based on the question, you will need to "
                "make one or more function/tool calls to achieve the purpose. If none of the functions can be used, "
                "point it out. If the given question lacks the parameters required by the function, also point it "
                "out.",
        "tool_call_no_tag": "You should only return the function calls in your response.\n\nIf you decide to invoke "
                            "any of the function(s), you MUST put it in the format of {output_format}. {param_types} "
                            "You SHOULD NOT include any other text in the response.",
        "tool_call_with_tag": "You should only return the function calls in the <TOOLCALL> section. If you decide to "
                              "invoke any of the function(s), you MUST put it in the format of "
                              "<TOOLCALL>{output_format}</TOOLCALL>. {param_types} You SHOULD NOT include any other "
                              "text in the response.",
        "multiturn": "At each turn, you should try your best to complete the tasks requested by the user within the "
                     "current turn. Continue to output functions to call until you have fulfilled the user's request "
                     "to the best of your ability. Once you have no more functions to call, the system will consider "
                     "the current turn complete and proceed to the next turn or task.",
        "available_tools": "Here is a list of functions in {format} format that you can invoke.\n{functions}\n",
    },
    "experimental": {
        "persona": "You are an expert in generating structured function calls.",
        "task": "You are given a user query and a set of available functions. Your task is to produce one or more "
                "function/tool calls to fulfill the user's request. If no suitable function exists, or required "
                "parameters are missing, clearly indicate this.",
        "tool_call_no_tag": "Respond with only the function calls.\n\nYou MUST format it exactly as {output_format}. "
                            "{param_types} Do NOT include any other text.",
        "tool_call_with_tag": "Return only the function calls enclosed in <TOOLCALL> tags.\n\nYou MUST format it "
                              "exactly as <TOOLCALL>{output_format}</TOOLCALL>. {param_types} Do NOT include any "
                              "other text.",
        "multiturn": "At every turn, aim to complete the user's tasks within that turn. Continue emitting function "
                     "calls until the request is satisfied to the best of your ability. Once no more calls are "
                     "needed, the system will proceed to the next turn.",
        "available_tools": "Below is a list of callable functions in the {format} style:\n{functions}\n",
    },
}

_CONFIG_RE = re.compile(
    r"^ret_fmt=(python|json|verbose_xml|concise_xml)&tool_call_tag=(True|False)&func_doc_fmt=(python|xml|json)"
    r"&prompt_fmt=(plaintext|markdown)&style=(classic|experimental)$")


@dataclass(frozen=True)
class CallFormat:
    """One prompt configuration: how functions are shown and how calls must be written."""

    return_format: str = "python"
    tool_call_tag: bool = False
    function_doc_format: str = "json"
    prompt_format: str = "plaintext"
    prompt_style: str = "classic"

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.return_format, RETURN_FORMATS, "return_format"),
                                     (self.function_doc_format, DOC_FORMATS, "function_doc_format"),
                                     (self.prompt_format, PROMPT_FORMATS, "prompt_format"),
                                     (self.prompt_style, PROMPT_STYLES, "prompt_style")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {', '.join(allowed)} (got {value!r})")

    @property
    def config_string(self) -> str:
        """BFCL's name for this configuration (`ret_fmt=…&tool_call_tag=…&…`)."""
        return (f"ret_fmt={self.return_format}&tool_call_tag={self.tool_call_tag}"
                f"&func_doc_fmt={self.function_doc_format}&prompt_fmt={self.prompt_format}&style={self.prompt_style}")

    @classmethod
    def parse(cls, text: str) -> CallFormat:
        """A configuration from BFCL's config string, or from its number 1…26 in BFCL's order."""
        text = text.strip()
        if text.isdigit():
            n = int(text)
            if not 1 <= n <= len(CONFIGURATIONS):
                raise ValueError(f"configuration number must be 1…{len(CONFIGURATIONS)}")
            return CONFIGURATIONS[n - 1]
        m = _CONFIG_RE.match(text)
        if not m:
            raise ValueError("a configuration is a number 1…26 or a string like "
                             "'ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic'")
        ret, tag, doc, layout, style = m.groups()
        return cls(ret, tag == "True", doc, layout, style)

    def system_prompt(self, functions: list[dict[str, Any]], rules: str = "") -> str:
        """The system prompt BFCL builds for these function docs in this configuration.

        `rules` (see `choice_rules`) is added as its own paragraph after the tool-call instructions;
        without it the prompt is BFCL's, byte for byte.
        """
        words = STYLES[self.prompt_style]
        template = words["tool_call_with_tag" if self.tool_call_tag else "tool_call_no_tag"]
        tool_call = template.format(output_format=OUTPUT_FORMATS[self.return_format],
                                    param_types=PARAM_TYPE_SENTENCES[self.return_format])
        if rules:
            tool_call = f"{tool_call}\n\n{rules}"
        tools = words["available_tools"].format(format=self.function_doc_format,
                                                functions=render_docs(functions, self.function_doc_format))
        if self.prompt_format == "markdown":
            return (f"{words['persona']}\n\n## Task\n{words['task']}\n\n## Tool Call Format\n{tool_call}\n\n"
                    f"## Multi-turn Behavior\n{words['multiturn']}\n\n## Available Tools\n{tools}")
        return f"{words['persona']}{words['task']}\n\n{tool_call}\n\n{words['multiturn']}\n\n{tools}"


def choice_rules(required: bool = False, function: str | None = None, single: bool = False) -> str:
    """What the client's `tool_choice` / `parallel_tool_calls` ask of the model, as prompt sentences.

    `required`: `tool_choice: "required"`; `function`: the name (as shown to the model) of a function
    `tool_choice` names; `single`: `parallel_tool_calls: false`. Empty when nothing is asked (`auto`).
    """
    if function is not None:
        if single:
            return (f"You MUST call the function {function} exactly once, in the format above, and no other "
                    "function. Do not answer in plain text.")
        return (f"You MUST call the function {function}, in the format above, and no other function. Do not "
                "answer in plain text.")
    if required:
        if single:
            return ("You MUST answer with exactly one function call, in the format above. Do not answer in plain "
                    "text.")
        return ("You MUST answer with at least one function call, in the format above. Do not answer in plain "
                "text.")
    if single:
        return "If you call a function, make at most one function call in your response."
    return ""


def _configurations() -> tuple[CallFormat, ...]:
    grid = [CallFormat(ret, tag, doc)
            for ret in RETURN_FORMATS for tag in (True, False) for doc in ("python", "xml", "json")]
    grid.append(CallFormat("python", False, "json", "markdown", "classic"))
    grid.append(CallFormat("python", False, "json", "plaintext", "experimental"))
    return tuple(grid)


#: the 26 configurations of BFCL V4 format sensitivity, in BFCL's order (#6 is BFCL's default prompt)
CONFIGURATIONS: tuple[CallFormat, ...] = _configurations()
DEFAULT = CallFormat()
