"""The conformance checker's CPU per complete (not streamed) answer, the full check against the path the
proxy takes (`nothing_to_check` first, the request's tools read without building its messages), in one
process and one run: `python -m tests.bench.conformance_cost`.

Inputs are the proxy benchmark's request (three tools, ~1.2 KB) with the fake upstream's answer to it
(a call), and the same request without tools with a text answer.
"""

from __future__ import annotations

import time

import msgspec

from tests.bench.proxy_overhead import BODY
from tests.fake_upstream import choose_answer, completion
from toolquake.proxy.server import conformance

N = 20000


def full(route: str, answer: bytes, request: bytes) -> list:
    """Decode both, then check: what the proxy did before the shortcut."""
    return conformance.check(route, False, msgspec.json.decode(answer),
                             conformance.Offered.from_request(msgspec.json.decode(request)))


def proxy_path(route: str, answer: bytes, request: bytes) -> list:
    offered = conformance.Offered.from_raw(request)
    if conformance.nothing_to_check(route, answer, offered):
        return []
    return conformance.check(route, False, msgspec.json.decode(answer), offered)


def per_call_us(fn, *args) -> float:
    best = float("inf")
    for _ in range(5):  # the best of five: the least disturbed by other processes
        t = time.process_time()
        for _ in range(N):
            fn(*args)
        best = min(best, (time.process_time() - t) / N * 1e6)
    return best


def main() -> None:
    no_tools = {k: v for k, v in BODY.items() if k != "tools"}
    cases = {"tools offered, a call": BODY, "no tools, text": no_tools}
    print("| request, answer | full check | proxy path | ratio |")
    print("|---|---:|---:|---:|")
    for name, body in cases.items():
        request = msgspec.json.encode(body)
        answer = msgspec.json.encode(completion(choose_answer(body, None), "fake", "1"))
        assert full("chat_completions", answer, request) == proxy_path("chat_completions", answer, request)
        a = per_call_us(full, "chat_completions", answer, request)
        b = per_call_us(proxy_path, "chat_completions", answer, request)
        print(f"| {name} | {a:.1f} µs | {b:.1f} µs | {b / a:.2f} |")


if __name__ == "__main__":
    main()
