"""The answer-step interface, and the plan one answer follows (docs/creating-answer-steps.md)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

if TYPE_CHECKING:
    from litestar.response import Stream

    from toolquake.proxy.server.answer.path import AnswerPath
    from toolquake.proxy.server.state import Asked, ProxyState, Served
    from toolquake.proxy.server.upstream import UpstreamResponse

T = TypeVar("T")

#: what a step needs of one answer (`AnswerStep.needs`):
#: the complete answer before the client gets any of it (the step may change it)
WHOLE = "whole"
#: the stream's events as they arrive (the step writes the client's stream; streamed answers only)
EVENTS = "events"
#: the complete answer once it is final (the step reads it, counts, records; it never changes what is sent)
ANSWER = "answer"
#: the backend's bytes as relayed, once the client has them and the request was counted
BYTES = "bytes"
#: a whole answer's bytes that nobody decodes, read in the proxy's own check that they are a JSON object
#: (`on_check`: one decode, not two; the step only reads them)
CHECK = "check"


class AnswerStep:
    """One concern of the answer path. One instance per server serves every request: what belongs to one
    request lives on its `served`, never on `self`. A step fails open: what it may fail at it catches,
    counts and logs itself, and the client still gets an answer."""

    name: ClassVar[str] = ""

    def __init__(self, st: ProxyState) -> None:
        self.st = st

    def needs(self, asked: Asked, served: Served) -> str | None:
        """What this request's answer needs of the step (WHOLE, EVENTS, ANSWER, BYTES), or None: nothing.
        Asked once the upstream answered, before any of the answer is read; keep it cheap."""
        return None

    async def on_answer(self, asked: Asked, served: Served, answer: dict[str, Any]) -> dict[str, Any] | None:
        """WHOLE, ANSWER: the complete answer, chat-shaped. Return the changed answer, or None (unchanged)."""
        return None

    def summary_enough(self, asked: Asked, served: Served) -> bool:
        """ANSWER: the step reads only a streamed answer's summary (id, model, usage, finish reasons, the calls'
        names; `Api.summarize`), so a relayed stream that no one else reads need not be assembled."""
        return False

    def on_stream(self, path: AnswerPath, asked: Asked, served: Served, upstream: UpstreamResponse,
                  plan: Plan) -> Stream:
        """EVENTS: the client's stream (a `streams.StreamWriter`'s `response()`)."""
        raise NotImplementedError

    async def on_bytes(self, asked: Asked, served: Served, relayed: bytes) -> None:
        """BYTES: the backend's answer as the client got it relayed (a stream's raw SSE body, else the JSON)."""

    def on_check(self, asked: Asked, served: Served, data: bytes) -> Any:
        """CHECK: a whole 2xx answer's bytes, before they are sent, in place of the proxy's check that they are a
        JSON object: what the step decoded (the check then looks at it: a dict passes, anything else is the
        backend's bug), or None, where the check is to decode them itself (the bytes did not decode, or the
        step read them some other way). Never raises; called at most once per answer. A step that asks for CHECK
        also reads BYTES (`on_bytes`: where another step has the check, or the answer is a stream that nobody
        decodes) and ANSWER (`on_answer`: where the answer is decoded for other steps or observers anyway)."""
        return None


class Plan:
    """The steps one answer goes through, grouped by what they need, each group in the steps' order."""

    __slots__ = ("whole", "events", "answer", "bytes", "check")

    def __init__(self) -> None:
        self.whole: list[AnswerStep] = []
        self.events: AnswerStep | None = None
        self.check: AnswerStep | None = None  # one step at most: the first that asks (`make_plan`)
        self.answer: list[AnswerStep] = []
        self.bytes: list[AnswerStep] = []

    def reads(self, asked: Asked) -> bool:
        """The answer is decoded (a stream assembled): a step or an observer reads it."""
        return asked.observed or bool(self.whole) or bool(self.answer)

    def keeps(self, asked: Asked) -> bool:
        """A relayed stream is copied as it passes: someone reads it, or its bytes, afterwards."""
        return self.reads(asked) or bool(self.bytes)


#: the plan of an answer no step needs (shared: an unperturbed request allocates none)
NOTHING = Plan()


def make_plan(steps: tuple[AnswerStep, ...], asked: Asked, served: Served) -> Plan:
    plan = NOTHING
    for step in steps:
        need = step.needs(asked, served)
        if need is None:
            continue
        if plan is NOTHING:
            plan = Plan()
        if need == EVENTS:
            if plan.events is None:
                plan.events = step
        elif need == CHECK:  # one step reads the check's decode; a second gets the bytes after the client
            if plan.check is None:
                plan.check = step
            else:
                plan.bytes.append(step)
        else:
            getattr(plan, need).append(step)
    if plan.check is not None and plan.reads(asked):  # the answer is decoded anyway: read as the client gets it
        plan.answer.append(plan.check)
        plan.check = None
    return plan


#: bytes of an answer past which assembling or checking it runs in a thread, not on the event loop
OFF_LOOP_BYTES = 256 * 1024


async def off_loop(fn: Callable[[bytes], T], data: bytes) -> T:
    """`fn(data)`: on the event loop for a small answer, in a worker thread past `OFF_LOOP_BYTES` (the loop goes on
    serving other requests meanwhile)."""
    if len(data) <= OFF_LOOP_BYTES:
        return fn(data)
    return await asyncio.to_thread(fn, data)
