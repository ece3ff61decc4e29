"""response_lengthening: pads tool responses with look-alike or real records of the same endpoint up to a budget."""

from __future__ import annotations

import json
import random
from itertools import cycle
from typing import Any, ClassVar, Iterator

from toolquake.perturbers import register
from toolquake.perturbers.base import NOT_PERTURBED, ChatRequest, NumericAxis, PerturbContext, Perturber, Services
from toolquake.perturbers.helpers.lengthening import record_bank
from toolquake.perturbers.helpers.lengthening.budget import check_position, fit, learned_ratio, slot, text_cost
from toolquake.perturbers.helpers.lengthening.records import RecordSource, find_main_array, render_array, separators_of
from toolquake.perturbers.helpers.tokens import EstimateCounter, counter_label

_TOOL_ROLES = ("tool", "function")
_ESTIMATE = EstimateCounter()
#: a stream of padding records ends after this many rejected in a row (every candidate holds a needle)
_MAX_REJECTED_IN_A_ROW = 2000


class _Target:
    """One tool message being padded: its records (JSON) or prose blocks (plain text).

    `bank` (records "endpoint"/"auto"): the real records of the message's function to pad with, then
    look-alikes once they run out; `needles` rejects records that could change the answer."""

    def __init__(self, index: int, content: str, ctx: PerturbContext, words: str,
                 bank: list[Any] | None = None, needles: record_bank.Needles | None = None,
                 rng: random.Random | None = None) -> None:
        self.index = index
        self.source: RecordSource | None = None
        self.prose: list[tuple[str, int]] = []
        self.rng = rng or ctx.rng
        self.bank, self.needles = bank, needles
        self.value: Any = None
        try:
            value = json.loads(content)
        except ValueError:
            value = None
        found = find_main_array(value) if isinstance(value, (dict, list)) else None
        if bank is not None and found is None:
            raise LookupError("no array of records (plain text, or JSON without one): no record of the endpoint fits")
        if bank is not None and found is not None:  # real records first; the look-alike source only when needed
            self.value, (self.path, records) = value, found
            self.separators = separators_of(content)
            self.originals = [json.dumps(r, ensure_ascii=False, separators=self.separators) for r in records]
            self.records, self.words = records, words
        elif isinstance(value, (dict, list)):
            # LookupError when there is no array of records
            self.source = RecordSource(value, self.rng, separators_of(content), words=words)
            self.originals = self.source.original_texts()
        else:
            from toolquake.perturbers.helpers.lengthening.filler import filler_pool

            self.prose = filler_pool(ctx.services).prose
            self.originals = [content]
        self.units: list[str] = []
        #: per drawn unit: (where it came from: "bank" | "lookalike" | "prose", records rejected before it)
        self.kinds: list[tuple[str, int]] = []

    def stream(self, rng: Any) -> Iterator[tuple[str, int]]:
        if self.value is not None:
            return self._endpoint()
        if self.source is not None:
            return self._tagged(self.source.records(), "lookalike")
        order = list(range(len(self.prose)))
        rng.shuffle(order)
        return self._tagged((self.prose[i] for i in cycle(order)), "prose")

    def _tagged(self, units: Iterator[tuple[str, int]], kind: str) -> Iterator[tuple[str, int]]:
        for unit in units:
            self.kinds.append((kind, 0))
            yield unit

    def _endpoint(self) -> Iterator[tuple[str, int]]:
        """The bank's records (in an order seeded per case and function; none of another shape), then look-alikes
        of the originals; every one passes the needle check."""
        sep = text_cost(self.separators[0].strip() or ",")
        shapes = {record_bank.shape_of(r) for r in self.records}
        order = list(self.bank or [])
        self.rng.shuffle(order)
        rejected = 0
        for record in order:
            if record_bank.shape_of(record) not in shapes:
                continue
            if self.needles is not None and self.needles.rejects(record):
                rejected += 1
                continue
            text = json.dumps(record, ensure_ascii=False, separators=self.separators)
            self.kinds.append(("bank", rejected))
            yield text, text_cost(text) + sep
        try:
            source = RecordSource(self.value, self.rng, self.separators, words=self.words)
        except LookupError:
            return
        in_a_row = 0
        for text, cost in source.records():
            if self.needles is not None and self.needles.rejects(json.loads(text)):
                rejected += 1
                in_a_row += 1
                if in_a_row >= _MAX_REJECTED_IN_A_ROW:
                    return
                continue
            in_a_row = 0
            self.kinds.append(("lookalike", rejected))
            yield text, cost

    def render(self, position: int | float, n: int) -> tuple[str, int]:
        """The content with the first n units drawn, the original(s) after `slot` of them."""
        units = self.units[:n]
        before = slot(position, n)
        ordered = units[:before] + self.originals + units[before:]
        if self.value is not None:
            return render_array(self.value, self.path, self.separators, ordered), before + 1
        if self.source is not None:
            return self.source.render(ordered), before + 1
        return "\n\n".join(ordered), before + 1

    def response_cost(self, text: str) -> int:
        """A unit's cost in the tool message's own text (budget_scope "response"), with its separator."""
        if self.value is None and self.source is None:
            return _ESTIMATE.count_text(text)  # prose blocks are joined by whitespace, which costs nothing
        sep = self.separators if self.value is not None else self.source.separators  # type: ignore[union-attr]
        return _ESTIMATE.count_text(text) + _ESTIMATE.count_text(sep[0])

    def sources(self, n: int) -> dict[str, Any]:
        """Where the first n units came from."""
        kinds = self.kinds[:n]
        bank = sum(1 for k, _ in kinds if k == "bank")
        lookalike = sum(1 for k, _ in kinds if k == "lookalike")
        if self.value is None:
            source = "lookalike" if self.source is not None else "prose"
        elif bank or (self.bank and not lookalike):
            source = "endpoint+lookalike" if lookalike else "endpoint"
        else:
            source = "lookalike"
        out: dict[str, Any] = {"message": self.index, "records_source": source,
                               "records_bank": bank, "records_lookalike": lookalike}
        if self.value is not None:
            out["records_rejected"] = kinds[-1][1] if kinds else 0
            out["bank_size"] = len(self.bank or [])
        return out


@register
class ResponseLengthening(Perturber):
    """Tool responses padded to `budget_tokens` (of the whole request, or of the padded responses), the original
    record(s) first at `position`; padding records invented (look-alikes) or real ones of the same endpoint."""

    name = "response_lengthening"
    experiment = "response_size"
    axes = ("budget_tokens", "position")
    #: the padding records come from one seeded stream, taken from its start: a larger budget keeps the records
    #: of a smaller one, in the same order, and adds more after them
    numeric_axes: ClassVar[dict[str, NumericAxis]] = {
        "response_tokens": NumericAxis("budget_tokens", "tokens in the last tool response", default_min=0,
                                       default_max=80000, default_step=500,
                                       fixed={"budget_scope": "response", "target": "last"}, needs="tool_response"),
    }
    blocking: ClassVar[bool] = True
    #: "process" pads one client's responses with what another client's tools returned: the operator decides that
    operator_only: ClassVar[frozenset[str]] = frozenset({"live_records"})
    budget_tokens: int = 20000
    #: 1-based index of the first original record, or a fraction (0.0 = first, 1.0 = last)
    position: int | float = 1
    #: "last": the last tool message; "all": every tool message (the padding is shared evenly)
    target: str = "last"
    #: "request": the budget counts the whole request; "response": only the padded tool message(s)' content
    budget_scope: str = "request"
    #: "lookalike": invented records; "endpoint": real records of the same function (record_bank); "auto": endpoint
    #: when the bank holds records of that function, else look-alikes
    records: str = "lookalike"
    #: where live traffic's real records come from (functions the corpus bank does not know): "request" — the
    #: request's own earlier tool messages only; "process" — every request this proxy process has seen (records
    #: one client's tools returned can then pad another client's responses)
    live_records: str = "request"

    def fills_token_budget(self) -> bool:
        return True

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError("budget_tokens must be positive")
        check_position(self.position)
        if self.target not in ("last", "all"):
            raise ValueError("target must be 'last' or 'all'")
        if self.budget_scope not in ("request", "response"):
            raise ValueError("budget_scope must be 'request' or 'response'")
        if self.records not in ("lookalike", "endpoint", "auto"):
            raise ValueError("records must be 'lookalike', 'endpoint' or 'auto'")
        if self.live_records not in ("request", "process"):
            raise ValueError("live_records must be 'request' or 'process'")

    def setup(self, services: Services) -> None:
        from toolquake.perturbers.helpers.lengthening.filler import filler_pool

        filler_pool(services)  # prose blocks for non-JSON responses, loaded once per process

    def _targets(self, messages: list[dict[str, Any]], wanted: list[int], ctx: PerturbContext, words: str
                 ) -> tuple[list[_Target], list[dict[str, Any]]]:
        targets, skipped = [], []
        real = self.records != "lookalike"
        if real:
            shared = self.live_records == "process"
            live = ctx.services.get("record_bank:live", record_bank.LiveBank) if shared else record_bank.LiveBank()
            live.observe(messages)
            names = record_bank.tool_names(messages)
            truth = record_bank.truth_values(ctx.case, messages)
            ctx.report["answer_check"] = ("ground truth" if truth is not None
                                          else "none: no case with ground truth (live traffic)")
        for i in wanted:
            content = messages[i]["content"]
            try:
                if not real:
                    targets.append(_Target(i, content, ctx, words))
                    continue
                tool = names.get(str(messages[i].get("tool_call_id")), "")
                corpus = ctx.services.get("record_bank:corpus", record_bank.CorpusBank.load) if tool else None
                bank = (corpus.get(tool) if corpus is not None else []) or (live.get(tool) if tool else [])
                records = record_bank.main_records(content)
                own = {record_bank.canonical(r) for r in records or ()}
                bank = [r for r in bank if record_bank.canonical(r) not in own]  # never a response's own records
                if not bank and self.records == "endpoint":
                    raise LookupError(f"the record bank holds no records of {tool or 'an unnamed tool'!r}")
                if corpus is not None and corpus.info.get("error"):
                    ctx.report["corpus_bank"] = corpus.info["error"]
                needles = None
                if truth is not None:
                    try:
                        response = json.loads(content)
                    except ValueError:
                        response = content
                    found = record_bank.Needles(truth, response, records or [])
                    ctx.report["needles"] = ctx.report.get("needles", 0) + len(found.values)
                    needles = found if found.values or found.bounds else None  # nothing to check: no check
                # the padding stream depends on the case (or request) and the function, never on the budget
                origin = getattr(ctx.case, "id", None) or ctx.perturbation_seed
                rng = random.Random(f"{origin}:{tool}:response_lengthening")
                targets.append(_Target(i, content, ctx, words, bank=bank, needles=needles, rng=rng))
            except (LookupError, OSError, RuntimeError) as exc:  # no array of records; prose without a corpus
                skipped.append({"message": i, "reason": str(exc)[:200]})
        return targets, skipped

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        counter = ctx.services.token_counter
        messages = request.messages
        targets, skipped = self._targets(messages, self._wanted(messages), ctx, _words(messages))
        ctx.report.update(counter=counter_label(counter), budget_tokens=self.budget_tokens)
        if self.budget_scope != "request" or self.records != "lookalike":
            ctx.report.update(budget_scope=self.budget_scope, records=self.records)
        if not targets:
            ctx.report.update(
                tokens_added=0, reason="no tool message with records or text to pad", skipped_messages=skipped
            )
            if self.records != "lookalike":
                ctx.report[NOT_PERTURBED] = "no tool message with records or text to pad"
            return request
        padding = _Padding(request, targets, self.position, counter, self.budget_scope == "response")
        base = padding.measure(0)
        learned = (ctx.services.get(f"response_ratio:{counter.source}", dict) if padding.response_scope
                   else learned_ratio(ctx.services, counter))
        result = fit(counter, self.budget_tokens, base, padding.costs(), padding.measure, learned=learned)
        perturbed, positions = padding.build(result.units)
        ctx.report.update(
            tokens_added=result.total - base,
            tokens_total=result.total,
            units_added=result.units,
            position=positions[-1],
            targets=len(targets),
            counts=result.counts,
        )
        if self.records != "lookalike":
            self._report_records(ctx, padding, result.units, result.total)
        if skipped:
            ctx.report["skipped_messages"] = skipped
        if result.units == 0:
            ctx.report["reason"] = "the request is already at or over the budget"
            if self.records != "lookalike":
                ctx.report[NOT_PERTURBED] = ctx.report["reason"] if not padding.response_scope else \
                    "the response is already at or over the budget, or nothing could pad it"
            return request
        return perturbed

    def _wanted(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tool messages to pad."""
        wanted = [
            i for i, m in enumerate(messages) if m.get("role") in _TOOL_ROLES and isinstance(m.get("content"), str)
        ]
        if self.records != "lookalike":  # the responses the next answer is about: none the assistant answered already
            answered = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"
                            and not m.get("tool_calls")), default=-1)
            wanted = [i for i in wanted if i > answered]
        return wanted[-1:] if self.target == "last" else wanted

    def _report_records(self, ctx: PerturbContext, padding: _Padding, units: int, total: int) -> None:
        """Where the padding records came from (records "endpoint"/"auto"), and why the budget was not reached."""
        targets = padding.targets
        detail = [t.sources(padding.drawn(k, units)) for k, t in enumerate(targets)]
        kinds = {d["records_source"] for d in detail}
        if total < self.budget_tokens * 0.98:  # fit stops short only when every stream ran dry
            ctx.report["budget_reached"] = False
            ctx.report["short_reason"] = (
                "the records ran out: the bank's are all used, and look-alikes cannot be made or were all rejected"
                if len(padding.dry) == len(targets) else "the counter's counts did not come within 2 % of the budget")
        ctx.report.update(records_source=kinds.pop() if len(kinds) == 1 else "mixed",
                          records_bank=sum(d["records_bank"] for d in detail),
                          records_lookalike=sum(d["records_lookalike"] for d in detail),
                          records_rejected=sum(d.get("records_rejected", 0) for d in detail),
                          records_detail=detail)


def _words(messages: list[dict[str, Any]]) -> str:
    """Words for look-alike names: the conversation's own prose."""
    return " ".join(
        m["content"] for m in messages if isinstance(m.get("content"), str) and m.get("role") not in _TOOL_ROLES
    )


class _Padding:
    """The tool messages being padded, as `fit` sees them: units drawn round-robin from the targets' streams (the
    padding is shared evenly between them), the request rebuilt with the first n units drawn, and its cost."""

    def __init__(self, request: ChatRequest, targets: list[_Target], position: int | float, counter: Any,
                 response_scope: bool) -> None:
        self.request, self.targets, self.position = request, targets, position
        self.counter, self.response_scope = counter, response_scope
        #: which target each drawn unit belongs to
        self.owners: list[int] = []
        #: the targets whose streams ran dry
        self.dry: set[int] = set()

    def drawn(self, k: int, n: int) -> int:
        """How many of the first n units drawn belong to target k."""
        return self.owners[:n].count(k)

    def build(self, n: int) -> tuple[ChatRequest, list[int]]:
        messages = self.request.messages
        new = list(messages)
        positions = []
        for k, t in enumerate(self.targets):
            content, pos = t.render(self.position, self.drawn(k, n))
            new[t.index] = {**messages[t.index], "content": content}
            positions.append(pos)
        return self.request.replace(messages=new), positions

    def measure(self, n: int) -> int:
        req = self.build(n)[0]
        if not self.response_scope:
            return self.counter.count_request(req.body)
        return sum(self.counter.count_text(req.messages[t.index]["content"]) for t in self.targets)

    def costs(self) -> Iterator[float]:
        targets = self.targets
        streams = {k: t.stream(t.rng) for k, t in enumerate(targets)}
        while streams:
            for k in list(streams):
                t = targets[k]
                try:
                    text, cost = next(streams[k])
                except StopIteration:  # a bank with too few records and nothing to vary
                    del streams[k]
                    self.dry.add(k)
                    continue
                t.units.append(text)
                self.owners.append(k)
                yield t.response_cost(text) if self.response_scope else cost
