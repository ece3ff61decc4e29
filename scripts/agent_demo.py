"""`make agent-demo`: a real agent through toolquake, its own tasks recorded, replayed and scored under perturbation.

The agent is the example in examples/agent/ (the OpenAI Agents SDK on chat completions and the Responses API,
LangGraph's ReAct agent), pointed at the proxy by its base URL. On the embedded model (SmolLM2-135M-Instruct,
toolquake's own backend) or any backend (`--upstream`):

1. the agent runs its tasks unperturbed through `toolquake serve --record`;
2. `toolquake cases from-recording` turns that recording into the agent's own cases (printed for review);
3. the same tasks run again under each profile through `toolquake serve --cases`, which scores every request
   it can tie to a case (by content: the same conversation as a recorded step) into a results store;
4. one table: per profile the requests scored, the accuracy with its 95 % Wilson interval, the paired drop
   against `off` (McNemar's exact test), the tasks completed, calls to tools the proxy added, recovery after a
   failing tool, agent crashes; the live report (`toolquake report --db`, Markdown and HTML) and
   out/agent-demo/summary.json.

The statistics are the report's own on the live store (`toolquake.proxy.replay.report.summarize_db`, what
`toolquake report --db --format json` prints); the counts of added-tool calls and recoveries are the proxy's
metrics. Every child process (backend, proxies) dies with this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROFILES = "off,expanded,shuffled,fail-timeout,format-python"


class Proxy:
    """`toolquake serve` as a child process on loopback, on a port of its own choosing (`--port 0`; the port it got
    is read from its `listening` log line): its own process group, killed by the kernel if this process dies (as the
    embedded backend is, proxy/backend/local.py)."""

    def __init__(self, upstream: str, args: Sequence[str], log_path: Path) -> None:
        self.url = ""  # known once started
        self.cmd = [sys.executable, "-m", "toolquake", "serve", "--upstream", upstream, "--host", "127.0.0.1",
                    "--port", "0", "--workers", "1", *args]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> Proxy:
        from toolquake.proxy.backend.local import ListeningLine, die_with_parent_preexec

        parent = os.getpid()
        with self.log_path.open("ab") as log:
            listening = ListeningLine(self.log_path, log.tell())  # this start's lines: the log is appended to
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True,
                                            preexec_fn=lambda: die_with_parent_preexec(parent))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"toolquake serve exited with {self.process.returncode}:\n{self.tail()}")
            if not self.url:
                self.url = listening.url() or ""
            try:
                if self.url and httpx.get(f"{self.url}/healthz", timeout=2.0, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"toolquake serve did not answer within {timeout:.0f} s:\n{self.tail()}")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10.0, trust_env=False).text

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (the proxy drains: the recording written, the scoring queue emptied), SIGKILL after `timeout`."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric in a /metrics page: (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def by_profile(text: str, name: str, keep: Callable[[dict[str, str]], bool] = lambda labels: True) -> dict[str, int]:
    out: dict[str, int] = {}
    for labels, value in samples(text, name):
        if keep(labels):
            out[labels.get("profile", "")] = out.get(labels.get("profile", ""), 0) + int(value)
    return out


def recovered(labels: dict[str, str]) -> bool:
    """A verdict after a failing tool that is the right behaviour for its kind (scorers/recovery.py)."""
    from toolquake.scorers.recovery import DEFAULT_RECOVERED, RECOVERED

    return labels.get("verdict", "") in RECOVERED.get(labels.get("kind", ""), DEFAULT_RECOVERED)


SETTLED = ("toolquake_scoring_duration_seconds_count", "toolquake_tool_failure_recovery_total")


def settled_metrics(proxy: Proxy, timeout: float = 30.0) -> str:
    """The proxy's metrics page once scoring is done: its queue empty and the verdict counters unchanged between
    two reads (a job taken off the queue is still counted in its worker), or the last page after `timeout` s."""
    deadline, before = time.monotonic() + timeout, None
    while True:
        page = proxy.metrics()
        depth = samples(page, "toolquake_scoring_queue_depth")
        counts = [sorted((tuple(sorted(labels.items())), v) for labels, v in samples(page, name)) for name in SETTLED]
        if (not depth or not depth[0][1]) and counts == before or time.monotonic() > deadline:
            return page
        before = counts
        time.sleep(0.5)


@dataclass
class Demo:
    """What one run of the demo needs: the upstream (a backend's OpenAI base URL) and where to write."""

    upstream: str
    model: str
    out: Path
    profiles: list[str]
    tasks: Sequence[Any] = ()
    concurrency: int = 2
    max_tokens: int = 64
    #: extra headers on every model request (tests: the fake upstream's knobs)
    headers: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = print

    @property
    def recording(self) -> Path:
        return self.out / "recording.jsonl"

    @property
    def cases(self) -> Path:
        return self.out / "cases.jsonl"

    @property
    def db(self) -> Path:
        return self.out / "results.sqlite"

    def run_agent(self, base_url: str) -> list[Any]:
        from examples.agent.agent import run_tasks

        return asyncio.run(run_tasks(self.tasks, base_url, self.model, concurrency=self.concurrency,
                                     headers=self.headers, max_tokens=self.max_tokens))

    def record(self) -> list[Any]:
        """Step 1: the agent unperturbed through `toolquake serve --record`."""
        proxy = Proxy(self.upstream, ["--record", str(self.recording), "--results-db", "off"],
                      self.out / "proxy-record.log").start()
        try:
            outcomes = self.run_agent(f"{proxy.url}/v1")
        finally:
            proxy.stop()
        return outcomes

    def make_cases(self) -> list[dict[str, Any]]:
        """Step 2: `toolquake cases from-recording`, then `toolquake cases validate`; the cases as written."""
        made = subprocess.run([sys.executable, "-m", "toolquake", "cases", "from-recording", str(self.recording),
                               "--out", str(self.cases), "--id-prefix", "agent", "--category", "agent"],
                              capture_output=True, text=True)
        self.say(made.stderr.strip())
        if made.returncode != 0:
            raise RuntimeError(f"cases from-recording failed ({made.returncode})")
        checked = subprocess.run([sys.executable, "-m", "toolquake", "cases", "validate", str(self.cases)],
                                 capture_output=True, text=True)
        self.say((checked.stdout + checked.stderr).strip())
        return [json.loads(line) for line in self.cases.read_text().splitlines() if line.strip()]

    def perturbed(self) -> tuple[dict[str, list[Any]], str]:
        """Step 3: the tasks under every profile through `toolquake serve --cases`; the outcomes per profile and
        the proxy's metrics page after the last verdict."""
        proxy = Proxy(self.upstream, ["--cases", str(self.cases), "--results-db", str(self.db)],
                      self.out / "proxy-scored.log").start()
        runs: dict[str, list[Any]] = {}
        try:
            for name in self.profiles:
                t0 = time.monotonic()
                runs[name] = self.run_agent(f"{proxy.url}/p/{name}/v1")
                self.say(f"agent-demo: `{name}`: {sum(o.completed for o in runs[name])}/{len(runs[name])} tasks "
                         f"completed in {time.monotonic() - t0:.0f} s")
            page = settled_metrics(proxy)
        finally:
            proxy.stop()
        return runs, page

    def summary(self, first: list[Any], runs: dict[str, list[Any]], page: str) -> dict[str, Any]:
        """Step 4's numbers: the live store's summary per profile, with the agent's own outcomes and the metrics."""
        from toolquake.proxy.replay.report import summarize_db

        live = summarize_db(self.db)
        requests = by_profile(page, "toolquake_requests_total")
        injected = by_profile(page, "toolquake_injected_tool_calls_total")
        after_failure = by_profile(page, "toolquake_tool_failure_recovery_total")
        recovered_ = by_profile(page, "toolquake_tool_failure_recovery_total", recovered)
        profiles: dict[str, Any] = {}
        for name, outcomes in runs.items():
            arm = live["arms"].get(name) or {}
            paired = arm.get("paired") or {}
            profiles[name] = {
                "tasks": len(outcomes), "tasks_completed": sum(o.completed for o in outcomes),
                "answers_with_fact": sum(o.completed and o.fact_ok for o in outcomes),
                "requests": requests.get(name, 0), "scored": arm.get("n", 0), "accuracy": arm.get("accuracy"),
                "accuracy_ci": arm.get("accuracy_ci"), "drop_vs_off": arm.get("drop_vs_off"),
                "drop_vs_off_ci": arm.get("drop_vs_off_ci"), "mcnemar_p": paired.get("p_value"),
                "paired": paired.get("n"), "valid_to_invalid": paired.get("valid_to_invalid"),
                "invalid_to_valid": paired.get("invalid_to_valid"), "errors": arm.get("errors", {}),
                "not_perturbed": arm.get("not_perturbed", 0), "added_tool_calls": injected.get(name, 0),
                "after_failing_tool": after_failure.get(name, 0), "recovered": recovered_.get(name, 0),
                "crashes": sum(o.error is not None for o in outcomes),
                "runs": [o.as_dict() for o in outcomes]}
        return {"model": self.model, "upstream": self.upstream, "recorded": [o.as_dict() for o in first],
                "cases": str(self.cases), "db": str(self.db), "profiles": profiles}

    def run(self) -> dict[str, Any]:
        """Steps 1 to 4 into `out` (a fresh folder); returns the summary written to summary.json."""
        from toolquake.proxy.replay.report import build

        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.say(f"agent-demo: 1) {len(self.tasks)} tasks, unperturbed, through `toolquake serve --record "
                 f"{self.recording}`")
        first = self.record()
        self.say(outcome_table({"recorded": first}))
        self.say(f"agent-demo: 2) `toolquake cases from-recording {self.recording} --out {self.cases}`")
        cases = self.make_cases()
        if not cases:
            raise RuntimeError("the recording gave no case: the agent's requests never reached the model?")
        self.say(cases_text(cases))
        self.say(f"agent-demo: 3) the same tasks under {', '.join(self.profiles)} through `toolquake serve --cases "
                 f"{self.cases} --results-db {self.db}`")
        runs, page = self.perturbed()
        summary = self.summary(first, runs, page)
        summary["seconds"] = round(time.monotonic() - t0, 1)
        for fmt in ("md", "html"):  # `toolquake report --db`
            (self.out / f"report.{fmt}").write_text(build([], fmt, None, plots=False, db=self.db)[0])
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        self.say("agent-demo: 4) per profile (accuracy: the requests the proxy tied to a recorded case, graded "
                 "against the recorded answer; drop: paired with `off` on the same cases)")
        self.say(profile_table(summary))
        self.say("")
        self.say(outcome_table(runs))
        return summary


def _call_text(call: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v[0]!r}" if isinstance(v, list) and len(v) == 1 else f"{k}∈{v!r}"
                     for k, v in (call.get("arguments") or {}).items())
    return f"{call.get('name')}({args})"


def _last(case: dict[str, Any]) -> str:
    messages = case.get("messages") or []
    last = messages[-1] if messages else {}
    content = last.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    return f"{last.get('role')}: {' '.join(str(text).split())[:70]!r}"


def cases_text(cases: list[dict[str, Any]]) -> str:
    """The cases for review: id, the message the answer follows, what the recorded answer did."""
    lines = []
    for c in cases:
        expected = c.get("expected")
        did = "no call (a text answer)" if expected == "no call" else ", ".join(_call_text(x) for x in expected)
        lines.append(f"  {c['id']:22} {_last(c):82} → {did}")
    return "\n".join(lines)


def _table(head: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in (head, *rows))


def profile_table(summary: dict[str, Any]) -> str:
    """One row per profile."""
    from toolquake.proxy.replay.report import drop_ci, p_text, pct_ci

    head = ("profile", "requests", "scored", "accuracy [95 % CI]", "drop vs off [95 % CI]", "McNemar p",
            "tasks completed", "with the fact", "added-tool calls", "recovered / failing tool", "crashes")
    rows = []
    for name, p in summary["profiles"].items():
        rows.append((name, str(p["requests"]), str(p["scored"]), pct_ci(p["accuracy"], p["accuracy_ci"]),
                     "(baseline)" if name == "off" else drop_ci(p["drop_vs_off"], p["drop_vs_off_ci"]),
                     "–" if name == "off" else p_text(p["mcnemar_p"]), f"{p['tasks_completed']}/{p['tasks']}",
                     str(p["answers_with_fact"]), str(p["added_tool_calls"]),
                     f"{p['recovered']}/{p['after_failing_tool']}" if p["after_failing_tool"] else "–",
                     str(p["crashes"])))
    return _table(head, rows)


def outcome_table(runs: dict[str, list[Any]]) -> str:
    """Task × profile: `done` (`done+fact`: the answer carries the call's result), `miss`, `crash`."""
    names = list(runs)
    tasks = [o.task for o in runs[names[0]]] if names else []
    cell = {(name, o.task): ("crash" if o.error else ("done+fact" if o.fact_ok else "done") if o.completed else "miss")
            for name, outs in runs.items() for o in outs}
    runner = {o.task: o.runner for outs in runs.values() for o in outs}
    return (_table(("task", "runner", *names), [(t, runner[t], *(cell[(n, t)] for n in names)) for t in tasks])
            + "\n(done: the right call ran and the run ended with an answer; +fact: the answer carries the call's "
              "result; miss: the right call never ran; crash: the framework gave up)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the example agent through toolquake: record, make cases, "
                                                 "replay under profiles, score (make agent-demo).")
    parser.add_argument("--profiles", default=os.environ.get("AGENT_DEMO_PROFILES", PROFILES),
                        help=f"profiles after the recording (default {PROFILES}, env AGENT_DEMO_PROFILES)")
    parser.add_argument("--out", default=os.environ.get("AGENT_DEMO_OUT", str(ROOT / "out" / "agent-demo")),
                        help="output directory (default out/agent-demo; emptied first)")
    parser.add_argument("--upstream", help="a backend's OpenAI API base URL instead of the embedded model")
    parser.add_argument("--model", help="the model name the agent asks for (default: the embedded model's)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per model turn (default 64)")
    parser.add_argument("--parallel", type=int, default=max(1, min(os.cpu_count() or 1, 2)),
                        help="model instances of the embedded backend, one CPU thread each, and tasks run at once "
                             "(default: 2 on a machine with 2+ CPUs)")
    args = parser.parse_args(argv)

    from examples.agent.tasks import TASKS
    from scripts.demo import start_backend

    # the Agents SDK logs each run it gives up on; the tables count those runs as crashes, with the reason in
    # summary.json
    logging.getLogger("openai.agents").setLevel(logging.CRITICAL)

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    backend = None
    if args.upstream is None:
        backend = start_backend("agent-demo", out, args.parallel)
        if backend is None:
            return 1
        print(f"agent-demo: backend ready in {time.monotonic() - t0:.0f} s", flush=True)
    demo = Demo(upstream=args.upstream or backend.api_url, model=args.model or (backend.model if backend else "model"),
                out=out, profiles=[p.strip() for p in args.profiles.split(",") if p.strip()], tasks=TASKS,
                concurrency=args.parallel, max_tokens=args.max_tokens, say=lambda s: print(s, flush=True))
    try:
        summary = demo.run()
    except RuntimeError as exc:
        print(f"agent-demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if backend is not None:
            backend.stop()
            print("agent-demo: backend stopped", flush=True)
    print(f"\nagent-demo: done in {time.monotonic() - t0:.0f} s; report: {out / 'report.html'}; summary: "
          f"{out / 'summary.json'}; cases: {demo.cases}")
    # nothing scored: no request of the perturbed runs was tied to a recorded case (see the proxies' logs)
    return 0 if any(p["scored"] for p in summary["profiles"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
