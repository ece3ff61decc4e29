"""Text-through streaming: when the only step that rewrites the answer declares `streams_text` (format
rewriting), the answer's plain text reaches the client as it arrives, up to what the step releases (text
that cannot become a call any more); at the end the whole answer is restored and the rest sent: the
remaining text, or the calls the text turned into. Each API says how (`Api.text_through`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from toolquake.proxy.server.answer.base import EVENTS, AnswerStep
from toolquake.proxy.server.answer.streams import StreamWriter
from toolquake.proxy.server.pipeline import restore
from toolquake.proxy.server.upstream import UpstreamError

if TYPE_CHECKING:
    from litestar.response import Stream

    from toolquake.proxy.server.answer.base import Plan
    from toolquake.proxy.server.answer.path import AnswerPath
    from toolquake.proxy.server.state import Asked, Served
    from toolquake.proxy.server.upstream import UpstreamResponse


class TextThroughStep(AnswerStep):
    name = "text_through"

    def needs(self, asked: Asked, served: Served) -> str | None:
        outcome = served.outcome
        if outcome is None or len(outcome.restorers) != 1:
            return None
        if outcome.injected and asked.profile is not None and asked.profile.spec.injected_calls == "answer":
            return None  # the calls to added tools are answered by the proxy: the whole answer is needed
        return EVENTS if outcome.restorers[0][0].streams_text else None

    def on_stream(self, path: AnswerPath, asked: Asked, served: Served, upstream: UpstreamResponse,
                  plan: Plan) -> Stream:
        return TextThroughStream(path, asked, served, upstream, plan).response()


class TextThroughStream(StreamWriter):
    """The client's stream written as the upstream's events arrive (the step's `on_stream`)."""

    async def frames(self) -> AsyncIterator[bytes]:
        served, api = self.served, self.asked.api
        assert served.outcome is not None and api is not None
        perturber, pctx = served.outcome.restorers[0]
        through, raw = api.text_through(), []
        room = self.path.st.config.server.max_answer_bytes
        try:
            async for data in self.upstream.aiter_raw():
                room -= len(data)
                if room < 0:  # the restore needs it whole: past the bound the client gets an error, in-band
                    yield self.too_large()
                    return
                raw.append(data)
                through.feed(data)
                text = through.text
                out = through.release(perturber.stream_release(text, pctx)) if text else b""
                if out:
                    self.first_byte()
                    yield out
            whole = self.body = b"".join(raw)
            native = through.answer(whole)
            if native is None or not any(x in whole for x in api.end_markers):
                yield self.unfinished(native is None)
                return
            restored, failed = restore(served.outcome, api.answer_to_internal(native))
            self.m.count_restore_failures(failed)
            served.response = restored
            for frame in through.finish(api.answer_to_wire(restored, native)):
                self.first_byte()
                yield frame
        except UpstreamError as exc:
            yield self.failed(exc)
        finally:
            await self.closed()
