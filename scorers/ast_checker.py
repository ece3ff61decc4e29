"""BFCL's AST verdict for single-turn categories, and two documented extra modes.

* `bfcl` — BFCL v4's rules exactly, quirks included (greedy parallel matching, string normalisation,
  int-for-float, "variable" answers, positional list-of-dict comparison...): docs/scoring.md.
* `fair` — the same rules, but parallel calls are matched with backtracking (a perfect matching
  between expected and produced calls), so a correct answer never fails because of its order.
* `semantic` — `fair`, plus a string that fails BFCL's comparison is accepted when it is equivalent
  (normalisation of case, punctuation, whitespace, US states, number words; or embedding similarity).

`check(case, calls, mode)` takes the model's calls as `[{"name": dotted_name, "arguments": {...}}]`
(see scorers.decode) or a `DecodeFailure`, and returns a `Verdict`. It never raises on odd calls:
where BFCL's own checker would crash, the verdict is invalid with error type `toolquake:checker_error`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from scorers import langtypes
from scorers.corpus import AGENTIC_CATEGORIES, MULTI_TURN_CATEGORIES
from scorers.decode import WRONG_OUTPUT_FORMAT, DecodeFailure, is_well_formed
from scorers.taxonomy import IRRELEVANCE_VIOLATION, RELEVANCE_MISS, WRONG_FUNCTION, classify

MODES = ("bfcl", "fair", "semantic")
CHECKER_ERROR = "toolquake:checker_error"

PYTHON_TYPES: dict[str, type] = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
    "dict": dict, "any": str,
}

_STD = str.maketrans("", "", " ,./-_*^")
_STRUCTURED = (str, dict, list)  # expected types with their own value check

Equivalence = Callable[[str, str], bool]


class Verdict(msgspec.Struct, frozen=True):
    valid: bool
    error_type: str | None = None
    errors: list[str] = msgspec.field(default_factory=list)
    taxonomy: str | None = None


VALID = Verdict(valid=True)


class _Fail:
    """A failed check (returned, not raised): BFCL's error type, a message, and for parallel calls the
    taxonomy of the closest call."""

    __slots__ = ("error_type", "message", "taxonomy")

    def __init__(self, error_type: str, message: str, taxonomy: str | None = None):
        self.error_type = error_type
        self.message = message
        self.taxonomy = taxonomy


def std(text: str) -> str:
    """BFCL's string normalisation: drop ` ,./-_*^`, lower-case, ' → "."""
    return text.translate(_STD).lower().replace("'", '"')


def _first_type(alternatives: Any) -> type | None:
    for alt in alternatives:
        if alt != "":
            return type(alt)
    return None


def _std_all(seq: Any) -> list[Any]:
    """Index through `seq` as BFCL does (a string yields its characters), normalising strings."""
    out = []
    for j in range(len(seq)):
        item = seq[j]
        out.append(std(item) if type(item) is str else item)
    return out


class _Ctx:
    __slots__ = ("language", "python", "equiv")

    def __init__(self, language: str, equiv: Equivalence | None):
        self.language = language
        self.python = language == "python"
        self.equiv = equiv


# --- value checks ----------------------------------------------------------------------------------


def _type_check(param: str, value: Any, alts: list[Any], expected: type, nested: type | None) -> bool | _Fail:
    """BFCL's type check: is_variable, or the failure."""
    pat = _first_type(alts)
    is_var = pat is not None and pat != expected
    if type(value) == expected:  # noqa: E721 — an exact type test, as BFCL's
        if nested is None:
            return is_var
        for alt in alts:
            if type(alt) == list:  # noqa: E721
                pat_alt = _first_type(alt)
                if not all(type(x) == nested or (pat_alt is not None and type(x) == pat_alt)  # noqa: E721
                           for x in value):
                    continue
            return is_var
        if pat is not None and type(value) == pat:  # noqa: E721
            return _Fail("type_error:nested", f"{param!r}: items of {value!r} are not all "
                                             f"{nested.__name__}")
        return _Fail("type_error:simple", f"{param!r}: expected {expected.__name__} of {nested.__name__}, "
                                         f"got {value!r}")
    if pat is not None and type(value) == pat:  # noqa: E721
        return True
    return _Fail("type_error:simple", f"{param!r}: expected {expected.__name__}, got {type(value).__name__} "
                                     f"{value!r}")


def _string_check(param: str, value: str, alts: list[Any], ctx: _Ctx) -> _Fail | None:
    target = std(value)
    strings = [a for a in alts if type(a) is str]
    if any(std(a) == target for a in strings):
        return None
    if ctx.equiv is not None and any(a != "" and ctx.equiv(value, a) for a in strings):
        return None
    return _Fail("value_error:string", f"{param!r}: {value!r} is none of {alts!r} (normalised)")


def _lists_equivalent(model: list[Any], expected: list[Any], ctx: _Ctx) -> bool:
    if len(model) != len(expected):
        return False
    for m, e in zip(model, expected):
        if m == e:
            continue
        if not (type(m) is str and type(e) is str and e != "" and ctx.equiv is not None and ctx.equiv(m, e)):
            return False
    return True


def _list_check(param: str, value: list[Any], alts: list[Any], ctx: _Ctx) -> _Fail | None:
    model = _std_all(value)
    expected = [_std_all(a) for a in alts]
    if model in expected:
        return None
    if ctx.equiv is not None:
        raw_alts = [[a[j] for j in range(len(a))] for a in alts]
        if any(_lists_equivalent(list(value), alt, ctx) for alt in raw_alts):
            return None
    return _Fail("value_error:list/tuple", f"{param!r}: {value!r} is none of {alts!r}")


def _dict_one(value: dict[Any, Any], alt: Any, ctx: _Ctx) -> _Fail | None:
    failure: _Fail | None = None
    for key, item in value.items():
        if key not in alt:
            failure = _Fail("value_error:dict_key", f"unexpected key {key!r}")
            break
        accepted = alt[key]
        norm = std(item) if type(item) is str else item
        if norm in _std_all(accepted):
            continue
        if ctx.equiv is not None and type(item) is str and any(
                type(a) is str and a != "" and ctx.equiv(item, a) for a in (accepted[j] for j in range(len(accepted)))):
            continue
        failure = _Fail("value_error:dict_value", f"key {key!r}: {item!r} is none of {accepted!r}")
        break
    # BFCL runs the missing-key pass even after a failure, and its error type wins
    for key, accepted in alt.items():
        if key not in value and "" not in accepted:
            return _Fail("value_error:dict_key", f"missing key {key!r}")
    return failure


def _dict_check(param: str, value: dict[Any, Any], alts: list[Any], ctx: _Ctx) -> _Fail | None:
    failure = None
    for alt in alts:
        if alt == "":
            continue
        failure = _dict_one(value, alt, ctx)
        if failure is None:
            return None
    return failure or _Fail("dict_checker:unclear", f"{param!r}: no dict answer to compare {value!r} with")


def _list_dict_check(param: str, value: list[Any], alts: list[Any], ctx: _Ctx) -> _Fail | None:
    failure: _Fail | None = None
    for alt in alts:
        if len(value) != len(alt):
            failure = _Fail("value_error:list_dict_count", f"{param!r}: {len(value)} dicts, expected {len(alt)}")
            continue
        for i in range(len(value)):
            failure = _dict_check(param, value[i], [alt[i]], ctx)
            if failure is not None:
                break
        else:
            return None
    return failure or _Fail("list_dict_checker:unclear", f"{param!r}: no answer to compare with")


# --- one call --------------------------------------------------------------------------------------


class _Param:
    """One expected parameter, with what BFCL recomputes on every check worked out once.

    Where BFCL's checker would crash on the schema or the answer, the error is kept and raised at the
    point BFCL meets it: `error` before anything is checked, `late_error` after the type conversions.
    """

    __slots__ = ("kind", "expected", "nested", "item_type", "alts", "pat", "var0", "strings", "_lists",
                 "error", "late_error", "fast")

    def __init__(self, schema: dict[str, Any], alts: list[Any], language: str):
        self.error: Exception | None = None
        self.late_error: Exception | None = None
        self.alts = alts
        self.nested: type | None = None
        self.item_type: str | None = None
        self._lists: list[list[Any]] | None = None
        self.fast = 0  # 1: a Python scalar compared exactly; 2: a Python string compared normalised
        try:
            self.kind = schema["type"]
            if language == "python":
                self.expected = PYTHON_TYPES[self.kind]
                if self.kind in ("array", "tuple"):
                    self.nested = PYTHON_TYPES[schema["items"]["type"]]
            else:
                self.expected = (langtypes.JAVA_TYPES if language == "java" else langtypes.JS_TYPES)[self.kind]
        except Exception as exc:  # noqa: BLE001
            self.error = exc
            return
        try:
            if language != "python" and self.kind in langtypes.NESTED_TYPES:
                table = langtypes.JAVA_TYPES if language == "java" else langtypes.JS_TYPES
                self.item_type = schema["items"]["type"]
                self.nested = table[self.item_type]
            self.pat = _first_type(alts)
            self.var0 = self.pat is not None and self.pat != self.expected
            self.strings = frozenset(std(a) for a in alts if type(a) is str)
        except Exception as exc:  # noqa: BLE001
            self.late_error = exc
            return
        if language == "python" and self.nested is None and not self.var0:
            self.fast = 2 if self.expected is str else 1 if self.expected in (int, float, bool) else 0

    def lists(self) -> list[list[Any]]:
        if self._lists is None:
            self._lists = [_std_all(a) for a in self.alts]
        return self._lists


class _Expected:
    """One expected call (a ground-truth item) bound to its function doc."""

    __slots__ = ("gt_name", "name", "required", "params", "must", "error", "must_error")

    def __init__(self, doc: Any, gt_call: dict[str, Any], language: str, u2d: bool):
        self.gt_name = next(iter(gt_call))
        self.error: Exception | None = None
        self.must_error: Exception | None = None
        self.params: dict[Any, _Param] = {}
        self.must: list[Any] = []
        try:
            answers = next(iter(gt_call.values()))
            if doc is None:
                raise LookupError(f"no function doc named {self.gt_name!r}")
            name = doc["name"]
            props = doc["parameters"]["properties"]
            self.required = doc["parameters"]["required"]
            self.name = name.replace(".", "_") if u2d and "." in name else name
            for param, alts in answers.items():
                if param in props:
                    self.params[param] = _Param(props[param], alts, language)
        except Exception as exc:  # noqa: BLE001 — BFCL fails here before any check: so do we
            self.error = exc
            return
        try:
            self.must = [p for p, alts in answers.items() if "" not in alts]
        except Exception as exc:  # noqa: BLE001 — BFCL meets this only after every other check
            self.must_error = exc


def _check_call(exp: _Expected, call: dict[str, Any], ctx: _Ctx) -> _Fail | None:
    """BFCL's simple_function_checker for one produced call against one expected call."""
    if exp.error is not None:
        raise exp.error
    if call["name"] != exp.name:
        return _Fail("simple_function_checker:wrong_func_name", f"expected {exp.name!r}, got {call['name']!r}")
    args = call["arguments"]
    for required in exp.required:
        if required not in args:
            return _Fail("simple_function_checker:missing_required", f"missing required parameter {required!r}")
    python = ctx.python
    params = exp.params
    for param, value in args.items():
        spec = params.get(param)
        if spec is None:
            return _Fail("simple_function_checker:unexpected_param", f"unexpected parameter {param!r}")
        fast = spec.fast
        if fast:  # the common cases, same rules as the general path below, fewer steps
            if fast == 2:
                if type(value) is str and value.translate(_STD).lower().replace("'", '"') in spec.strings:
                    continue
            elif type(value) is spec.expected and value in spec.alts:
                continue
        if spec.error is not None:
            raise spec.error
        kind = spec.kind
        if not python:
            if type(value) is not str:
                return _Fail(f"type_error:{'java' if ctx.language == 'java' else 'js'}",
                             f"{param!r}: expected source text (a string), got {type(value).__name__} {value!r}")
            if spec.late_error is not None:  # an items type BFCL cannot look up: it fails before converting
                raise spec.late_error
            convert = langtypes.java_convert if ctx.language == "java" else langtypes.js_convert
            value = convert(value, kind) if spec.item_type is None else convert(value, kind, spec.item_type)
        elif type(value) is int and kind == "float":
            value = float(value)
        if kind == "tuple" and type(value) is tuple:
            value = list(value)
        if spec.late_error is not None:
            raise spec.late_error
        expected = spec.expected
        # BFCL's type check, inlined for the common scalar case
        if type(value) is expected and spec.nested is None:
            is_var = spec.var0
        else:
            is_var = _type_check(param, value, spec.alts, expected, spec.nested)
            if type(is_var) is _Fail:
                return is_var
        if not is_var and expected in _STRUCTURED:
            if expected is str:
                if value.translate(_STD).lower().replace("'", '"') in spec.strings:
                    continue
                failure = _string_check(param, value, spec.alts, ctx)
            elif expected is dict:
                failure = _dict_check(param, value, spec.alts, ctx)
            elif spec.nested is dict:
                failure = _list_dict_check(param, value, spec.alts, ctx)
            elif _std_all(value) in spec.lists():
                continue
            else:
                failure = _list_check(param, value, spec.alts, ctx)
            if failure is not None:
                return failure
            continue
        # variables and scalars: exact membership, no normalisation
        if value not in spec.alts:
            return _Fail("value_error:others", f"{param!r}: {value!r} is none of {spec.alts!r}")
    if exp.must_error is not None:
        raise exp.must_error
    for param in exp.must:
        if param not in args:
            return _Fail("simple_function_checker:missing_optional", f"missing expected parameter {param!r}")
    return None


def _find_doc(docs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for doc in docs:
        if doc["name"] == name:
            return doc
    return None


def _closest_taxonomy(failures: list[_Fail]) -> str:
    """For an unmatched expected call: the class of the failure on a call to the same function, if any."""
    for failure in failures:
        if failure.error_type != "simple_function_checker:wrong_func_name":
            return classify(failure.error_type) or WRONG_FUNCTION
    return WRONG_FUNCTION


def _parallel_greedy(expected: list[_Expected], calls: list[dict[str, Any]], ctx: _Ctx) -> _Fail | None:
    matched: set[int] = set()
    for i, exp in enumerate(expected):
        failures: list[_Fail] = []
        for index, call in enumerate(calls):
            if index in matched:
                continue
            failure = _check_call(exp, call, ctx)
            if failure is None:
                matched.add(index)
                break
            failures.append(failure)
        else:
            detail = "; ".join(f"{f.error_type}: {f.message}" for f in failures[:4])
            return _Fail("parallel_function_checker_no_order:cannot_find_match",
                         f"no produced call matches expected call #{i} ({exp.gt_name}): {detail}",
                         _closest_taxonomy(failures))
    return None


def _parallel_matching(expected: list[_Expected], calls: list[dict[str, Any]], ctx: _Ctx) -> _Fail | None:
    """Order-free matching with backtracking (augmenting paths over the compatibility graph)."""
    ok: list[list[bool]] = []
    failures: list[list[_Fail]] = []
    for exp in expected:
        row, row_failures = [], []
        for call in calls:
            failure = _check_call(exp, call, ctx)
            row.append(failure is None)
            if failure is not None:
                row_failures.append(failure)
        ok.append(row)
        failures.append(row_failures)
    owner: list[int | None] = [None] * len(calls)

    def augment(g: int, seen: list[bool]) -> bool:
        for c in range(len(calls)):
            if ok[g][c] and not seen[c]:
                seen[c] = True
                holder = owner[c]
                if holder is None or augment(holder, seen):
                    owner[c] = g
                    return True
        return False

    for g, exp in enumerate(expected):
        if not augment(g, [False] * len(calls)):
            detail = "; ".join(f"{f.error_type}: {f.message}" for f in failures[g][:4])
            return _Fail("parallel_function_checker_no_order:cannot_find_match",
                         f"no assignment of produced calls satisfies expected call #{g} ({exp.gt_name}): "
                         f"{detail}", _closest_taxonomy(failures[g]))
    return None


class _Compiled:
    __slots__ = ("functions", "ground_truth", "kind", "expected")

    def __init__(self, functions: list[dict[str, Any]], ground_truth: list[dict[str, Any]], dispatch: str,
                 language: str, u2d: bool):
        self.functions = functions
        self.ground_truth = ground_truth
        if "parallel" in dispatch:
            self.kind = "parallel"
            docs = [_find_doc(functions, next(iter(g))) for g in ground_truth]
        elif "multiple" in dispatch:
            self.kind = "multiple"
            docs = [_find_doc(functions, next(iter(g))) for g in ground_truth[:1]]
        else:
            self.kind = "simple"
            docs = [functions[0]] if ground_truth else []
        self.expected = [_Expected(doc, g, language, u2d) for doc, g in zip(docs, ground_truth)]

    def run(self, calls: list[dict[str, Any]], ctx: _Ctx, mode: str) -> _Fail | None:
        """None when the calls pass, else the failure (BFCL's dispatch by category)."""
        kind = self.kind
        if kind == "simple":
            if len(calls) != 1:
                return _Fail("simple_function_checker:wrong_count", f"{len(calls)} calls, expected 1")
            return _check_call(self.expected[0], calls[0], ctx)
        expected_count = len(self.ground_truth)
        if len(calls) != expected_count:
            checker = "parallel_function_checker_no_order" if kind == "parallel" else "multiple_function_checker"
            return _Fail(f"{checker}:wrong_count", f"{len(calls)} calls, expected {expected_count}")
        if kind == "multiple":
            return _check_call(self.expected[0], calls[0], ctx)
        if mode == "bfcl":
            return _parallel_greedy(self.expected, calls, ctx)
        return _parallel_matching(self.expected, calls, ctx)


_COMPILED: dict[tuple[int, int, str, str, bool], _Compiled] = {}
_COMPILED_MAX = 50_000


def _compiled(functions: list[dict[str, Any]], ground_truth: list[dict[str, Any]], dispatch: str,
              language: str, u2d: bool) -> _Compiled:
    key = (id(functions), id(ground_truth), dispatch, language, u2d)
    hit = _COMPILED.get(key)
    if hit is not None and hit.functions is functions and hit.ground_truth is ground_truth:
        return hit
    if len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.clear()
    compiled = _COMPILED[key] = _Compiled(functions, ground_truth, dispatch, language, u2d)
    return compiled


def language_of(category: str) -> str:
    if category == "simple_java":
        return "java"
    if category == "simple_javascript":
        return "javascript"
    # format-sensitivity cases are python whatever their original category
    return "python"


_CLASSES: dict[str, str | None] = {}


def _failed(error_type: str, message: str, taxonomy: str | None = None) -> Verdict:
    if taxonomy is None:
        taxonomy = _CLASSES.get(error_type)
        if taxonomy is None:
            taxonomy = _CLASSES[error_type] = classify(error_type)
    return Verdict(False, error_type, [message], taxonomy)


def _crashed(exc: Exception) -> Verdict:
    return _failed(CHECKER_ERROR, f"the checker cannot score this answer: {type(exc).__name__}: {exc}"[:500])


_PLANS: dict[str, str] = {}


def _plan(category: str) -> str:
    plan = _PLANS.get(category)
    if plan is None:
        if "irrelevance" in category:
            plan = "irrelevance"
        elif "relevance" in category:
            plan = "relevance"
        else:
            plan = language_of(category)
        _PLANS[category] = plan
    return plan


def check_calls(functions: list[dict[str, Any]], ground_truth: Any, category: str, calls: Any,
                mode: str = "bfcl", *, dispatch: str | None = None, underscore_to_dot: bool = False,
                equivalence: Equivalence | None = None) -> Verdict:
    """The verdict for calls against BFCL docs + possible answers of one single-turn category."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
    failure = calls if type(calls) is DecodeFailure else None
    well_formed = failure is None and is_well_formed(calls)
    plan = _plan(category)
    if plan == "irrelevance":
        if well_formed and calls:
            return _failed("irrelevance_error:decoder_success",
                           f"{len(calls)} call(s) where no call is expected", IRRELEVANCE_VIOLATION)
        return VALID
    if plan == "relevance":
        return VALID if well_formed and calls else _failed("relevance_error:decoder_failed",
                                                           "no call where one is expected", RELEVANCE_MISS)
    if failure is not None:
        return _failed(failure.error_type, failure.reason)
    if not well_formed:
        return _failed(WRONG_OUTPUT_FORMAT, "calls must be a list of {name: str, arguments: object}")
    if ground_truth is None:
        raise ValueError(f"category {category!r} has no possible answers to check against")
    if mode == "semantic" and equivalence is None:
        from scorers.semantic import default_equivalence

        equivalence = default_equivalence()
    ctx = _Ctx(plan, equivalence if mode == "semantic" else None)
    try:
        failure = _compiled(functions, ground_truth, dispatch or category, plan, underscore_to_dot).run(calls, ctx, mode)
    except Exception as exc:  # noqa: BLE001 — where BFCL's checker would crash, an invalid verdict
        return _crashed(exc)
    return VALID if failure is None else _failed(failure.error_type, failure.message, failure.taxonomy)


_NOT_AST = frozenset(MULTI_TURN_CATEGORIES + AGENTIC_CATEGORIES)
_BFCL_CTX = {lang: _Ctx(lang, None) for lang in ("python", "java", "javascript")}
# id(case) → (case, its compiled answer in bfcl mode or None): the fast path of check()
_CASES: dict[int, tuple[Any, _Compiled | None, _Ctx | None]] = {}


def _case_entry(case: Any) -> tuple[Any, _Compiled | None, _Ctx | None]:
    category = case.category
    if category in _NOT_AST:
        raise ValueError(f"{case.id}: {category} is not scored by the AST checker")
    plan = _plan(category)
    compiled = ctx = None
    if plan in _BFCL_CTX and case.ground_truth is not None:
        dispatch = case.extra.get("original_id") if category == "format_sensitivity" else None
        compiled = _compiled(case.functions, case.ground_truth, dispatch or category, plan, False)
        ctx = _BFCL_CTX[plan]
    if len(_CASES) >= _COMPILED_MAX:
        _CASES.clear()
    entry = _CASES[id(case)] = (case, compiled, ctx)
    return entry


def check(case: Any, calls: Any, mode: str = "bfcl", *, underscore_to_dot: bool = False,
          equivalence: Equivalence | None = None) -> Verdict:
    """The verdict for a corpus case (single-turn categories and format-sensitivity ids)."""
    entry = _CASES.get(id(case))
    if entry is None or entry[0] is not case:
        entry = _case_entry(case)
    compiled = entry[1]
    if compiled is not None and mode == "bfcl" and not underscore_to_dot and is_well_formed(calls):
        try:
            failure = compiled.run(calls, entry[2], mode)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 — as in check_calls
            return _crashed(exc)
        return VALID if failure is None else _failed(failure.error_type, failure.message, failure.taxonomy)
    dispatch = case.extra.get("original_id") if case.category == "format_sensitivity" else None
    return check_calls(case.functions, case.ground_truth, case.category, calls, mode, dispatch=dispatch,
                       underscore_to_dot=underscore_to_dot, equivalence=equivalence)
