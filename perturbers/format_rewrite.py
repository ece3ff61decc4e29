"""format_rewrite: takes the tools away and asks for calls as text in one of BFCL V4's 26 formats.

The upstream gets no `tools`/`tool_choice`: the function docs and the call-format instructions go
into the system prompt (kept before any system message the client sent), earlier assistant
`tool_calls` are shown as text in the chosen format and tool results as a user message, as BFCL
does for prompting models. What `tool_choice` (`required`, a named function) and
`parallel_tool_calls: false` ask for is added to the call instructions as sentences (nothing is added
for `auto`, so BFCL's prompts stay exact). On the way back the answer text is parsed (strict = BFCL's
decoder, lenient = also the documented near-misses, live = every call to an offered function found
anywhere in the answer, positional arguments named) into OpenAI `tool_calls`, so the agent keeps
working; text that does not decode reaches the client as content with finish_reason `stop`.

What restore found is reported in `ctx.report["decode"]` (filled in place after the answer came
back): `strict` and `lenient` verdicts (`ok`, `calls`, `error`, `leniencies`), which of them the
client got (`used`), and `wrong_syntax` (strict decoding failed); with `parse = "live"` also the
`live` verdict. The exact decoded calls (python values, dotted names) are in `ctx.state["decoded"]`;
`answer_decodes` hands the strict and lenient ones to grading (never the live one).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, ClassVar

from toolquake.perturbers import register
from toolquake.perturbers.base import ChatRequest, PerturbContext, Perturber
from toolquake.perturbers.helpers.callformat_parse import Decoded, Schemas, parse_both, parse_live
from toolquake.perturbers.helpers.callformat_render import python_call, render_calls, tool_results_text
from toolquake.perturbers.helpers.callformats import PARSE_MODES, CallFormat, choice_rules


def _text(content: Any) -> str:
    """A message's content as plain text (OpenAI content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def jsonable(value: Any) -> Any:
    """A decoded value as JSON can carry it: tuples as lists, keys as strings, odd scalars as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class _Names:
    """OpenAI tool names (what the client sent) ⇄ names shown to the model (the corpus's dotted names)."""

    def __init__(self, tool_names: list[str], case: Any) -> None:
        originals: dict[str, str] = {}
        for fn in getattr(case, "functions", None) or []:
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str):
                originals[name.replace(".", "_")] = name
        self.shown = {n: originals.get(n, n) for n in tool_names}
        self.sent = {shown: n for n, shown in self.shown.items()}

    def to_model(self, name: str) -> str:
        return self.shown.get(name, name)

    def to_client(self, name: Any) -> str:
        """The client's name for a name the model wrote (unknown names pass through as written)."""
        name = "" if name is None else str(name)
        return self.sent.get(name, name)

    def offered(self) -> dict[str, str]:
        """Every name the model may write for an offered function (shown or the client's) → the shown name."""
        return {**{n: shown for n, shown in self.shown.items()}, **{shown: shown for shown in self.sent}}


def _forced_name(choice: Any) -> str | None:
    """The function a `tool_choice` object names (`{"type": "function", "function": {"name": …}}`), if any."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    return name if isinstance(name, str) else None


@register
class FormatRewrite(Perturber):
    """Tools moved into the system prompt in one of BFCL V4's call formats; text answers parsed back."""

    name = "format_rewrite"
    experiment = "answer_format"
    axes = ("function_doc_format", "return_format", "tool_call_tag", "prompt_format", "prompt_style")
    rewrites_response: ClassVar[bool] = True
    streams_text: ClassVar[bool] = True

    return_format: str = "python"
    function_doc_format: str = "json"
    tool_call_tag: bool = False
    prompt_format: str = "plaintext"
    prompt_style: str = "classic"
    parse: str = "strict"

    def __post_init__(self) -> None:
        _ = self.call_format  # CallFormat validates the five format choices
        if self.parse not in PARSE_MODES:
            raise ValueError(f"parse must be one of {', '.join(PARSE_MODES)} (got {self.parse!r})")

    @property
    def call_format(self) -> CallFormat:
        return CallFormat(self.return_format, self.tool_call_tag, self.function_doc_format, self.prompt_format,
                          self.prompt_style)

    def stream_release(self, text: str, ctx: PerturbContext) -> int:
        """Text before anything that could open a call in this format (a list or object, a tag, a code fence,
        the name of an offered function) is released; a text ending in the start of such a marker keeps that
        end back until the next chunk says what it is."""
        if not ctx.state.get("active"):
            return len(text)
        markers = ["```", "<"] if self.tool_call_tag else ["```"]
        markers += {"python": ["["], "json": ["[", "{"]}.get(self.return_format, ["<"])
        names: _Names | None = ctx.state.get("names")
        if names is not None:
            markers += [shown.split(".")[-1] for shown in names.shown.values()]
        found = [i for i in (text.find(m) for m in markers if m) if i >= 0]
        if found:
            return min(found)
        held = max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        return len(text) - held

    def answer_decodes(self, ctx: PerturbContext) -> tuple[Any, Any] | None:
        """The (strict, lenient) decodes of the first choice's text, once `restore` parsed it."""
        for record in ctx.state.get("decoded") or []:
            if record.get("index", 0) == 0 and "strict" in record:
                return record["strict"], record.get("lenient", record["strict"])
        return None

    # --- request ----------------------------------------------------------------------------------

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        from toolquake.bfcl.convert import from_openai_tools

        tools = [t for t in request.tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                 and isinstance(t["function"].get("name"), str)]
        if not tools:
            ctx.report["skipped"] = "no tools in the request"
            return request
        if request.body.get("tool_choice") == "none":
            ctx.report["skipped"] = "tool_choice is none"
            return request
        fmt = self.call_format
        names = _Names([t["function"]["name"] for t in tools], ctx.case)
        docs = from_openai_tools(tools, names.shown)
        rules = self._choice_rules(request.body, names, ctx)
        system = fmt.system_prompt(docs, rules)
        messages = self._history(request.messages, system, names)
        schemas: Schemas = {}
        for doc in docs:
            params = doc.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            schemas[doc["name"]] = props if isinstance(props, dict) else {}
        ctx.state.update(active=True, names=names, schemas=schemas,
                         single=request.body.get("parallel_tool_calls") is False)
        ctx.report["config"] = fmt.config_string
        ctx.report["parse"] = self.parse
        ctx.report["prompt_chars"] = len(system)
        # filled in place by restore(): the pipeline's copy of this report shares the dict
        ctx.report["decode"] = {}
        return request.replace(messages=messages, tools=None, tool_choice=None, parallel_tool_calls=None)

    @staticmethod
    def _choice_rules(body: dict[str, Any], names: _Names, ctx: PerturbContext) -> str:
        """The prompt sentences for the request's `tool_choice` / `parallel_tool_calls`; reports what was honoured.

        `auto` (or none) and `parallel_tool_calls` true (or none) add nothing. A `tool_choice` that cannot
        be honoured (a function that is not offered, another kind of choice) is reported as dropped.
        """
        choice = body.get("tool_choice")
        single = body.get("parallel_tool_calls") is False
        forced = _forced_name(choice)
        required = choice == "required"
        if forced is not None and forced not in names.shown:
            ctx.report["tool_choice_dropped"] = choice
            forced = None
        elif forced is not None or required:
            ctx.report["tool_choice"] = choice
        elif choice not in (None, "auto"):
            ctx.report["tool_choice_dropped"] = choice
        if single:
            ctx.report["parallel_tool_calls"] = False
        return choice_rules(required, names.to_model(forced) if forced is not None else None, single)

    def _history(self, messages: list[dict[str, Any]], system: str, names: _Names) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        calls_by_id: dict[str, str] = {}
        pending: list[tuple[str, str]] = []

        def flush() -> None:
            if pending:
                out.append({"role": "user", "content": tool_results_text(pending)})
                pending.clear()

        for i, msg in enumerate(messages):
            role = msg.get("role") if isinstance(msg, dict) else None
            if role in ("tool", "function"):
                call_id = msg.get("tool_call_id")
                shown = calls_by_id.get(call_id) if isinstance(call_id, str) else None
                pending.append((shown or names.to_model(str(msg.get("name") or "")), _text(msg.get("content"))))
                continue
            flush()
            if i == 0 and role == "system":
                out.append({**msg, "content": system + "\n\n" + _text(msg.get("content"))})
                continue
            if role == "assistant" and msg.get("tool_calls"):
                calls = []
                for tc in msg["tool_calls"] if isinstance(msg["tool_calls"], list) else []:
                    if not isinstance(tc, dict):
                        continue
                    fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
                    call = {"name": names.to_model(str(fn.get("name") or "")),
                            "arguments": _arguments(fn.get("arguments"))}
                    calls.append(call)
                    if isinstance(tc.get("id"), str):
                        calls_by_id[tc["id"]] = python_call(call)
                text = render_calls(calls, self.return_format, self.tool_call_tag)
                prose = _text(msg.get("content")).strip()
                rest = {k: v for k, v in msg.items() if k not in ("tool_calls", "content", "function_call")}
                out.append({**rest, "content": f"{prose}\n\n{text}" if prose else text})
                continue
            out.append(msg)
        flush()
        if not (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
            out.insert(0, {"role": "system", "content": system})
        return out

    # --- response ---------------------------------------------------------------------------------

    def restore(self, response: dict[str, Any], ctx: PerturbContext) -> dict[str, Any]:
        if not ctx.state.get("active"):
            return response
        names: _Names = ctx.state["names"]
        schemas: Schemas = ctx.state["schemas"]
        choices = []
        records = []
        for choice in response.get("choices") or []:
            msg = choice.get("message") if isinstance(choice, dict) else None
            text = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(text, str) or msg.get("tool_calls"):
                choices.append(choice)
                continue
            strict, lenient = parse_both(text, self.return_format, self.tool_call_tag, schemas)
            if self.parse == "live":
                chosen = parse_live(text, self.return_format, self.tool_call_tag, names.offered(), schemas, lenient,
                                    single=bool(ctx.state.get("single")))
            else:
                chosen = lenient if self.parse == "lenient" else strict
            records.append((choice.get("index", 0), strict, lenient, chosen))
            if not chosen.has_calls:
                choices.append(choice)
                continue
            key = f"{ctx.perturbation_seed}:{response.get('id')}:{choice.get('index', 0)}"
            tool_calls = [{"id": _call_id(key, n), "type": "function",
                           "function": {"name": names.to_client(c["name"]),
                                        "arguments": json.dumps(jsonable(c["arguments"]), ensure_ascii=False)}}
                          for n, c in enumerate(chosen.calls)]
            choices.append({**choice, "message": {**msg, "content": None, "tool_calls": tool_calls},
                            "finish_reason": "tool_calls"})
        self._record(ctx, records)
        return {**response, "choices": choices}

    def _record(self, ctx: PerturbContext, records: list[tuple[int, Decoded, Decoded, Decoded]]) -> None:
        report = ctx.report.setdefault("decode", {})
        live = self.parse == "live"
        # strict stays BFCL's exact decode (grading reads it through answer_decodes); live is what the client got
        ctx.state["decoded"] = [{"index": i, "strict": s, "lenient": le, **({"live": c} if live else {})}
                                for i, s, le, c in records]
        summaries = []
        for index, strict, lenient, chosen in records:
            summary = {"index": index, "strict": strict.summary(), "lenient": lenient.summary(),
                       "used": self.parse if chosen.has_calls else "text", "wrong_syntax": not strict.ok}
            if live:
                summary["live"] = chosen.summary()
            summaries.append(summary)
        if summaries:
            report.update(summaries[0])
            if len(summaries) > 1:
                report["choices"] = summaries


def _call_id(key: str, n: int) -> str:
    return "call_" + hashlib.blake2b(f"{key}:{n}".encode(), digest_size=12).hexdigest()
