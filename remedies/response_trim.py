"""response_trim: a tool response over `budget_tokens` keeps the records most related to the query, in order.

Every tool message whose content (a string) counts more than `budget_tokens` by the services' token counter (the
one `response_lengthening` pads with; the estimate when none is configured) is cut to its records most related to
the last user message: BM25 (`_lexical`) of each record's text against that message, the best first until the
budget is full, kept in their original order, and a note appended saying what was cut:
`[toolquake: N of M records left out to fit B tokens]`.

Records: the items of the JSON value's main array (`find_main_array`, as `response_lengthening` finds what to pad;
the JSON around it kept), else the content's lines (JSON Lines, text; a line longer than LINE_CHARS in pieces of
that length). Hostile sizes stay linear and bounded: JSON is decoded only up to JSON_MAX_CHARS (longer content is
read as lines), more than MAX_RECORDS records are made into about MAX_RECORDS runs of neighbours (never one string
per tiny line or item), and each record's statistics hold only the query's terms. A counter other than the
estimate is asked for the whole content, before and after (the per-record costs are the estimate's, scaled by
what it said), and the cut is made smaller when the result still counts over the budget. A cut that would not
make the content smaller leaves it as it was.

Reported (`ctx.report`): `trimmed` (tool messages cut), `tokens_before` / `tokens_after` (their content's tokens by
the counter, before and after), `records_dropped`, `budget_tokens`, `counter`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ClassVar

import msgspec

from toolquake.perturbers.helpers.lengthening.records import find_main_array, render_array, separators_of
from toolquake.perturbers.helpers.tokens import EstimateCounter, counter_label
from toolquake.perturbers.toolkit_expansion import last_user_text
from toolquake.remedies import register
from toolquake.remedies._lexical import Doc, Index, terms
from toolquake.remedies.base import ChatRequest, PerturbContext, Remedy

NOTE = "[toolquake: {dropped} of {total} records left out to fit {budget} tokens]"
#: content longer than this is read as lines, never decoded as JSON (its objects would take ten times its size)
JSON_MAX_CHARS = 2 << 20
#: records scored at most: more are grouped into this many runs of neighbours
MAX_RECORDS = 20_000
#: a text line longer than this is cut into pieces of this length, each a record
LINE_CHARS = 2000
#: characters of the last user message read as the query
QUERY_CHARS = 4000
_TOOL_ROLES = ("tool", "function")
_ESTIMATE = EstimateCounter()


def _json_records(array: list[Any], seps: tuple[str, str]) -> list[str]:
    """The array's items as texts; more than MAX_RECORDS items in runs of neighbours, each run one text."""
    size = -(-len(array) // MAX_RECORDS)
    if size == 1:
        return [json.dumps(r, ensure_ascii=False, separators=seps) for r in array]
    return [json.dumps(array[i:i + size], ensure_ascii=False, separators=seps)[1:-1]
            for i in range(0, len(array), size)]


def _text_records(content: str) -> list[str]:
    """The content's lines (each with its line break); a line longer than LINE_CHARS in pieces; content of more
    than MAX_RECORDS lines in runs of lines of at least len / MAX_RECORDS characters, so at most about MAX_RECORDS
    records. One pass: each character is looked at once."""
    least = len(content) // MAX_RECORDS
    longest = max(LINE_CHARS, 2 * least)
    out = []
    pos, n = 0, len(content)
    while pos < n:
        found = content.find("\n", pos + max(0, least - 1), pos + longest)
        end = min(n, pos + longest) if found < 0 else found + 1
        out.append(content[pos:end])
        pos = end
    return out


def split_records(content: str) -> tuple[list[str], Callable[[list[str]], str]]:
    """(the content's records as texts, a function rendering the content from some of them, in order)."""
    head = content.lstrip()[:1]
    if len(content) <= JSON_MAX_CHARS and head in ("[", "{"):
        try:
            value = msgspec.json.decode(content)
            found = find_main_array(value) if isinstance(value, (dict, list)) else None
        except (msgspec.DecodeError, RecursionError):
            found = None
        if found is not None and len(found[1]) > 1:
            path, array = found
            seps = separators_of(content)
            return _json_records(array, seps), lambda kept: render_array(value, path, seps, kept)
    return _text_records(content), "".join


@register
class ResponseTrim(Remedy):
    """Tool responses over `budget_tokens` cut to their records most related to the query, with a note."""

    name = "response_trim"
    blocking: ClassVar[bool] = True  # linear in the responses, but a large one takes a while
    budget_tokens: int = 4000

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError("budget_tokens must be positive")

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        counter: Any = ctx.services.token_counter or EstimateCounter()
        messages = request.messages if isinstance(request.body.get("messages"), list) else []
        query = frozenset(terms(last_user_text([m for m in messages if isinstance(m, dict)])[:QUERY_CHARS]))
        new = list(messages)
        trimmed = before_total = after_total = dropped_total = 0
        for i, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) and msg.get("role") in _TOOL_ROLES else None
            if not isinstance(content, str):
                continue
            before = counter.count_text(content)
            if before <= self.budget_tokens:
                continue
            cut = self._trim(content, before, query, counter)
            if cut is None:
                continue
            text, after, dropped = cut
            new[i] = {**msg, "content": text}
            trimmed += 1
            before_total += before
            after_total += after
            dropped_total += dropped
        ctx.report.update(trimmed=trimmed, tokens_before=before_total, tokens_after=after_total,
                          records_dropped=dropped_total, budget_tokens=self.budget_tokens,
                          counter=counter_label(counter))
        return request.replace(messages=new) if trimmed else request

    def _trim(self, content: str, before: int, query: frozenset[str], counter: Any) -> tuple[str, int, int] | None:
        """(the cut content, its tokens, records left out), or None when no cut makes it smaller."""
        records, render = split_records(content)
        total = len(records)
        costs = [_ESTIMATE.count_text(r) + 1 for r in records]
        scale = before / max(1, sum(costs))
        scores = Index([Doc.for_query(r, query) for r in records]).scores(query)
        ranked = sorted(range(total), key=lambda j: -scores[j])
        note_cost = _ESTIMATE.count_text(NOTE.format(dropped=total, total=total, budget=self.budget_tokens)) + 1
        target = float(self.budget_tokens)
        best: tuple[str, int, int] | None = None
        for _ in range(3):  # the estimate's costs, scaled, may still leave the counter's count over the budget
            room = target / scale - note_cost
            used = 0
            keep = []
            for j in ranked:
                if used + costs[j] <= room:
                    keep.append(j)
                    used += costs[j]
            if len(keep) == total:
                return None
            keep.sort()
            body = render([records[j] for j in keep])
            note = NOTE.format(dropped=total - len(keep), total=total, budget=self.budget_tokens)
            text = f"{body}{'' if body.endswith(chr(10)) or not body else chr(10)}{note}"
            after = counter.count_text(text)
            if after < before:
                best = (text, after, total - len(keep))
            if after <= self.budget_tokens:
                break
            target *= self.budget_tokens / after * 0.98
        return best
