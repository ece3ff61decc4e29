"""Consistency of two answers to equivalent requests: same functions with the same arguments?

Label-free robustness (seed 001: "semantically equivalent outputs given semantically equivalent
inputs"). Calls are compared as a multiset (the order of parallel calls does not matter):

- `exact`: same function names and equal decoded arguments (JSON values; 1 == 1.0);
- `semantic`: the names match and every argument is equivalent after normalisation — strings
  compared case-, whitespace- and punctuation-insensitively (the characters BFCL strips), numeric
  strings equal to the numbers they spell, an omitted optional parameter equal to its schema
  `default`, lists element by element, objects key by key; plus, when given, an extra string
  equivalence (e.g. the semantic scorer's);
- otherwise they disagree. Two answers without calls agree; one with and one without disagree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

AGREE_EXACT = "true"
AGREE_SEMANTIC = "semantic"
DISAGREE = "false"

# BFCL's string standardisation strips these characters (and spaces) before comparing
_STRIP = re.compile(r"[\s,./\-_*^'\"!?;:()\[\]{}]+")

StringEquivalence = Callable[[str, str], bool]


@dataclass(frozen=True)
class Call:
    name: str
    #: decoded arguments; a string when the model's arguments were not valid JSON
    arguments: Any


@dataclass
class Agreement:
    agree: str
    reasons: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return self.agree != DISAGREE


def calls_of(message: dict[str, Any] | None) -> list[Call]:
    """The tool calls of an OpenAI assistant message (empty when it has none)."""
    if not isinstance(message, dict):
        return []
    out = []
    for tc in message.get("tool_calls") or []:
        fn = (tc or {}).get("function") or {}
        raw = fn.get("arguments")
        if isinstance(raw, str):
            try:
                args: Any = json.loads(raw) if raw.strip() else {}
            except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
                args = raw
        else:
            args = raw if raw is not None else {}
        out.append(Call(str(fn.get("name") or ""), args))
    return out


def answer_message(answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The first choice's message of a chat.completion dict."""
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    return choices[0].get("message")


def _canonical(value: Any) -> str:
    return json.dumps(_numbers_as_floats(value), sort_keys=True, ensure_ascii=False)


def _numbers_as_floats(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, list):
        return [_numbers_as_floats(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _numbers_as_floats(v) for k, v in value.items()}
    return value


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def normalize_string(text: str) -> str:
    return _STRIP.sub("", text).casefold()


def values_equivalent(a: Any, b: Any, strings: StringEquivalence | None = None) -> bool:
    """Semantic equality of two argument values (see the module docstring)."""
    if type(a) is type(b) and a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return na == nb
    if isinstance(a, str) and isinstance(b, str):
        if normalize_string(a) == normalize_string(b):
            return True
        return bool(strings and strings(a, b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equivalent(x, y, strings) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equivalent(a[k], b[k], strings) for k in a)
    return False


def _defaults(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = (tool or {}).get("function") or {}
        props = ((fn.get("parameters") or {}).get("properties")) or {}
        out[str(fn.get("name"))] = {k: v["default"] for k, v in props.items() if isinstance(v, dict) and "default" in v}
    return out


def _args_equivalent(a: Call, b: Call, defaults: dict[str, Any], strings: StringEquivalence | None) -> bool:
    if not isinstance(a.arguments, dict) or not isinstance(b.arguments, dict):
        return values_equivalent(a.arguments, b.arguments, strings)
    for key in a.arguments.keys() | b.arguments.keys():
        missing = object()
        va, vb = a.arguments.get(key, missing), b.arguments.get(key, missing)
        if va is missing or vb is missing:
            present = vb if va is missing else va
            if key not in defaults or not values_equivalent(present, defaults[key], strings):
                return False
            continue
        if not values_equivalent(va, vb, strings):
            return False
    return True


def _match(left: list[Call], right: list[Call], same: Callable[[Call, Call], bool]) -> bool:
    """Is there a one-to-one pairing of the calls under `same`? (backtracking; lists are short)"""
    if len(left) != len(right):
        return False
    used = [False] * len(right)

    def place(i: int) -> bool:
        if i == len(left):
            return True
        for j, candidate in enumerate(right):
            if not used[j] and same(left[i], candidate):
                used[j] = True
                if place(i + 1):
                    return True
                used[j] = False
        return False

    return place(0)


def compare(original: list[Call], other: list[Call], *, tools: list[dict[str, Any]] | None = None,
            strings: StringEquivalence | None = None) -> Agreement:
    """Compare two answers' calls. `tools` (the original request's) gives parameter defaults."""
    if sorted((c.name, _canonical(c.arguments)) for c in original) == \
            sorted((c.name, _canonical(c.arguments)) for c in other):
        return Agreement(AGREE_EXACT)
    reasons: list[str] = []
    names_a, names_b = sorted(c.name for c in original), sorted(c.name for c in other)
    if len(original) != len(other):
        reasons.append(f"call count {len(original)} != {len(other)}")
    if names_a != names_b:
        reasons.append(f"functions {names_a} != {names_b}")
    if not reasons:
        defaults = _defaults(tools)

        def same(x: Call, y: Call) -> bool:
            return x.name == y.name and _args_equivalent(x, y, defaults.get(x.name, {}), strings)

        if _match(original, other, same):
            return Agreement(AGREE_SEMANTIC, ["arguments equal only under the semantic rules"])
        reasons.append("arguments differ")
    return Agreement(DISAGREE, reasons)


def compare_answers(original: dict[str, Any] | None, other: dict[str, Any] | None, *,
                    tools: list[dict[str, Any]] | None = None,
                    strings: StringEquivalence | None = None) -> Agreement:
    """`compare` on two chat.completion dicts (their first choice)."""
    return compare(calls_of(answer_message(original)), calls_of(answer_message(other)), tools=tools,
                   strings=strings)
