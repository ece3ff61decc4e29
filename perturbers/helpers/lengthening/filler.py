"""Filler material from the BFCL corpus, so padding reads like real traffic (seed 003, challenge 3).

Each `FillerItem` is another case's user query with its ground-truth calls (first acceptable value
of every argument) and a plausible result for each call; it renders as earlier conversation turns:
`unstructured` (the user asks, the assistant answers in prose) or `structured` (the user asks, the
assistant calls tools, the tools answer in JSON, the assistant sums up). Function descriptions
serve as prose blocks for padding plain-text tool responses.

The pool is built once per process (`filler_pool(services)`), with every item's cost under the
`estimate` counter computed up front, so fitting a budget costs a sum, not a count.
"""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from toolquake.perturbers.helpers.lengthening.budget import messages_cost, text_cost

# single-turn categories whose cases have ground-truth calls
FILLER_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
                     "live_multiple", "live_parallel", "live_parallel_multiple")
SETTINGS = ("unstructured", "structured")
PROSE_SEPARATOR = "\n\n"
# a tool_call id with a fixed shape (`call_` + 4 letters + 6 digits): every id costs the same tokens
ID_PLACEHOLDER = "call_aaaa000000"
_COMPUTE = re.compile(r"calc|comput|math|sum|area|average|mean|median|probab|convert|factorial|root|"
                      r"distance|volume|interest|rate|score|count|total|estimat|predict", re.I)
_LOOKUP = re.compile(r"get|find|search|list|fetch|retriev|lookup|query|check|locat|show|view|info|detail", re.I)
_lock = threading.Lock()


@dataclass(frozen=True)
class FillerItem:
    case_id: str
    query: str
    calls: tuple[tuple[str, str], ...]     # (OpenAI-safe function name, arguments as JSON text)
    results: tuple[str, ...]               # a plausible JSON result per call
    costs: tuple[int, int]                 # estimate tokens as (unstructured, structured) turns
    said: str = ""                         # the assistant's prose answer (unstructured setting)

    def messages(self, setting: str, ids: list[str]) -> list[dict[str, Any]]:
        """The item as earlier turns of a conversation; `ids` gives one tool_call id per call."""
        if setting == "unstructured":
            return [{"role": "user", "content": self.query}, {"role": "assistant", "content": self.said}]
        calls = [{"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                 for i, (name, args) in zip(ids, self.calls)]
        out: list[dict[str, Any]] = [{"role": "user", "content": self.query},
                                     {"role": "assistant", "content": None, "tool_calls": calls}]
        out += [{"role": "tool", "tool_call_id": i, "content": result} for i, result in zip(ids, self.results)]
        names = ", ".join(dict.fromkeys(name for name, _ in self.calls))
        out.append({"role": "assistant", "content": f"Here are the results from {names}: "
                                                    + "; ".join(self.results)})
        return out


class FillerPool:
    def __init__(self, items: list[FillerItem], prose: list[tuple[str, int]]) -> None:
        if not items:
            raise LookupError("the filler pool is empty")
        self.items = items
        #: (paragraph, estimate cost including its separator), for padding plain-text content
        self.prose = prose

    @classmethod
    def from_corpus(cls) -> FillerPool:
        """Build the pool from the BFCL corpus (FileNotFoundError/CorpusError when it is not pulled)."""
        from toolquake.bfcl.corpus import load_cases

        items: list[FillerItem] = []
        prose: dict[str, None] = {}
        for case in load_cases(FILLER_CATEGORIES):
            for fn in case.functions:
                desc = (fn.get("description") or "").strip()
                if len(desc) >= 40:
                    prose[desc] = None
            item = _item(case)
            if item is not None:
                items.append(item)
        return cls(items, [(p, text_cost(p + PROSE_SEPARATOR)) for p in prose])


def filler_pool(services: Any) -> FillerPool:
    """The process-wide pool (built on first use; one build even when threads race)."""
    with _lock:
        return services.get("filler_pool", FillerPool.from_corpus)


def _item(case: Any) -> FillerItem | None:
    if not case.ground_truth or len(case.turns) != 1:
        return None
    users = [m for m in case.turns[0] if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not users or not users[-1]["content"].strip() or len(users[-1]["content"]) > 2000:
        return None
    rng = random.Random(case.id)
    calls, results = [], []
    for call in case.ground_truth:
        for name, params in call.items():
            args = {}
            for param, options in params.items():
                chosen = next((o for o in options if o != ""), None)
                if chosen is not None:
                    args[param] = chosen
            safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
            calls.append((safe, json.dumps(args, ensure_ascii=False)))
            results.append(json.dumps(_result(name, args, rng), ensure_ascii=False))
    if not calls:
        return None
    said = "Done: " + "; ".join(f"{name}({_args_text(args)}) returned {result}"
                                for (name, args), result in zip(calls, results)) + "."
    item = FillerItem(case.id, users[-1]["content"], tuple(calls), tuple(results), (0, 0), said)
    ids = [ID_PLACEHOLDER] * len(calls)
    costs = tuple(messages_cost(item.messages(s, ids)) for s in SETTINGS)
    return FillerItem(item.case_id, item.query, item.calls, item.results, costs, said)  # type: ignore[arg-type]


def _result(name: str, args: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A plausible answer: a number for computations, a record for look-ups, a status for actions."""
    short = name.rsplit(".", 1)[-1]
    if _COMPUTE.search(short):
        return {"result": round(rng.uniform(1, 1000), 2)}
    if _LOOKUP.search(short):
        record = {k: v for k, v in args.items() if isinstance(v, (str, int, float))}
        record["id"] = f"{rng.getrandbits(32):08x}"
        return {"status": "success", "data": record}
    return {"status": "success", "message": f"{short.replace('_', ' ')} completed"}


def _args_text(args_json: str) -> str:
    args = json.loads(args_json)
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
