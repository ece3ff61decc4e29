"""What the tracing tests share: an OTLP/HTTP collector of their own that decodes and keeps the spans
(tests/bench/otlp_sink.py's app, served from a thread of the test process on a port the kernel picked), the
spans it got of some traces (waited for), a port where nothing listens, the ports an external server (Arize
Phoenix) bound when told port 0, and how the CPU time of reading hostile input grows with its size."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import uvicorn

from tests.bench import otlp_sink
from tests.support.processes import START_TIMEOUT_S
from tests.support.waiting import wait_for


class Sink:
    """A running collector: `url` (POST `url + "/v1/traces"`), `spans()` what it decoded so far."""

    def __init__(self, url: str) -> None:
        self.url = url

    def spans(self) -> list[dict]:
        # the app keeps the spans of every sink of this process in one list (the last 10,000): a test reads its
        # own by their trace ids
        return list(otlp_sink.TAKEN.get("spans", []))


@contextmanager
def running_sink() -> Iterator[Sink]:
    """tests/bench/otlp_sink.py's collector (decoding) on 127.0.0.1, port 0, in a thread of this process."""
    otlp_sink.DECODE = True
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(otlp_sink.app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="otlp-sink")
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), START_TIMEOUT_S, "the OTLP sink to start")
        assert server.started, "the OTLP sink's thread ended before it served"
        yield Sink(f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def sink() -> Iterator[Sink]:
    """An OTLP/HTTP collector of the test's own that decodes and keeps the spans (one for the module: tests tell
    their spans apart by trace id)."""
    with running_sink() as running:
        yield running


def sink_spans(sink: Sink, trace_ids: set[str], at_least: int, timeout: float = 60.0) -> list[dict]:
    """The spans the collector got of these traces, once it has at least `at_least` of them (AssertionError after
    `timeout` seconds: a bound on a hang, not a measure of speed)."""
    def enough() -> list[dict] | None:
        spans = [s for s in sink.spans() if s["trace_id"] in trace_ids]
        return spans if len(spans) >= at_least else None

    return wait_for(enough, timeout, f"{at_least} span(s) of {len(trace_ids)} trace(s) at the collector")








#: `per_byte_growth` from an input to one 32 times as large: about 1 for linear work (less where fixed costs weigh
#: more at the small size; up to 4.5 seen where the large input's copies are fresh pages the kernel maps in, each
#: a page fault), 32 for quadratic work; the bound sits between, whatever the machine's speed
SIZES = (1 << 16, 1 << 21)
LINEAR_GROWTH = 8.0


def per_byte_growth(make: Callable[[int], Callable[[], object]], small: int, large: int, repeat: int = 3) -> float:
    """How many times more CPU a byte of input costs at `large` bytes than at `small`: `make(n)` builds an input of
    about n bytes and returns what reads it (only that is timed), timed by this thread's CPU clock (neither the
    machine's load nor the process's other threads count), the least of `repeat` calls of each."""
    per_byte = []
    for n in (small, large):
        run = make(n)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.thread_time()
            run()
            best = min(best, time.thread_time() - t0)
        per_byte.append(max(best, 1e-9) / n)
    return per_byte[1] / per_byte[0]
