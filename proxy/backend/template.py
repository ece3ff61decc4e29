"""Messages from either OpenAI API, in one shape, rendered into the model's ChatML prompt.

`Msg` is the one internal shape: chat-completions messages (`content` a string, null or parts; assistant
`tool_calls`; `tool` results; legacy `function` messages; `developer`) and Responses input items (messages,
`function_call`, `function_call_output`, `instructions`) both become a list of `Msg`. The prompt is ChatML
(SmolLM2's template: `<|im_start|>role\\n...<|im_end|>\\n`); with tools on offer the system turn lists them
and says how to answer (see grammar.py), and earlier calls and replies are written in that same JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from toolquake.proxy.backend.grammar import Tool

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass
class Msg:
    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments JSON)
    tool_call_id: str | None = None
    name: str | None = None


def shown(value: Any, limit: int = 100) -> str:
    """A client's value as an error message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def part_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, null, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise ValueError(f"{where}.content[{i}] must be an object")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text", "refusal"):
                key = "refusal" if kind == "refusal" else "text"
                value = part.get(key)
                if not isinstance(value, (str, type(None))):
                    raise ValueError(f"{where}.content[{i}].{key} must be a string")
                texts.append(value or "")
            else:
                raise ValueError(f"{where}.content[{i}]: content parts of type {shown(kind)} are not supported "
                                 "(this model reads text only)")
        return "\n".join(texts)
    if isinstance(content, dict):  # a single part
        return part_text([content], where)
    raise ValueError(f"{where}.content must be a string, null or an array of parts")


def from_chat(messages: Any) -> list[Msg]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty array")
    out: list[Msg] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool", "function"):
            raise ValueError(f"{where}.role must be system, developer, user, assistant or tool, not {shown(role)}")
        text = part_text(m.get("content"), where)
        for key in ("tool_call_id", "name"):
            if not isinstance(m.get(key), (str, type(None))):
                raise ValueError(f"{where}.{key} must be a string")
        if role == "assistant":
            calls = []
            raw_calls = m.get("tool_calls")
            if not isinstance(raw_calls, (list, type(None))):
                raise ValueError(f"{where}.tool_calls must be an array")
            for j, c in enumerate(raw_calls or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.tool_calls[{j}] needs function.name")
                calls.append((str(c.get("id") or f"call_{i}_{j}"), fn["name"], _args(fn.get("arguments"))))
            legacy = m.get("function_call")
            if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
                calls.append((f"call_{i}", legacy["name"], _args(legacy.get("arguments"))))
            out.append(Msg("assistant", text, calls))
        elif role == "tool":
            out.append(Msg("tool", text, tool_call_id=m.get("tool_call_id"), name=m.get("name")))
        elif role == "function":
            out.append(Msg("tool", text, name=m.get("name")))
        else:
            out.append(Msg(role, text))
    return _name_results(out)


def from_responses(input_: Any, instructions: Any) -> list[Msg]:
    out: list[Msg] = []
    if isinstance(instructions, str) and instructions:
        out.append(Msg("system", instructions))
    if isinstance(input_, str):
        out.append(Msg("user", input_))
        return out
    if not isinstance(input_, list) or not input_:
        raise ValueError("'input' must be a string or a non-empty array of items")
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"{where}.role must be system, developer, user or assistant, not {shown(role)}")
            out.append(Msg(role, part_text(item.get("content"), where)))
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise ValueError(f"{where}: a function_call needs a name")
            call = (str(item.get("call_id") or item.get("id") or f"call_{i}"), item["name"],
                    _args(item.get("arguments")))
            if out and out[-1].role == "assistant" and (out[-1].tool_calls or not out[-1].content):
                out[-1].tool_calls.append(call)
            else:
                out.append(Msg("assistant", "", [call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else part_text(output, where)
            if not isinstance(item.get("call_id"), (str, type(None))):
                raise ValueError(f"{where}.call_id must be a string")
            out.append(Msg("tool", text, tool_call_id=item.get("call_id")))
        elif kind == "reasoning":
            continue  # another model's reasoning: nothing this model can use
        else:
            raise ValueError(f"{where}: input items of type {shown(kind)} are not supported")
    return _name_results(out)


def _args(raw: Any) -> str:
    if raw is None:
        return "{}"
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def _name_results(msgs: list[Msg]) -> list[Msg]:
    """Give each tool result the name of the call it answers (the prompt says whose result it is)."""
    names = {cid: name for m in msgs for cid, name, _ in m.tool_calls}
    for m in msgs:
        if m.role == "tool" and not m.name and m.tool_call_id in names:
            m.name = names[m.tool_call_id]
    return msgs


def tools_block(mode: str, tools: list[Tool], parallel: bool) -> str:
    """The system-prompt text that offers the tools and says how to answer."""
    lines = [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                        ensure_ascii=False) for t in tools]
    many = "one or more calls" if parallel else "one call"
    if mode == "required":
        how = f'Answer with {many} as JSON: {{"tool_calls": [{{"name": "<function name>", "arguments": {{...}}}}]}}'
    else:
        how = (f'To call functions, answer with {many} as JSON: {{"tool_calls": [{{"name": "<function name>", '
               '"arguments": {...}}]}. To answer the user directly (for example once the function results '
               'are known), answer {"response": "<your reply>"}.')
    return "You have access to the following functions:\n" + "\n".join(lines) + "\n\n" + how


Segment = tuple[str, bool]  # (text, is a special token of the template)


def render_segments(msgs: list[Msg], mode: str, tools: list[Tool], parallel: bool) -> list[Segment]:
    """The ChatML prompt as segments: the template's own role markers (`IM_START`, `IM_END`) flagged special,
    everything else (roles, message text, tool JSON) plain text, to be tokenized without special-token parsing
    so that a message's literal "<|im_start|>" stays text. Ends with the open assistant turn."""
    json_mode = mode != "none" and bool(tools)
    system = [m.content for m in msgs if m.role == "system" and m.content]
    head = "\n\n".join(system) or DEFAULT_SYSTEM
    if json_mode:
        head += "\n\n" + tools_block(mode, tools, parallel)
    out: list[Segment] = []

    def turn(role: str, body: str) -> None:
        out.extend(((IM_START, True), (f"{role}\n{body}", False), (IM_END, True), ("\n", False)))

    turn("system", head)
    for m in msgs:
        if m.role == "system":
            continue
        if m.role == "assistant":
            if m.tool_calls:
                body = json.dumps({"tool_calls": [{"name": n, "arguments": _loads(a)} for _, n, a in m.tool_calls]},
                                  ensure_ascii=False)
            elif json_mode:
                body = json.dumps({"response": m.content}, ensure_ascii=False)
            else:
                body = m.content
            turn("assistant", body)
        elif m.role == "tool":
            label = f"Result of {m.name}" if m.name else "Function result"
            turn("user", f"{label}: {m.content}")
        else:
            turn(m.role, m.content)
    out.extend(((IM_START, True), ("assistant\n", False)))
    return out


def render(msgs: list[Msg], mode: str, tools: list[Tool], parallel: bool) -> str:
    """The ChatML prompt as one string, ending with the open assistant turn."""
    return "".join(text for text, _ in render_segments(msgs, mode, tools, parallel))


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
