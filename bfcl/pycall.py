"""Python call syntax in model text (`[f(a=1), g(b='x')]`), parsed in one place for every reader.

BFCL's decoder (`decode.decode_python`), format rewriting (`perturbers/helpers/callformat_parse.py`: calls
without list brackets, calls inside prose) and the conformance check of calls left in an answer's text
(`proxy/server/conformance/content.py`) all read calls through this module. Python's own parser builds the
syntax tree; nothing is ever evaluated.

* where the calls are: `expression_calls` (one expression: a call, or a list/tuple/set of calls),
  `statement_calls` (calls written one statement each), `call_spans` (each `name(…)` inside prose);
* what a call is named: `call_name` (BFCL's: the attribute chain), `dotted_name` (None unless the callee is a
  dotted name);
* what its values are: `bfcl_call` / `bfcl_value` (BFCL's value resolution, the arithmetic it computes with
  `eval` computed over literal operands only, refusing results that would be huge).

Failures raise `SyntaxError` (the parser) or a `ValueError`; readers turn them into their own verdicts.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, Iterator


class _Unsupported(ValueError):
    pass


# --- where the calls are --------------------------------------------------------------------------

_SEQUENCES = (ast.List, ast.Tuple, ast.Set)


def expression_calls(source: str, containers: tuple[type[ast.expr], ...] = _SEQUENCES,
                     bare: bool = True) -> Iterator[ast.Call]:
    """The calls of `source` read as one expression: itself when it is a call (`bare`), else the elements of a
    list, tuple or set (`containers`), each of which must be a call. Raises on the first that is not, so a
    reader that converts each call as it comes fails where BFCL's decoder fails."""
    body = ast.parse(source, mode="eval").body
    if bare and isinstance(body, ast.Call):
        yield body
        return
    if not isinstance(body, containers):
        raise _Unsupported(f"expected a list of calls, got {type(body).__name__}")
    for elem in body.elts:
        if not isinstance(elem, ast.Call):
            raise _Unsupported(f"list element is not a call: {type(elem).__name__}")
        yield elem


def statement_calls(source: str) -> list[ast.expr]:
    """Calls written one per statement (a line or `;`), or as several lists: the expressions in order (the
    elements of a list or tuple statement may be anything: the reader checks). Raises unless there are at
    least two statements, each a call, a list or a tuple."""
    module = ast.parse(source, mode="exec")
    parts: list[ast.expr] = []
    for stmt in module.body:
        value = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(value, (ast.List, ast.Tuple)):
            parts.extend(value.elts)
        elif isinstance(value, ast.Call):
            parts.append(value)
        else:
            raise _Unsupported("not a sequence of calls")
    if len(module.body) < 2:
        raise _Unsupported("not several statements")
    return parts


def _balanced_end(text: str, open_at: int) -> int | None:
    """The index just past the bracket that closes the one at `open_at` (python strings skipped), or None."""
    depth, i, n = 0, open_at, len(text)
    while i < n:
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            while i < n and not text.startswith(quote, i):
                i += 2 if text[i] == "\\" else 1
            if i >= n:
                return None
            i += len(quote)
            continue
        i += 1
    return None


def call_spans(text: str, names: list[str]) -> list[tuple[str, int, int]]:
    """(name as written, start, end) of every outermost `name(…)` in prose for the given names, in order; the
    scan stops at a call that is never closed (the rest of the text is inside it)."""
    if not names:
        return []
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.])({alternatives})\s*\(")
    spans: list[tuple[str, int, int]] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() < pos:  # inside a call already taken (a nested call is an argument value)
            continue
        end = _balanced_end(text, m.end() - 1)
        if end is None:
            break
        spans.append((m.group(1), m.start(), end))
        pos = end
    return spans


# --- what a call is named -------------------------------------------------------------------------

def _name_parts(func: ast.AST) -> tuple[list[str], bool]:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    dotted = isinstance(func, ast.Name)
    if dotted:
        parts.append(func.id)  # type: ignore[attr-defined]
    return parts[::-1], dotted


def call_name(func: ast.AST) -> str:
    """BFCL's name of a callee: its attribute chain (`a.b.c`), whatever it starts from (`x[0].f` → `f`)."""
    return ".".join(_name_parts(func)[0])


def dotted_name(func: ast.AST) -> str | None:
    """The callee's name when it is a name or a dotted name (`a.b.c`), else None."""
    parts, dotted = _name_parts(func)
    return ".".join(parts) if dotted else None


# --- BFCL's values: the arithmetic BFCL evaluates (BinOp), over literal operands only ---------------

_MAX_ITEMS = 1_000_000       # longest sequence / string a BinOp may build
_MAX_INT_BITS = 1 << 16      # largest integer a BinOp may build

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
    ast.BitXor: operator.xor, ast.BitAnd: operator.and_, ast.MatMult: operator.matmul,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


def _size(x: Any) -> int:
    if isinstance(x, bool):
        return 1
    if isinstance(x, int):
        return x.bit_length() // 16
    if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(x)
    return 1


def _guard_binop(op: type, a: Any, b: Any) -> None:
    """Refuse operations whose result would be enormous (BFCL would hang or exhaust memory)."""
    ints = isinstance(a, int) and isinstance(b, int)
    if op is ast.Pow and ints and b > 0 and abs(a) > 1 and b * abs(a).bit_length() > _MAX_INT_BITS:
        raise _Unsupported("power too large")
    if op is ast.LShift and ints and b > _MAX_INT_BITS:
        raise _Unsupported("shift too large")
    if op is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and n * len(seq) > _MAX_ITEMS:
                raise _Unsupported("repetition too large")
        if ints and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
            raise _Unsupported("product too large")


def _binop(node: ast.BinOp) -> Any:
    op = type(node.op)
    left, right = _literal(node.left), _literal(node.right)
    _guard_binop(op, left, right)
    result = _BINOPS[op](left, right)
    if _size(result) > _MAX_ITEMS:
        raise _Unsupported("result too large")
    return result


def _dict(node: ast.Dict) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in zip(node.keys, node.values):
        if k is None:
            out.update(_literal(v))
        else:
            out[_literal(k)] = _literal(v)
    return out


def _boolop(node: ast.BoolOp) -> Any:
    value = _literal(node.values[0])
    for sub in node.values[1:]:
        if (isinstance(node.op, ast.And) and not value) or (isinstance(node.op, ast.Or) and value):
            return value
        value = _literal(sub)
    return value


def _compare(node: ast.Compare) -> bool:
    left = _literal(node.left)
    for op, comp in zip(node.ops, node.comparators):
        right = _literal(comp)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True


def _literal(node: ast.AST) -> Any:
    """Python semantics for a literal expression (what BFCL's eval of a BinOp computes)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        return _binop(node)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_literal(node.operand))
    if isinstance(node, ast.List):
        return _elements(node.elts)
    if isinstance(node, ast.Tuple):
        return tuple(_elements(node.elts))
    if isinstance(node, ast.Set):
        return set(_elements(node.elts))
    if isinstance(node, ast.Dict):
        return _dict(node)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else _formatted(v) for v in node.values)
    if isinstance(node, ast.Subscript):
        return _literal(node.value)[_literal(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if part is None else _literal(part) for part in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.BoolOp):
        return _boolop(node)
    if isinstance(node, ast.Compare):
        return _compare(node)
    if isinstance(node, ast.IfExp):
        return _literal(node.body) if _literal(node.test) else _literal(node.orelse)
    raise _Unsupported(f"{type(node).__name__} inside an arithmetic expression")


def _elements(nodes: list[ast.expr]) -> list[Any]:
    out: list[Any] = []
    for node in nodes:
        if isinstance(node, ast.Starred):
            out.extend(_literal(node.value))
        else:
            out.append(_literal(node))
    if len(out) > _MAX_ITEMS:
        raise _Unsupported("result too large")
    return out


_CONVERSIONS = {-1: lambda v: v, 115: str, 114: repr, 97: ascii}
_SPEC_NUMBER = re.compile(r"\d+")


def _formatted(node: ast.FormattedValue) -> str:
    value = _CONVERSIONS[node.conversion](_literal(node.value))
    spec = _literal(node.format_spec) if node.format_spec is not None else ""
    if any(len(n) > 4 for n in _SPEC_NUMBER.findall(spec)):
        raise _Unsupported("format width too large")
    return format(value, spec)


# --- BFCL's value resolution ----------------------------------------------------------------------

def bfcl_value(node: ast.AST) -> Any:
    """A call's argument value as BFCL resolves it (see docs/scoring.md): constants, lists, dicts and tuples as
    such, a name as its text, a nested call with keywords as `{name: {keyword: value}}` and without as its
    text, arithmetic computed; anything else raises."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):
        # BFCL negates the operand's constant whatever the operator: +5 → -5, not True → -1
        operand = node.operand
        if not isinstance(operand, ast.Constant):
            raise _Unsupported("unary operator on a non-constant")
        return -operand.value
    if isinstance(node, ast.List):
        return [bfcl_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise _Unsupported("** inside a dict")
            key = bfcl_value(k)
            out[key] = bfcl_value(v)
        return out
    if isinstance(node, ast.BinOp):
        return _literal(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return ast.unparse(node) if not node.keywords else _nested_call(node)
    if isinstance(node, ast.Tuple):
        return tuple(bfcl_value(e) for e in node.elts)
    if isinstance(node, ast.Subscript):
        return f"{ast.unparse(node.value)}[{ast.unparse(node.slice)}]"
    raise _Unsupported(f"unsupported syntax: {type(node).__name__}")


def _nested_call(node: ast.Call) -> dict[str, Any]:
    """A nested call value, in BFCL's shape {name: {keyword: value}} (positional arguments dropped)."""
    return {call_name(node.func): {kw.arg: bfcl_value(kw.value) for kw in node.keywords}}


def bfcl_call(node: ast.Call) -> dict[str, Any]:
    """`{"name": ..., "arguments": {...}}` as BFCL decodes a call: keyword arguments only (positional ones are
    dropped, as BFCL drops them)."""
    args: dict[Any, Any] = {}
    for kw in node.keywords:
        args[kw.arg] = bfcl_value(kw.value)
    return {"name": call_name(node.func), "arguments": args}
