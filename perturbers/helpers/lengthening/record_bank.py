"""Real records of an endpoint for response_lengthening (seed 003, challenge 2), and the answer's needles.

The paper grows a tool response with more records *of the same endpoint*. Two banks hold such records,
per function name (the elements of a response's main array, as `records.find_main_array` finds them):

- the corpus bank: every ground-truth call of every BFCL multi_turn_* case executed once on BFCL's API
  simulators (`bfcl.simulators`), records deduplicated in first-seen order; built once per process and
  cached on disk (`$TOOLQUAKE_CACHE/bfcl/record-bank-<corpus version>.json`);
- the live bank: records of the tool messages the perturber sees in requests (the function named by the
  assistant tool call the message answers), bounded in memory.

`needles(case, messages, response)` are the values a padding record must not hold so that the case's
ground truth stays the right answer (see `Needles`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

BANK_FORMAT = 1
#: the live bank keeps at most this many functions, and this many records per function
LIVE_FUNCTIONS = 256
LIVE_RECORDS = 2000


def canonical(record: Any) -> str:
    """A record's identity: its JSON with sorted keys (equal records, equal text)."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False)


def main_records(content: str) -> list[Any] | None:
    """The records of a tool message's main array, or None when the content is no JSON with an array."""
    from toolquake.perturbers.helpers.lengthening.records import find_main_array

    try:
        value = json.loads(content)
    except ValueError:
        return None
    if not isinstance(value, (dict, list)):
        return None
    found = find_main_array(value)
    return None if found is None else found[1]


def shape_of(record: Any) -> Any:
    """What a padding record must share with the originals: an object's key set, else its JSON type."""
    if isinstance(record, dict):
        return ("object", tuple(sorted(record)))
    if isinstance(record, bool):
        return "bool"
    if isinstance(record, (int, float)):
        return "number"
    return type(record).__name__


# -- the corpus bank ------------------------------------------------------------------------------

def bank_path() -> Path:
    from toolquake.bfcl.corpus import CORPUS_VERSION, cache_root

    return cache_root() / "bfcl" / f"record-bank-{CORPUS_VERSION}.json"


class CorpusBank:
    """{function name: [records]} from BFCL's multi-turn ground truth run on its simulators."""

    def __init__(self, records: dict[str, list[Any]], info: dict[str, Any]) -> None:
        self.records = records
        self.info = info

    def get(self, name: str) -> list[Any]:
        return self.records.get(name, [])

    @classmethod
    def load(cls) -> CorpusBank:
        """From the disk cache, else built (and cached); an empty bank with `info["error"]` when the corpus or
        its simulators are missing (live traffic then uses the live bank only)."""
        path = bank_path()
        try:
            data = json.loads(path.read_text())
            if data.get("format") == BANK_FORMAT:
                return cls(data["records"], {**data["info"], "cached": True})
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        try:
            records, info = build_corpus_bank()
        except (OSError, RuntimeError, LookupError, ValueError) as exc:
            return cls({}, {"error": f"{type(exc).__name__}: {exc}"[:300]})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"format": BANK_FORMAT, "info": info, "records": records}, ensure_ascii=False))
            os.replace(tmp, path)
        except OSError as exc:
            info = {**info, "cache_error": str(exc)[:200]}
        return cls(records, {**info, "cached": False})


def build_corpus_bank() -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Execute the ground truth of every multi_turn_* case once; collect per function its responses' records."""
    from toolquake.bfcl.corpus import CORPUS_VERSION, MULTI_TURN_CATEGORIES, load_category
    from toolquake.bfcl.simulators import Backends, backends_root, parse_call

    backends_root()  # installed (`toolquake corpus pull --with-backends`), else BackendsMissing: never a download here
    t0 = time.perf_counter()
    seen: dict[str, dict[str, Any]] = {}
    cases = calls = 0
    with Backends() as backends:
        for category in MULTI_TURN_CATEGORIES:
            long_context = "long_context" in category or "composite" in category  # BFCL's rule
            for case in load_category(category):
                cases += 1
                world = backends.world(list(case.extra.get("involved_classes") or []),
                                       case.extra.get("initial_config") or {}, long_context)
                try:
                    for turn in case.ground_truth or []:
                        parsed = [parse_call(text) for text in turn]
                        if not parsed:
                            continue
                        calls += len(parsed)
                        for call, output in zip(parsed, world.execute(parsed)):
                            for record in main_records(output) or ():
                                seen.setdefault(call.name, {}).setdefault(canonical(record), record)
                finally:
                    world.close()
    records = {name: list(found.values()) for name, found in sorted(seen.items())}
    info = {"corpus": CORPUS_VERSION, "cases": cases, "calls": calls,
            "build_s": round(time.perf_counter() - t0, 2),
            "per_function": {name: len(r) for name, r in records.items()}}
    return records, info


# -- the live bank --------------------------------------------------------------------------------

class LiveBank:
    """Records seen in tool messages of live requests, per function name (oldest function dropped first)."""

    def __init__(self, functions: int = LIVE_FUNCTIONS, per_function: int = LIVE_RECORDS) -> None:
        self.functions = functions
        self.per_function = per_function
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, messages: list[dict[str, Any]]) -> None:
        """Take the records of every tool message whose function is named by an earlier assistant tool call."""
        names = tool_names(messages)
        for m in messages:
            name = names.get(str(m.get("tool_call_id"))) if m.get("role") == "tool" else None
            content = m.get("content")
            if name is None or not isinstance(content, str):
                continue
            records = main_records(content)
            if records:
                self.add(name, records)

    def add(self, name: str, records: Iterable[Any]) -> None:
        with self._lock:
            found = self._records.setdefault(name, {})
            self._records.move_to_end(name)
            for record in records:
                if len(found) >= self.per_function:
                    break
                found.setdefault(canonical(record), record)
            while len(self._records) > self.functions:
                self._records.popitem(last=False)

    def get(self, name: str) -> list[Any]:
        with self._lock:
            return list(self._records.get(name, {}).values())


def tool_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call id → function name, from the assistant messages' tool calls."""
    out: dict[str, str] = {}
    for m in messages:
        if m.get("role") != "assistant" or not isinstance(m.get("tool_calls"), list):
            continue
        for tc in m["tool_calls"]:
            if isinstance(tc, dict) and isinstance(tc.get("function"), dict) and tc.get("id"):
                out[str(tc["id"])] = str(tc["function"].get("name"))
    return out


# -- needles: what keeps the original answer valid ------------------------------------------------

def _norm(v: Any) -> Any:
    """Strings trimmed and case-folded, numbers by value; None for what is no needle (booleans, null)."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        s = v.strip().lower()
        return ("s", s) if s else None
    if isinstance(v, (int, float)):
        return ("n", float(v))
    return None


def leaves(v: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    """(path, value) of every scalar in a JSON value; list elements share the path step "[]"."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield from leaves(x, path + (k,))
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from leaves(x, path + ("[]",))
    else:
        yield path, v


def truth_values(case: Any, messages: list[dict[str, Any]]) -> list[Any] | None:
    """The argument values of the case's ground-truth calls (multi-turn: of the turn the request is in),
    or None when the request has no case with ground truth."""
    if case is None or not getattr(case, "ground_truth", None):
        return None
    gt = case.ground_truth
    if getattr(case, "is_multi_turn", False):
        from toolquake.bfcl.simulators import parse_call

        users = sum(1 for m in messages if m.get("role") == "user")
        seen, turn = 0, len(gt) - 1
        for t, turn_messages in enumerate(case.turns):  # a turn BFCL leaves empty gets one user message
            seen += max(1, sum(1 for m in turn_messages if m.get("role") == "user"))
            if users <= seen:
                turn = t
                break
        calls = [parse_call(text) for text in gt[turn]] if 0 <= turn < len(gt) else []
        return [v for c in calls for v in (*c.args, *c.kwargs.values())]
    if isinstance(gt, list) and all(isinstance(g, dict) for g in gt):  # single-turn: [{name: {param: [values]}}]
        return [v for g in gt for params in g.values() if isinstance(params, dict)
                for values in params.values() for v in (values if isinstance(values, list) else [values])]
    return None


class Needles:
    """Leaf values of the original response that are ground-truth argument values, and the field paths where
    such a numeric value is the minimum or maximum over the original records. A padding record is rejected
    when it holds a needle, or when on such a path its value ties or beats that extremum."""

    def __init__(self, truth: list[Any], response: Any, originals: list[Any]) -> None:
        wanted = {n for _, v in leaves(truth) if (n := _norm(v)) is not None}
        self.values = {n for _, v in leaves(response) if (n := _norm(v)) in wanted}
        numbers = {n[1] for n in self.values if n[0] == "n"}
        per_path: dict[tuple, list[float]] = {}
        for record in originals:
            for path, v in leaves(record):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    per_path.setdefault(path, []).append(float(v))
        #: path → (lowest allowed bound or None, highest allowed bound or None): values must stay strictly inside
        self.bounds: dict[tuple, tuple[float | None, float | None]] = {}
        for path, values in per_path.items():
            low, high = min(values), max(values)
            self.bounds[path] = (low if low in numbers else None, high if high in numbers else None)
        self.bounds = {p: b for p, b in self.bounds.items() if b != (None, None)}

    def rejects(self, record: Any) -> bool:
        for path, v in leaves(record):
            n = _norm(v)
            if n is not None and n in self.values:
                return True
            bound = self.bounds.get(path)
            if bound is not None and n is not None and n[0] == "n":
                low, high = bound
                if (low is not None and n[1] <= low) or (high is not None and n[1] >= high):
                    return True
        return False
