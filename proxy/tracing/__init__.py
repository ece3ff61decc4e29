"""OpenTelemetry traces of toolquake's own (`[tracing]`, docs/tracing.md), a wing attached to the server from the
outside: `create_app(config, extensions=[tracing.attach, live.attach, ...])`. The server never imports it; its
request path calls the `hooks.Tracer` / `hooks.TraceHooks` interface (proxy/server/hooks.py), which the tracer
here implements. `toolquake serve` and the replay's in-process proxy attach it only with `[tracing] enabled`:
otherwise nothing of it is imported.

`tracer.py`: the tracer (`Tracing`) and a request's trace (`RequestTrace`); `spans.py`: the span record, the W3C
trace context, the sampler and the exporter; `otlp.py`: the OTLP/protobuf encoding the exporter sends.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from litestar import Litestar

    from toolquake.proxy.server.config import Config
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.server.state import ProxyState
    from toolquake.proxy.tracing.tracer import Tracing


def make_tracer(config: Config, metrics: Metrics | None = None) -> Tracing:
    """A tracer of `config`'s `[tracing]` settings; a ConfigError that says what to do when it cannot be made (a
    bad OTEL_* setting). Without `metrics`: its own registry (replay, sweep, or only checking the settings)."""
    from toolquake.proxy.server.metrics import Metrics
    from toolquake.proxy.tracing.tracer import Tracing

    return Tracing(config.tracing, metrics or Metrics(), config.server.upstream)


def attach(app: Litestar, st: ProxyState) -> Tracing:
    """The server extension: `st.tracing` becomes this wing's tracer, started with the app (in each worker, after
    the fork: the exporter sends from its event loop) and shut down with it. Attach it before `live.attach`
    (which gives it the redactor when spans carry contents); its shutdown runs after live scoring's (whose
    verdicts end the spans they held)."""
    tracing = st.tracing = make_tracer(st.config, st.metrics)

    async def startup() -> None:
        tracing.start(asyncio.get_running_loop())

    app.on_startup.append(startup)
    app.on_shutdown.append(tracing.ashutdown)
    return tracing
