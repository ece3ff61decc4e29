"""BFCL's AST verdict for single-turn categories, and two documented extra modes.

* `bfcl` — BFCL v4's rules exactly, quirks included (greedy parallel matching, string normalisation,
  int-for-float, "variable" answers, positional list-of-dict comparison...): docs/scoring.md.
* `fair` — the same rules, but parallel calls are matched with backtracking (a perfect matching
  between expected and produced calls), so a correct answer never fails because of its order.
* `semantic` — `fair`, plus a string that fails BFCL's comparison is accepted when it is equivalent
  (normalisation of case, punctuation, whitespace, US states, number words; or embedding similarity).

`check(case, calls, mode)` takes the model's calls as `[{"name": dotted_name, "arguments": {...}}]`
(see `toolquake.bfcl.decode`) or a `DecodeFailure`, and returns a `Verdict`. It never raises on odd calls:
where BFCL's own checker would crash, the verdict is invalid with error type `toolquake:checker_error`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from toolquake.bfcl import langtypes
from toolquake.bfcl.corpus import AGENTIC_CATEGORIES, MULTI_TURN_CATEGORIES
from toolquake.bfcl.decode import WRONG_OUTPUT_FORMAT, DecodeFailure, is_well_formed
from toolquake.scorers.taxonomy import IRRELEVANCE_VIOLATION, RELEVANCE_MISS, WRONG_FUNCTION, classify

MODES = ("bfcl", "fair", "semantic")
CHECKER_ERROR = "toolquake:checker_error"

PYTHON_TYPES: dict[str, type] = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
    "dict": dict, "any": str,
}

_STD = str.maketrans("", "", " ,./-_*^")
# the same normalisation for ASCII text in one C pass: delete ` ,./-_*^`, A-Z → a-z, ' → "
_STD_DELETE = b" ,./-_*^"
_STD_TABLE = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ'", b'abcdefghijklmnopqrstuvwxyz"')
_STRUCTURED = (str, dict, list)  # expected types with their own value check

Equivalence = Callable[[str, str], bool]


class Verdict(msgspec.Struct, frozen=True):
    valid: bool
    error_type: str | None = None
    errors: list[str] = msgspec.field(default_factory=list)
    taxonomy: str | None = None


VALID = Verdict(valid=True)

# A failed check is returned, never raised, as a tuple: (BFCL's error type, message format, format
# arguments[, taxonomy of the closest call for parallel answers]). The message is only formatted
# (`format % arguments`) when the failure becomes the verdict: a parallel answer discards most failures.
Failure = tuple[Any, ...]


def _message(failure: Failure) -> str:
    return failure[1] % failure[2]


def std(text: str) -> str:
    """BFCL's string normalisation: drop ` ,./-_*^`, lower-case, ' → "."""
    if text.isascii():
        return text.encode().translate(_STD_TABLE, _STD_DELETE).decode()
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


_BFCL_CTX = {lang: _Ctx(lang, None) for lang in ("python", "java", "javascript")}


# --- value checks ----------------------------------------------------------------------------------


def _type_check(param: str, value: Any, alts: list[Any], pat: type | None, expected: type,
                nested: type | None) -> bool | Failure:
    """BFCL's type check (`pat`: the type of the first non-empty alternative): is_variable, or the failure."""
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
            return ("type_error:nested", "%r: items of %r are not all %s", (param, value, nested.__name__))
        return ("type_error:simple", "%r: expected %s of %s, got %r",
                (param, expected.__name__, nested.__name__, value))
    if pat is not None and type(value) == pat:  # noqa: E721
        return True
    return ("type_error:simple", "%r: expected %s, got %s %r", (param, expected.__name__, type(value).__name__, value))


def _string_check(param: str, value: str, alts: list[Any], ctx: _Ctx) -> Failure | None:
    target = std(value)
    strings = [a for a in alts if type(a) is str]
    if any(std(a) == target for a in strings):
        return None
    if ctx.equiv is not None and any(a != "" and ctx.equiv(value, a) for a in strings):
        return None
    return ("value_error:string", "%r: %r is none of %r (normalised)", (param, value, alts))


def _lists_equivalent(model: list[Any], expected: list[Any], ctx: _Ctx) -> bool:
    if len(model) != len(expected):
        return False
    for m, e in zip(model, expected):
        if m == e:
            continue
        if not (type(m) is str and type(e) is str and e != "" and ctx.equiv is not None and ctx.equiv(m, e)):
            return False
    return True


def _list_check(param: str, value: list[Any], alts: list[Any], ctx: _Ctx) -> Failure | None:
    model = _std_all(value)
    expected = [_std_all(a) for a in alts]
    if model in expected:
        return None
    if ctx.equiv is not None:
        raw_alts = [[a[j] for j in range(len(a))] for a in alts]
        if any(_lists_equivalent(list(value), alt, ctx) for alt in raw_alts):
            return None
    return ("value_error:list/tuple", "%r: %r is none of %r", (param, value, alts))


def _dict_one(value: dict[Any, Any], alt: Any, ctx: _Ctx) -> Failure | None:
    failure: Failure | None = None
    for key, item in value.items():
        if key not in alt:
            failure = ("value_error:dict_key", "unexpected key %r", (key,))
            break
        accepted = alt[key]
        norm = std(item) if type(item) is str else item
        if norm in _std_all(accepted):
            continue
        if ctx.equiv is not None and type(item) is str and any(
                type(a) is str and a != "" and ctx.equiv(item, a) for a in (accepted[j] for j in range(len(accepted)))):
            continue
        failure = ("value_error:dict_value", "key %r: %r is none of %r", (key, item, accepted))
        break
    # BFCL runs the missing-key pass even after a failure, and its error type wins
    for key, accepted in alt.items():
        if key not in value and "" not in accepted:
            return ("value_error:dict_key", "missing key %r", (key,))
    return failure


def _dict_check(param: str, value: dict[Any, Any], alts: list[Any], ctx: _Ctx) -> Failure | None:
    failure = None
    for alt in alts:
        if alt == "":
            continue
        failure = _dict_one(value, alt, ctx)
        if failure is None:
            return None
    return failure or ("dict_checker:unclear", "%r: no dict answer to compare %r with", (param, value))


def _list_dict_check(param: str, value: list[Any], alts: list[Any], ctx: _Ctx) -> Failure | None:
    failure: Failure | None = None
    for alt in alts:
        if len(value) != len(alt):
            failure = ("value_error:list_dict_count", "%r: %s dicts, expected %s", (param, len(value), len(alt)))
            continue
        for i in range(len(value)):
            failure = _dict_check(param, value[i], [alt[i]], ctx)
            if failure is not None:
                break
        else:
            return None
    return failure or ("list_dict_checker:unclear", "%r: no answer to compare with", (param,))


# --- one call --------------------------------------------------------------------------------------

# What a parameter's fast path accepts without the general check (same rules, fewer steps):
_GENERAL, _STRING, _EXACT, _FLOAT, _STRING_LIST, _EXACT_LIST = range(6)


class _Param:
    """One expected parameter, with what BFCL recomputes on every check worked out once.

    Where BFCL's checker would crash on the schema or the answer, the error is kept and raised at the
    point BFCL meets it: `error` before anything is checked, `late_error` after the type conversions.
    `code` selects a fast path (python only, non-variable answers): `data` then holds the normalised
    strings (a set; `raw`: the strings as given, which match without normalising), the exact
    alternatives (a set when hashable) or the normalised lists; `shown` is repr(alternatives), for the
    messages of its failures.
    """

    # the fields a fast path reads come first (one cache line)
    __slots__ = ("flags", "code", "data", "raw", "expected", "nested", "alts", "shown", "kind", "item_type", "pat",
                 "var0", "strings", "_lists", "error", "late_error")

    def __init__(self, schema: dict[str, Any], alts: list[Any], language: str):
        self.error: Exception | None = None
        self.late_error: Exception | None = None
        self.alts = alts
        self.nested: type | None = None
        self.item_type: str | None = None
        self._lists: list[list[Any]] | None = None
        self.flags = 0  # required / expected: set by _Expected
        self.code = _GENERAL
        self.data: Any = None
        self.raw: frozenset[str] = frozenset()
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
        if language == "python" and not self.var0:
            self._choose_fast_path()

    def _choose_fast_path(self) -> None:
        expected, nested = self.expected, self.nested
        if type(self.alts) is not list:  # odd answers: the general path keeps BFCL's behaviour with them
            return
        try:
            self.shown = repr(self.alts)
            if nested is None:
                if expected is str:
                    self.code, self.data = _STRING, self.strings
                    self.raw = frozenset(a for a in self.alts if type(a) is str)
                elif expected in (int, float, bool):
                    try:
                        self.data = frozenset(self.alts)
                    except TypeError:  # unhashable alternatives: compared as a list, as BFCL does
                        self.data = self.alts
                    self.code = _FLOAT if expected is float else _EXACT
            elif self.kind == "array" and nested in (str, int, float, bool) and self.alts:
                self.data = self.lists()
                self.code = _STRING_LIST if nested is str else _EXACT_LIST
        except Exception:  # noqa: BLE001 — odd answers: the general path meets the error where BFCL does
            self.code, self.data, self._lists = _GENERAL, None, None

    def lists(self) -> list[list[Any]]:
        if self._lists is None:
            self._lists = [_std_all(a) for a in self.alts]
        return self._lists


def _check_param(spec: _Param, param: Any, value: Any, ctx: _Ctx) -> Failure | None:
    """BFCL's checks of one parameter value (type conversions, type, value)."""
    if spec.error is not None:
        raise spec.error
    kind = spec.kind
    if not ctx.python:
        if type(value) is not str:
            return (f"type_error:{'java' if ctx.language == 'java' else 'js'}",
                    "%r: expected source text (a string), got %s %r", (param, type(value).__name__, value))
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
        is_var = _type_check(param, value, spec.alts, spec.pat, expected, spec.nested)
        if type(is_var) is tuple:
            return is_var
    if not is_var and expected in _STRUCTURED:
        if expected is str:
            if std(value) in spec.strings:
                return None
            return _string_check(param, value, spec.alts, ctx)
        if expected is dict:
            return _dict_check(param, value, spec.alts, ctx)
        if spec.nested is dict:
            return _list_dict_check(param, value, spec.alts, ctx)
        if _std_all(value) in spec.lists():
            return None
        return _list_check(param, value, spec.alts, ctx)
    # variables and scalars: exact membership, no normalisation
    if value not in spec.alts:
        return ("value_error:others", "%r: %r is none of %r", (param, value, spec.alts))
    return None


_MUST = 1 << 16  # _Param.flags: 1 for a required parameter, _MUST for an expected one (both add up)


class _Expected:
    """One expected call (a ground-truth item) bound to its function doc, worked out once.

    Where BFCL's checker would crash on the doc or the answer, the error is kept and raised where BFCL
    meets it: `error` before anything is checked, `must_error` after every other check. `required_count`
    and `must_count` let a passing call be confirmed by counting flagged parameters; when `required`
    cannot be a set, `required_first` checks it one by one before anything else, as BFCL does.
    """

    __slots__ = ("error", "name", "params", "required_first", "required_count", "must_count", "must_error",
                 "required", "must", "gt_name")

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
        required_set: frozenset[Any] = frozenset()
        self.required_first = False
        try:
            required_set = frozenset(self.required)
        except Exception:  # noqa: BLE001 — then checked one by one, failing where BFCL does
            self.required_first = True
        self.required_count = len(required_set)
        must_set: frozenset[Any] = frozenset()
        try:
            self.must = [p for p, alts in answers.items() if "" not in alts]
            must_set = frozenset(self.must)
        except Exception as exc:  # noqa: BLE001 — BFCL meets this only after every other check
            self.must_error = exc
        self.must_count = len(must_set)
        for param, spec in self.params.items():
            spec.flags = (param in required_set) + _MUST * (param in must_set)


def _wrong_type(param: Any, expected: type, value: Any) -> Failure:
    """A scalar of another type where no alternative has that type (BFCL's type check, decided)."""
    return ("type_error:simple", "%r: expected %s, got %s %r", (param, expected.__name__, type(value).__name__, value))


def _missing_required(exp: _Expected, args: dict[Any, Any]) -> Failure | None:
    for req in exp.required:
        if req not in args:
            return ("simple_function_checker:missing_required", "missing required parameter %r", (req,))
    return None


def _check_call(exp: _Expected, name: str, args: dict[Any, Any], ctx: _Ctx) -> Failure | None:
    """BFCL's simple_function_checker: one produced call (name, arguments) against one expected call.

    Each parameter first tries its fast path (`_Param.code`: a scalar of another type fails at once; of
    the expected type it matches or, in `bfcl` mode, plainly does not); anything else goes through
    `_check_param`. BFCL looks for missing required parameters first; here they are counted on the way
    and looked up one by one only when the count falls short or the loop fails or raises (before the
    loop when there are fewer arguments than required parameters): the same outcome.
    """
    if exp.error is not None:
        raise exp.error
    if name != exp.name:
        return ("simple_function_checker:wrong_func_name", "expected %r, got %r", (exp.name, name))
    if exp.required_first or len(args) < exp.required_count:  # (too few arguments: one is surely missing)
        failure = _missing_required(exp, args)
        if failure is not None:
            return failure
    try:
        seen, failure = _check_args(exp, args, ctx)
    except Exception:
        if not exp.required_first:  # BFCL would have stopped at a missing required parameter first
            failure = _missing_required(exp, args)
            if failure is not None:
                return failure
        raise
    if (seen & (_MUST - 1)) != exp.required_count and not exp.required_first:  # some required one not seen
        missing = _missing_required(exp, args)
        if missing is not None:
            return missing
    if failure is not None:
        return failure
    if exp.must_error is not None:
        raise exp.must_error
    if seen // _MUST != exp.must_count:
        for param in exp.must:
            if param not in args:
                return ("simple_function_checker:missing_optional", "missing expected parameter %r", (param,))
    return None


def _check_args(exp: _Expected, args: dict[Any, Any], ctx: _Ctx) -> tuple[int, Failure | None]:
    """Each argument against its parameter, in order, up to the first that fails: (the flags of the parameters
    met, added up: required ones in the low bits, expected ones above; the failure or None)."""
    params = exp.params
    seen = 0
    for param, value in args.items():
        spec = params.get(param)
        if spec is None:
            return seen, ("simple_function_checker:unexpected_param", "unexpected parameter %r", (param,))
        seen += spec.flags
        code = spec.code
        if code == _STRING:
            if type(value) is not str:
                return seen, _wrong_type(param, str, value)
            if value in spec.raw or (value.encode().translate(_STD_TABLE, _STD_DELETE).decode()
                                     if value.isascii() else std(value)) in spec.data:
                continue
            if ctx.equiv is None:
                return seen, ("value_error:string", "%r: %r is none of %s (normalised)", (param, value, spec.shown))
        elif code == _EXACT or code == _FLOAT:
            if type(value) is int and code == _FLOAT:
                value = float(value)
            if type(value) is not spec.expected:
                return seen, _wrong_type(param, spec.expected, value)
            if value in spec.data:
                continue
            return seen, ("value_error:others", "%r: %r is none of %s", (param, value, spec.shown))
        elif code:  # lists of scalars, every item of the item type
            if type(value) is list and set(map(type, value)) <= {spec.nested}:
                if code == _EXACT_LIST:
                    if value in spec.data:
                        continue
                elif value in spec.alts or list(map(std, value)) in spec.data:  # as given, or normalised
                    continue
                if ctx.equiv is None:
                    return seen, ("value_error:list/tuple", "%r: %r is none of %s", (param, value, spec.shown))
        failure = _check_param(spec, param, value, ctx)
        if failure is not None:
            return seen, failure
    return seen, None


def _find_doc(docs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for doc in docs:
        if doc["name"] == name:
            return doc
    return None


def _closest_taxonomy(failures: list[Failure]) -> str:
    """For an unmatched expected call: the class of the failure on a call to the same function, if any."""
    for failure in failures:
        if failure[0] != "simple_function_checker:wrong_func_name":
            return _classify(failure[0]) or WRONG_FUNCTION
    return WRONG_FUNCTION


def _no_match(what: str, index: int, exp: _Expected, failures: list[Failure]) -> Failure:
    detail = "; ".join([f"{f[0]}: {_message(f)}" for f in failures[:4]])
    return ("parallel_function_checker_no_order:cannot_find_match", "%s #%s (%s): %s",
            (what, index, exp.gt_name, detail), _closest_taxonomy(failures))


def _parallel_greedy(expected: list[_Expected], calls: list[dict[str, Any]], ctx: _Ctx) -> Failure | None:
    unmatched = [(call["name"], call["arguments"]) for call in calls]  # in the order produced
    for i, exp in enumerate(expected):
        failures: list[Failure] = []
        for index, (name, args) in enumerate(unmatched):
            failure = _check_call(exp, name, args, ctx)
            if failure is None:
                del unmatched[index]
                break
            failures.append(failure)
        else:
            return _no_match("no produced call matches expected call", i, exp, failures)
    return None


def _parallel_matching(expected: list[_Expected], calls: list[dict[str, Any]], ctx: _Ctx) -> Failure | None:
    """Order-free matching with backtracking (augmenting paths over the compatibility graph)."""
    ok: list[list[bool]] = []
    failures: list[list[Failure]] = []
    for exp in expected:
        row, row_failures = [], []
        for call in calls:
            failure = _check_call(exp, call["name"], call["arguments"], ctx)
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
            return _no_match("no assignment of produced calls satisfies expected call", g, exp, failures[g])
    return None


_SIMPLE, _MULTIPLE, _PARALLEL, _ORDERED = 0, 1, 2, 3
_WRONG_COUNT = tuple(f"{checker}:wrong_count" for checker in (
    "simple_function_checker", "multiple_function_checker", "parallel_function_checker_no_order",
    "ordered_function_checker"))


class _Compiled:
    """A case's answer key: its expected calls and BFCL's dispatch (`kind`: simple, multiple, parallel).
    `bfcl_ctx` is set where check() may score it directly (a language BFCL checks, an expected call)."""

    __slots__ = ("owner", "bfcl_ctx", "single", "first", "count", "kind", "expected", "functions", "ground_truth")

    def __init__(self, functions: list[dict[str, Any]], ground_truth: list[dict[str, Any]], dispatch: str,
                 language: str, u2d: bool):
        self.functions = functions
        self.ground_truth = ground_truth
        if dispatch == "ordered":  # several calls in the listed order (user cases with `order: fixed`)
            self.kind = _ORDERED
            docs = [_find_doc(functions, next(iter(g))) for g in ground_truth]
        elif "parallel" in dispatch:
            self.kind = _PARALLEL
            docs = [_find_doc(functions, next(iter(g))) for g in ground_truth]
        elif "multiple" in dispatch:
            self.kind = _MULTIPLE
            docs = [_find_doc(functions, next(iter(g))) for g in ground_truth[:1]]
        else:
            self.kind = _SIMPLE
            docs = [functions[0]] if ground_truth else []
        self.expected = [_Expected(doc, g, language, u2d) for doc, g in zip(docs, ground_truth)]
        self.first = self.expected[0] if self.expected else None
        self.count = 1 if self.kind == _SIMPLE else len(ground_truth)
        self.single = self.count == 1 and self.kind not in (_PARALLEL, _ORDERED)
        self.bfcl_ctx = _BFCL_CTX.get(language) if self.expected else None
        self.owner: Any = None

    def run(self, calls: list[dict[str, Any]], ctx: _Ctx, mode: str) -> Failure | None:
        """None when the (well-formed) calls pass, else the failure (BFCL's dispatch by category)."""
        if len(calls) != self.count:
            return (_WRONG_COUNT[self.kind], "%s calls, expected %s", (len(calls), self.count))
        if self.kind == _ORDERED:
            for exp, call in zip(self.expected, calls):
                failure = _check_call(exp, call["name"], call["arguments"], ctx)
                if failure is not None:
                    return failure
            return None
        if self.kind != _PARALLEL:
            return _check_call(self.expected[0], calls[0]["name"], calls[0]["arguments"], ctx)
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


def _classify(error_type: str) -> str | None:
    """classify(), remembered per error type."""
    try:
        return _CLASSES[error_type]
    except KeyError:
        taxonomy = _CLASSES[error_type] = classify(error_type)
        return taxonomy


def _failed(error_type: str, message: str, taxonomy: str | None = None) -> Verdict:
    return Verdict(False, error_type, [message], taxonomy or _classify(error_type))


def _verdict(failure: Failure) -> Verdict:
    error_type = failure[0]
    taxonomy = failure[3] if len(failure) > 3 else _classify(error_type)
    return Verdict(False, error_type, [failure[1] % failure[2]], taxonomy)


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
        from toolquake.scorers.semantic import default_equivalence

        equivalence = default_equivalence()
    ctx = _Ctx(plan, equivalence if mode == "semantic" else None)
    try:
        compiled = _compiled(functions, ground_truth, dispatch or category, plan, underscore_to_dot)
        failure = compiled.run(calls, ctx, mode)
    except Exception as exc:  # noqa: BLE001 — where BFCL's checker would crash, an invalid verdict
        return _crashed(exc)
    return VALID if failure is None else _verdict(failure)


_NOT_AST = frozenset(MULTI_TURN_CATEGORIES + AGENTIC_CATEGORIES)
# id(case) → the case's own answer key (`owner` is the case): the fast path of check()
_CASES: dict[int, _Compiled] = {}


def _grading_category(case: Any) -> str:
    """The category whose rules grade a case: its own, or `extra["grade_as"]` (user cases, proxy/live/usercases.py)."""
    return case.extra.get("grade_as") or case.category


def _case_entry(case: Any) -> _Compiled:
    category = _grading_category(case)
    if category in _NOT_AST:
        raise ValueError(f"{case.id}: {category} is not scored by the AST checker")
    plan = _plan(category)
    if plan in _BFCL_CTX and case.ground_truth is not None:
        dispatch = case.extra.get("original_id") if category == "format_sensitivity" else None
        compiled = _Compiled(case.functions, case.ground_truth, dispatch or category, plan, False)
    else:
        compiled = _Compiled([], [], "", "", False)  # nothing expected: the general path decides
    compiled.owner = case
    if len(_CASES) >= _COMPILED_MAX:
        _CASES.clear()
    _CASES[id(case)] = compiled
    return compiled


def check(case: Any, calls: Any, mode: str = "bfcl", *, underscore_to_dot: bool = False,
          equivalence: Equivalence | None = None) -> Verdict:
    """The verdict for a corpus case (single-turn categories and format-sensitivity ids) or a user case."""
    compiled = _CASES.get(id(case))
    if compiled is None or compiled.owner is not case:
        compiled = _case_entry(case)
    # bfcl mode on well-formed calls: the answer key straight away (else the general path below)
    ctx = compiled.bfcl_ctx
    if ctx is not None and mode == "bfcl" and not underscore_to_dot and type(calls) is list:
        try:
            if compiled.single and len(calls) == 1:  # one call against one expected call
                call = calls[0]
                if type(call) is dict:
                    name, args = call.get("name"), call.get("arguments")
                    if type(args) is dict and type(name) is str:
                        failure = _check_call(compiled.first, name, args, ctx)
                        return VALID if failure is None else _verdict(failure)
            elif is_well_formed(calls):
                failure = compiled.run(calls, ctx, "bfcl")
                return VALID if failure is None else _verdict(failure)
        except Exception as exc:  # noqa: BLE001 — as in check_calls
            return _crashed(exc)
    dispatch = case.extra.get("original_id") if case.category == "format_sensitivity" else None
    return check_calls(case.functions, case.ground_truth, _grading_category(case), calls, mode, dispatch=dispatch,
                       underscore_to_dot=underscore_to_dot, equivalence=equivalence)
