"""Deterministic answers for a case: the ground truth as calls, and mutated variants of it.

Used by the parity test and the scorer benchmark (ours vs BFCL's checker on the same inputs), and
usable by any fuzzing test. Mutations drop, add or rename parameters; change values, types and case;
swap, reorder, drop or duplicate calls. For Java / JavaScript cases, values are rendered as the source
text BFCL's decoders hand to its checker (`42L`, `new ArrayList<>(Arrays.asList(...))`, `[1, 2]`...).
Everything is a pure function of (case, seed).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

Call = dict[str, Any]

_STRING_EDITS: tuple[Callable[[str], str], ...] = (
    str.upper, str.lower, str.title,
    lambda s: s + "s", lambda s: s[:-1], lambda s: " " + s + " ", lambda s: s.replace(" ", "-"),
    lambda s: s.replace(" ", "_"), lambda s: s + ".", lambda s: s.replace(" ", ", "), lambda s: "'" + s + "'",
    lambda s: s + "\t", lambda s: s.replace("'", '"'), lambda s: s[::-1], lambda s: "", lambda s: "...",
    lambda s: s + " (x)", lambda s: s.replace(",", ""), lambda s: s + "^*/",
)


def first_alternative(alts: list[Any]) -> tuple[bool, Any]:
    for alt in alts:
        if alt != "":
            return True, alt
    return False, None


def ground_truth_calls(case: Any) -> list[Call]:
    """The possible answer as calls: the first acceptable value of each parameter (optional ones omitted)."""
    calls = []
    for gt_call in case.ground_truth or []:
        name, params = next(iter(gt_call.items()))
        args = {}
        for param, alts in params.items():
            present, value = first_alternative(alts)
            if present:
                args[param] = _expand(value)
        calls.append({"name": name, "arguments": args})
    return calls


def _expand(value: Any) -> Any:
    """A GT value as a model would give it (dict answers hold lists of alternatives per key)."""
    if isinstance(value, dict):
        out = {}
        for key, alts in value.items():
            if isinstance(alts, list):
                present, first = first_alternative(alts)
                if present:
                    out[key] = first
            else:
                out[key] = alts
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_expand(v) for v in value]
    return value


def _random_alternative_calls(case: Any, rng: random.Random) -> list[Call]:
    """Another acceptable-looking answer: random alternatives, optional parameters sometimes omitted."""
    calls = []
    for gt_call in case.ground_truth or []:
        name, params = next(iter(gt_call.items()))
        args = {}
        for param, alts in params.items():
            choices = [a for a in alts if a != ""]
            if not choices or ("" in alts and rng.random() < 0.3):
                continue
            args[param] = _expand(rng.choice(choices))
        calls.append({"name": name, "arguments": args})
    return calls


# --- Java / JavaScript source text --------------------------------------------------------------


def _java_text(value: Any, kind: str, item: str | None) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind == "long" and isinstance(value, int):
        return f"{value}L"
    if kind == "float" and isinstance(value, (int, float)):
        return f"{value}f"
    if kind in ("Array", "ArrayList") and isinstance(value, list):
        parts = [_java_text(v, item or "any", None) if not isinstance(v, str) else f'"{v}"' for v in value]
        if kind == "Array":
            return f"new {item or 'Object'}[]{{{', '.join(parts)}}}"
        return f"new ArrayList<>(Arrays.asList({', '.join(parts)}))"
    if kind == "HashMap":
        return "new HashMap<String, String>()"  # BFCL's Java decoder drops the map body
    return str(value)


def _js_text(value: Any, kind: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(f"'{v}'" if isinstance(v, str) else _js_text(v, "any") for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_js_text(v, 'any')}" for k, v in value.items()) + "}"
    return str(value)


def render_source_values(case: Any, calls: list[Call]) -> list[Call]:
    """Typed values → the source text BFCL's Java/JS decoders produce (other categories unchanged)."""
    if case.category not in ("simple_java", "simple_javascript"):
        return calls
    docs = {d["name"]: d for d in case.functions}
    out = []
    for call in calls:
        props = docs.get(call["name"], {}).get("parameters", {}).get("properties", {})
        args = {}
        for param, value in call["arguments"].items():
            schema = props.get(param, {})
            kind = schema.get("type", "any")
            item = (schema.get("items") or {}).get("type")
            args[param] = (_java_text(value, kind, item) if case.category == "simple_java"
                           else _js_text(value, kind))
        out.append({"name": call["name"], "arguments": args})
    return out


# --- mutations ----------------------------------------------------------------------------------


def _mutate_value(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool):
        return rng.choice([not value, int(value), str(value).lower(), None, [value]])
    if isinstance(value, int):
        return rng.choice([value + 1, -value, float(value), str(value), True, None, value * 10, [value], 0])
    if isinstance(value, float):
        return rng.choice([value + 0.5, int(value), str(value), -value, round(value, 1), [value], 0.0])
    if isinstance(value, str):
        if rng.random() < 0.15:
            return rng.choice([1, None, [value], {"value": value}, True])
        return rng.choice(_STRING_EDITS)(value)
    if isinstance(value, (list, tuple)):
        items = list(value)
        choice = rng.randrange(9)
        if choice == 0 and items:
            items.pop(rng.randrange(len(items)))
        elif choice == 1:
            items.reverse()
        elif choice == 2 and items:
            i = rng.randrange(len(items))
            items[i] = _mutate_value(items[i], rng)
        elif choice == 3:
            items = [float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in items]
        elif choice == 4:
            return tuple(items)
        elif choice == 5:
            return []
        elif choice == 6:
            items.append(items[0] if items else 1)
        elif choice == 7:
            return ",".join(map(str, items))
        else:
            items = [int(x) if isinstance(x, float) and x.is_integer() else x for x in items]
        return items
    if isinstance(value, dict):
        out = dict(value)
        choice = rng.randrange(6)
        keys = list(out)
        if choice == 0 and keys:
            del out[rng.choice(keys)]
        elif choice == 1:
            out["unexpected_key"] = "x"
        elif choice == 2 and keys:
            k = rng.choice(keys)
            out[k] = _mutate_value(out[k], rng)
        elif choice == 3:
            return {}
        elif choice == 4:
            return [value]
        elif keys:
            k = rng.choice(keys)
            out[k.upper()] = out.pop(k)
        return out
    if value is None:
        return rng.choice(["None", "", 0, "null"])
    return value


def _mutate_source(value: Any, rng: random.Random) -> Any:
    """Edits of Java/JS source text (suffixes, quotes, literals), or a JSON-typed value."""
    if not isinstance(value, str):
        return _mutate_value(value, rng)
    edits = (lambda s: s.rstrip("Ll"), lambda s: s + "L", lambda s: s + "f", lambda s: f'"{s}"',
             lambda s: f"'{s}'", lambda s: s.strip("\"'"), lambda s: s.capitalize(), lambda s: s + ".0",
             lambda s: s.replace(", ", ","), lambda s: s.replace("Arrays.asList", "List.of"),
             lambda s: "new ArrayList<>()", lambda s: "[]", lambda s: "{}", lambda s: s.replace("[", "new Array(", 1),
             lambda s: "new HashMap<String, String>() {{ put(\"k\", \"v\"); }}", lambda s: s[:-1],
             lambda s: "-" + s, lambda s: s.replace("1", "2"), lambda s: "true", lambda s: "10n")
    if rng.random() < 0.2:
        return _mutate_value(value, rng)
    return rng.choice(edits)(value)


def _random_call(case: Any, rng: random.Random) -> Call:
    doc = rng.choice(case.functions)
    props = list((doc.get("parameters") or {}).get("properties") or {})
    args = {p: rng.choice([1, "x", 2.5, True, [1, 2], {"a": 1}]) for p in rng.sample(props, min(len(props), 2))}
    return {"name": doc["name"], "arguments": args}


def mutate(case: Any, calls: list[Call], rng: random.Random) -> list[Call]:
    """One random edit of an answer (calls are copied, never changed in place)."""
    calls = [{"name": c["name"], "arguments": dict(c["arguments"])} for c in calls]
    source = case.category in ("simple_java", "simple_javascript")
    op = rng.randrange(22)
    if not calls or op < 2:
        if op == 0 and calls:
            calls.pop(rng.randrange(len(calls)))
        elif case.functions:
            calls.insert(rng.randrange(len(calls) + 1), _random_call(case, rng))
        return calls
    target = calls[rng.randrange(len(calls))]
    args = target["arguments"]
    keys = list(args)
    doc = next((d for d in case.functions if d["name"] == target["name"]), None)
    props = list(((doc or {}).get("parameters") or {}).get("properties") or {})
    if op == 2:
        calls.append({"name": target["name"], "arguments": dict(args)})
    elif op == 3:
        rng.shuffle(calls)
    elif op == 4:
        calls.reverse()
    elif op == 5:
        others = [d["name"] for d in case.functions if d["name"] != target["name"]]
        target["name"] = rng.choice(others) if others else target["name"] + "_v2"
    elif op == 6:
        name = target["name"]
        target["name"] = rng.choice([name.upper(), name.replace(".", "_"), name.capitalize(), name + " "])
    elif op == 7 and keys:
        del args[rng.choice(keys)]
    elif op == 8:
        args[rng.choice(["extra", "unit", "verbose", "options"])] = rng.choice([1, "x", True])
    elif op == 9 and [p for p in props if p not in args]:
        args[rng.choice([p for p in props if p not in args])] = rng.choice([1, "x", 2.0, True, [1]])
    elif op == 10 and keys:
        k = rng.choice(keys)
        args[rng.choice([k.upper(), k + "_", k.capitalize()])] = args.pop(k)
    elif op in (11, 12, 13, 14, 15, 16) and keys:
        k = rng.choice(keys)
        args[k] = _mutate_source(args[k], rng) if source else _mutate_value(args[k], rng)
    elif op == 17 and len(keys) >= 2:
        a, b = rng.sample(keys, 2)
        args[a], args[b] = args[b], args[a]
    elif op == 18 and keys:
        k = rng.choice(keys)
        args[k] = rng.choice(["", None, [], {}])
    elif op == 19:
        target["arguments"] = dict(reversed(list(args.items())))
    elif op == 20:
        return []
    else:
        target["arguments"] = {}
    return calls


def answers(case: Any, count: int, seed: int = 0) -> Iterator[list[Call]]:
    """The ground-truth answer, then `count` mutated answers (one to three edits each), deterministic."""
    rng = random.Random(f"{seed}:{case.id}")
    base = render_source_values(case, ground_truth_calls(case))
    yield base
    for _ in range(count):
        start = base if rng.random() < 0.6 else render_source_values(case, _random_alternative_calls(case, rng))
        calls = start
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            calls = mutate(case, calls, rng)
        yield calls
