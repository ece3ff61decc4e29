"""One hostile client must not hold the proxy for the others (issue 28 item 1): while it sends the inputs that
made two packaged profiles' perturbers scan in quadratic time (64 KiB of "a+" through `noisy` took 7.5 s, an
80 KB description through `meta-paraphrase-target` 4.6 s, with `/healthz` waiting as long), another client's
`/healthz` keeps a p99 under 100 ms, and the hostile requests themselves are answered. The event-loop lag
histogram that would show such a stall is exported, and it does record a held loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import openai

from tests.support import metric_samples, metric_value
from toolquake.proxy.server.metrics import Metrics

KIB = 1024
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "The city."}}}}},
         {"type": "function", "function": {"name": "find_book", "description": "Find a book by its title.",
                                           "parameters": {"type": "object", "properties": {
                                               "title": {"type": "string"}}}}}]


def hostile_requests() -> list[tuple[str, list[dict], list[dict]]]:
    """(profile, messages, tools): the two reproduced attacks at their reported sizes, and their neighbours."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]

    def described(text: str) -> list[dict]:
        return [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": text}}, TOOLS[1]]

    return [
        ("noisy", [{"role": "user", "content": "a+" * (32 * KIB)}], TOOLS),
        ("meta-paraphrase-target", user, described("Get it" + " " * (80 * 1000) + "(unclosed")),
        ("noisy", [{"role": "user", "content": "\u201c" * (64 * KIB)}], TOOLS),
        ("noisy", [{"role": "user", "content": "x-" * (32 * KIB) + "@a"}], TOOLS),
        ("meta-paraphrase-target", user, described("a " * (40 * KIB))),
        ("noisy", [{"role": "user", "content": "a+" * (32 * KIB)}], TOOLS),
    ]


POLLS = 50  # the other client's /healthz polls a p99 is read from, at least (the attack is repeated until then)


def test_a_hostile_client_does_not_hold_the_loop_for_the_others(proxy_factory):
    proxy = proxy_factory()
    answered: list[str] = []
    errors: list[BaseException] = []
    rounds: list[int] = []  # the hostile requests sent over again until the other client polled enough
    latencies: list[float] = []

    def attack() -> None:
        client = openai.OpenAI(api_key="sk-test", max_retries=0, timeout=60.0)
        try:
            while True:
                for profile, messages, tools in hostile_requests():
                    client.base_url = f"{proxy.url}/p/{profile}/v1"
                    answer = client.chat.completions.create(model="fake-model", messages=messages, tools=tools)
                    answered.append(answer.choices[0].finish_reason)
                rounds.append(len(rounds))
                # a fast machine answers them all before a p99 can be read: again, while time allows
                if len(latencies) >= POLLS or time.monotonic() - t_start > 20:
                    break
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    warm = openai.OpenAI(api_key="sk-test", max_retries=0, timeout=60.0)
    for profile in ("noisy", "meta-paraphrase-target"):  # what a first request loads is not what is measured
        warm.base_url = f"{proxy.url}/p/{profile}/v1"
        warm.chat.completions.create(model="fake-model", tools=TOOLS,
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    with httpx.Client(base_url=proxy.url, timeout=30.0) as health:
        health.get("/healthz")
        attacker = threading.Thread(target=attack, daemon=True)
        t_start = time.monotonic()
        attacker.start()
        while attacker.is_alive() and time.monotonic() - t_start < 50:
            t0 = time.perf_counter()
            assert health.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
        attacker.join(5)
    assert not errors, errors
    assert rounds and len(answered) == len(rounds) * len(hostile_requests()), \
        "the hostile requests were not all answered within 50 s"
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    assert len(latencies) >= 20, latencies
    assert p99 < 0.1, f"/healthz p99 {p99 * 1000:.0f} ms over {len(latencies)} polls (max {latencies[-1]:.2f} s)"

    text = httpx.get(f"{proxy.url}/metrics").text
    samples = metric_samples(text)
    assert ("toolquake_event_loop_lag_seconds_bucket", (("le", "30.0"),)) in samples, "no lag histogram"
    assert metric_value(text, "toolquake_event_loop_lag_seconds_count") >= 1
    # every hostile request went through its perturber (none failed open on the way)
    assert metric_value(text, "toolquake_perturbation_failures_total") == 0


async def test_the_lag_histogram_records_a_held_loop():
    """The probe's own histogram, on a real event loop: a loop held for 0.6 s shows up as one timer at least
    0.3 s late; a loop left alone shows timers well under that."""
    metrics = Metrics()
    probe = asyncio.get_running_loop().create_task(metrics.watch_loop_lag(0.05))
    await asyncio.sleep(0.3)
    time.sleep(0.6)  # holds the loop, as a CPU-bound perturber on it would
    await asyncio.sleep(0.2)
    probe.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await probe
    text = metrics.exposition().decode()
    late = metric_value(text, "toolquake_event_loop_lag_seconds_count") - metric_value(
        text, "toolquake_event_loop_lag_seconds_bucket", le="0.25")
    assert late >= 1, text
    assert metric_value(text, "toolquake_event_loop_lag_seconds_sum") >= 0.3
    assert probe.cancelled()
