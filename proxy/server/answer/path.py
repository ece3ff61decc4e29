"""The answer path of a model route: the steps in their order, the plan of each answer, and which way the
answer goes to the client (a whole answer, a relayed stream, a stream read whole and rewritten, or a stream
a step writes as its events arrive)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolquake.proxy.server.answer.base import NOTHING, AnswerStep, Plan, make_plan
from toolquake.proxy.server.answer.conformance import Conformance
from toolquake.proxy.server.answer.injected import InjectedCalls
from toolquake.proxy.server.answer.plain import Plain, plain_answer
from toolquake.proxy.server.answer.repair import Repair
from toolquake.proxy.server.answer.restore import Restore
from toolquake.proxy.server.answer.streams import Relay, Rewritten, Uninspected
from toolquake.proxy.server.answer.text_through import TextThroughStep
from toolquake.proxy.server.answer.trace import Trace
from toolquake.proxy.server.errors import ProxyError
from toolquake.proxy.server.upstream import AnswerTooLarge

if TYPE_CHECKING:
    from litestar.response import Stream

    from toolquake.proxy.server.state import Asked, ProxyState, Served
    from toolquake.proxy.server.upstream import UpstreamResponse

#: every answer step, in the order they run: a repair reads the text before a restore turns text back into
#: calls, and calls to added tools are judged on the answer as the client would get it; the trace reads the answer
#: the client got
STEPS: tuple[type[AnswerStep], ...] = (Repair, Restore, InjectedCalls, TextThroughStep, Conformance, Trace)


class AnswerPath:
    def __init__(self, st: ProxyState, steps: tuple[type[AnswerStep], ...] = STEPS) -> None:
        self.st = st
        self.steps = tuple(cls(st) for cls in steps)

    async def serve(self, asked: Asked, served: Served, upstream: UpstreamResponse) -> Plain | Stream:
        """The upstream's answer (its status and headers arrived) on its way to the client."""
        plan = make_plan(self.steps, asked, served)
        if asked.stream and 200 <= upstream.status_code < 300 \
                and "text/event-stream" in upstream.header("content-type"):
            if plan.check is not None:  # no whole answer to check: the step reads the bytes relayed
                plan.bytes.append(plan.check)
            if plan.bytes and served.trace is not None:  # the span waits for the checks after the last byte
                served.trace.hold()
            if plan.events is not None:
                return plan.events.on_stream(self, asked, served, upstream, plan)
            if plan.whole:
                try:
                    return (await Rewritten(self, asked, served, upstream, plan).prepare()).response()
                except ProxyError:  # answered with an error instead: the span held for the checks ends with it
                    if plan.bytes and served.trace is not None:
                        served.trace.release()
                    raise
            return Relay(self, asked, served, upstream, plan).response()
        try:
            return await plain_answer(self, asked, served, upstream, plan)
        except AnswerTooLarge as big:  # no step must change it: relayed as it comes, read by none
            return Uninspected(self, asked, served, upstream, NOTHING, big.head).response()

    async def rewrite(self, asked: Asked, served: Served, plan: Plan, wire: dict[str, Any]) -> dict[str, Any]:
        """The complete answer through the steps that need it whole, then those that read it; the answer to
        send, in wire form (`wire` itself when no step changed it)."""
        api = asked.api
        assert api is not None
        internal = api.answer_to_internal(wire)
        changed = False
        for step in plan.whole:
            new = await step.on_answer(asked, served, internal)
            if new is not None:
                internal, changed = new, True
        served.response = internal = await self.read(asked, served, plan, internal)
        if not changed:
            return wire
        sent = api.answer_to_wire(internal, wire)
        if served.trace is not None:  # the id the client got (a Responses answer keeps its first answer's id)
            served.trace.client_got(sent)
        return sent

    async def read(self, asked: Asked, served: Served, plan: Plan, answer: dict[str, Any]) -> dict[str, Any]:
        """The final answer through the steps that read it (what they return is what observers get)."""
        for step in plan.answer:
            new = await step.on_answer(asked, served, answer)
            if new is not None:
                answer = new
        return answer

    async def after_bytes(self, asked: Asked, served: Served, plan: Plan, relayed: bytes) -> None:
        try:
            for step in plan.bytes:
                await step.on_bytes(asked, served, relayed)
        finally:
            if served.trace is not None:
                served.trace.release()
