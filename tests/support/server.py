"""What several tests of the proxy server share: reading a proxy's JSON log lines, reaching every worker of a
`--workers N` proxy, the runtime gauges a fault must leave at rest, a response-rewriting test perturber, a port that
refuses connections, and the hostile client of test_hostile_latency (its benchmark measures the same attack)."""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

import httpx
import openai
from hypothesis import HealthCheck, settings

from tests.support.metrics import metric_value
from tests.support.processes import Proc
from tests.support.waiting import wait_for
from toolquake.perturbers import ChatRequest, PerturbContext, Perturber, register

#: hypothesis settings for the property tests of the hot path: a loaded machine is slow, not wrong (no deadline per
#: example, no health check on how fast inputs are generated)
LOADED_MACHINE = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def log_events(proc: Proc) -> list[dict]:
    """The JSON objects of `proc`'s output, in order (other lines skipped)."""
    events = []
    for line in proc.output().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def worker_pids(proc: Proc) -> list[int]:
    (started,) = [e for e in log_events(proc) if e.get("event") == "workers_started"]
    return started["pids"]


def served_by(proc: Proc, request_ids: list[str]) -> dict[str, int]:
    """request id -> pid of the worker that logged it."""
    wanted = set(request_ids)
    return {e["request_id"]: e["worker"] for e in log_events(proc)
            if e.get("event") == "request" and e.get("request_id") in wanted}


def on_every_worker(proc: Proc, send: Callable[[], httpx.Response], per_worker: int = 3,
                    limit: int = 300) -> dict[int, list[httpx.Response]]:
    """Call send() (each call a new connection) until every worker answered at least `per_worker` times."""
    pids = worker_pids(proc)
    answers: list[httpx.Response] = []
    by_worker: dict[int, list[httpx.Response]] = {}

    def group() -> dict[int, list[httpx.Response]]:
        ids = served_by(proc, [r.headers["x-toolquake-request-id"] for r in answers])
        out: dict[int, list[httpx.Response]] = {}
        for r in answers:
            out.setdefault(ids.get(r.headers["x-toolquake-request-id"], 0), []).append(r)
        return out

    for _ in range(limit):
        answers.append(send())
        if len(answers) % 10 == 0 or len(answers) == limit:
            by_worker = group()
            if all(len(by_worker.get(pid, [])) >= per_worker for pid in pids):
                # a stream's log line is written after its last byte: wait until every answer was logged
                def logged() -> dict[int, list[httpx.Response]] | None:
                    grouped = group()
                    return None if 0 in grouped else grouped

                return wait_for(logged, timeout=5, what="every request to be logged by a worker")
    raise AssertionError(f"{limit} requests did not reach every worker: {({k: len(v) for k, v in by_worker.items()})}")


def runtime(url: str) -> tuple[float, float, float]:
    """(active upstream connections, event-loop tasks, requests in flight) of the proxy at `url`."""
    text = httpx.get(f"{url}/metrics").text
    return (metric_value(text, "toolquake_upstream_connections", state="active"),
            metric_value(text, "toolquake_event_loop_tasks"),
            metric_value(text, "toolquake_in_flight_requests"))


def logged_requests(proc: Proc) -> int:
    """How many `request` lines `proc` logged (a request is logged when it is counted, before it leaves the
    in-flight gauge)."""
    return sum(1 for e in log_events(proc) if e.get("event") == "request")


@register
class Tagger(Perturber):
    """Changes no request; appends its `tag` to the answer's `trail` when it restores it."""

    name = "test_hot_path_tagger"
    rewrites_response = True
    tag: str = ""

    def apply(self, request: ChatRequest, ctx: PerturbContext) -> ChatRequest:
        return request

    def restore(self, response: dict, ctx: PerturbContext) -> dict:
        return {**response, "trail": [*response.get("trail", []), self.tag]}




KIB = 1024
#: the two tools of the hostile requests (one of them gets the hostile description)
HOSTILE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "The city."}}}}},
    {"type": "function", "function": {"name": "find_book", "description": "Find a book by its title.",
                                      "parameters": {"type": "object", "properties": {
                                          "title": {"type": "string"}}}}}]


def hostile_requests() -> list[tuple[str, list[dict], list[dict]]]:
    """(profile, messages, tools): the two reproduced attacks at their reported sizes, and their neighbours."""
    user = [{"role": "user", "content": "What is the weather in Paris?"}]

    def described(text: str) -> list[dict]:
        weather = HOSTILE_TOOLS[0]
        return [{**weather, "function": {**weather["function"], "description": text}}, HOSTILE_TOOLS[1]]

    return [
        ("noisy", [{"role": "user", "content": "a+" * (32 * KIB)}], HOSTILE_TOOLS),
        ("meta-paraphrase-target", user, described("Get it" + " " * (80 * 1000) + "(unclosed")),
        ("noisy", [{"role": "user", "content": "\u201c" * (64 * KIB)}], HOSTILE_TOOLS),
        ("noisy", [{"role": "user", "content": "x-" * (32 * KIB) + "@a"}], HOSTILE_TOOLS),
        ("meta-paraphrase-target", user, described("a " * (40 * KIB))),
        ("noisy", [{"role": "user", "content": "a+" * (32 * KIB)}], HOSTILE_TOOLS),
    ]


def hostile_attack(proxy_url: str, polls: int = 50, limit_s: float = 50.0) -> dict:
    """The hostile requests (over again until the other client polled `polls` times, for up to `limit_s`) while
    another client polls `/healthz`: {"answered": finish reasons, "rounds", "errors", "statuses": of the polls,
    "latencies": seconds of each poll}."""
    answered: list[str] = []
    errors: list[BaseException] = []
    rounds: list[int] = []
    statuses: list[int] = []
    latencies: list[float] = []

    def attack() -> None:
        client = openai.OpenAI(api_key="sk-test", max_retries=0, timeout=60.0)
        try:
            while True:
                for profile, messages, tools in hostile_requests():
                    client.base_url = f"{proxy_url}/p/{profile}/v1"
                    answer = client.chat.completions.create(model="fake-model", messages=messages, tools=tools)
                    answered.append(answer.choices[0].finish_reason)
                rounds.append(len(rounds))
                # a fast machine answers them all before the other client polled enough: again, while time allows
                if len(statuses) >= polls or time.monotonic() - t_start > limit_s / 2.5:
                    break
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    warm = openai.OpenAI(api_key="sk-test", max_retries=0, timeout=60.0)
    for profile in ("noisy", "meta-paraphrase-target"):  # what a first request loads is not what is measured
        warm.base_url = f"{proxy_url}/p/{profile}/v1"
        warm.chat.completions.create(model="fake-model", tools=HOSTILE_TOOLS,
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    with httpx.Client(base_url=proxy_url, timeout=30.0) as health:
        health.get("/healthz")
        attacker = threading.Thread(target=attack, daemon=True)
        t_start = time.monotonic()
        attacker.start()
        while attacker.is_alive() and time.monotonic() - t_start < limit_s:
            t0 = time.perf_counter()
            statuses.append(health.get("/healthz").status_code)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
        attacker.join(5)
    return {"answered": answered, "rounds": rounds, "errors": errors, "statuses": statuses, "latencies": latencies}
