"""format_choice: the tools rendered in a chosen one of BFCL V4's 26 call formats, for a model served without
native tools (e.g. the configuration `@seed002` found best for it).

`config` names the configuration as BFCL does (`ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&
prompt_fmt=plaintext&style=classic`), by its number 1…26 in BFCL's order, or by the id of its `@seed002` arm
(`fmt-06-python-notag-json`); it is checked when the profile loads. Everything else is `format_rewrite`'s: the
function docs and call instructions go into the system prompt, the upstream gets no `tools`, the answer's text is
parsed back into `tool_calls` (`parse`: strict, lenient or live), and grading reads its decodes (`answer_decodes`).
Reported: what `format_rewrite` reports, `config` always BFCL's configuration string.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from toolquake.perturbers.format_rewrite import FormatRewrite
from toolquake.perturbers.helpers.callformats import CONFIGURATIONS, PARSE_MODES, CallFormat
from toolquake.remedies import register
from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy

_SHORT = {"python": "python", "json": "json", "verbose_xml": "vxml", "concise_xml": "cxml"}


def arm_id(number: int, fmt: CallFormat) -> str:
    """The `@seed002` arm of configuration `number` (1…26): fmt-NN-<return>-<tag|notag>-<docs>[-md|-exp]."""
    extra = "-md" if fmt.prompt_format == "markdown" else "-exp" if fmt.prompt_style == "experimental" else ""
    tag = "tag" if fmt.tool_call_tag else "notag"
    return f"fmt-{number:02d}-{_SHORT[fmt.return_format]}-{tag}-{fmt.function_doc_format}{extra}"


ARM_IDS = {arm_id(n, fmt): fmt for n, fmt in enumerate(CONFIGURATIONS, 1)}


def resolve(config: str) -> CallFormat:
    """The configuration `config` names (an `@seed002` arm id, a number, or BFCL's string); ValueError otherwise."""
    text = config.strip()
    if text in ARM_IDS:
        return ARM_IDS[text]
    fmt = CallFormat.parse(text)
    if fmt not in CONFIGURATIONS:
        raise ValueError(f"{config!r} is not one of the 26 BFCL V4 format configurations")
    return fmt


@functools.cache
def _rewriter(config: str, parse: str) -> FormatRewrite:
    """format_rewrite for one configuration (at most 26 × 3 of them: a cache without a bound holds them all)."""
    fmt = resolve(config)
    return FormatRewrite(return_format=fmt.return_format, function_doc_format=fmt.function_doc_format,
                         tool_call_tag=fmt.tool_call_tag, prompt_format=fmt.prompt_format,
                         prompt_style=fmt.prompt_style, parse=parse)


@register
class FormatChoice(Remedy):
    """Tools moved into the system prompt in the chosen configuration; the answer's text parsed back into calls."""

    name = "format_choice"
    rewrites_response: ClassVar[bool] = True
    streams_text: ClassVar[bool] = True
    #: one of the 26 configurations: BFCL's string, its number 1…26, or its `@seed002` arm id
    config: str
    #: how the answer is read back: "strict" (BFCL's decoder), "lenient", or "live" (see format_rewrite)
    parse: str = "strict"

    def __post_init__(self) -> None:
        if self.parse not in PARSE_MODES:
            raise ValueError(f"parse must be one of {', '.join(PARSE_MODES)} (got {self.parse!r})")
        resolve(self.config)

    def _rewrite(self) -> FormatRewrite:
        return _rewriter(self.config, self.parse)

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        rewrite = self._rewrite()
        ctx.report["config"] = rewrite.call_format.config_string
        if not all(isinstance(request.body.get(key) or [], list) for key in ("messages", "tools")):
            ctx.report["skipped"] = "messages or tools not a list"  # the upstream answers such a request itself
            return request
        return rewrite.apply(request, ctx)

    def restore(self, response: dict[str, Any], ctx: PerturbContext) -> dict[str, Any]:
        return self._rewrite().restore(response, ctx)

    def stream_release(self, text: str, ctx: PerturbContext) -> int:
        return self._rewrite().stream_release(text, ctx)

    def answer_decodes(self, ctx: PerturbContext) -> tuple[Any, Any] | None:
        return self._rewrite().answer_decodes(ctx)
