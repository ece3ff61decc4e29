"""Replay: cases × profiles sent through the proxy, verdicts recorded in SQLite, resumable.

Cases are BFCL's (`--categories`) and your own (`--cases FILE`, proxy/live/usercases.py): a user case is
sent with its own tools, as written, and graded by the same checker under its `grade_as` category.

Every (case, profile) pair is one chat-completions request to `/p/<profile>/v1` with the header
`X-Toolquake-Case: <id>`, sent over real HTTP to the proxy — one started in this process on a free
loopback port (the default), or an external one (`--proxy URL`). The answer is graded by the same
code as live scoring (`toolquake.proxy.live.grader.Grader`: BFCL's verdict, `fair`, optionally
`semantic`; a step whose `expected_answer` says "no call" turns the case into an irrelevance case; an
answer a step decoded from text is graded on its strict and lenient decodes).

Exactly-once: each finished pair is one SQLite transaction keyed by (case_id, profile, trial). A rerun
with the same `--out` skips scored pairs and retries failed ones; a pair in flight when the process
was killed was never committed and is simply sent again. A request that failed on the backend's side
(refused, timed out or 500 after retries, unreadable: proxy/replay/failures.py) is scored as BFCL scores
an inference error, so it is final; one that failed on the proxy's or the network's side is retried.

Repeated trials (`--trials K`): each (case, profile) is sent K times, trial t carrying the sampling
seed `trial_sampling_seed(case_id, t)` — the same in every arm, so arms differ only by the perturbation, and
the same on a rerun, so a resumed trial asks the same question. The perturbation seed does not
depend on the trial: the K answers of an arm differ by the model's sampling only.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from toolquake.bfcl.corpus import case_request
from toolquake.bfcl.simulators import BackendError
from toolquake.perturbers import shown_params
from toolquake.proxy.live.grader import Grader
from toolquake.proxy.live.usercases import is_user_case, request_body
from toolquake.proxy.replay.errors import ReplayError
from toolquake.proxy.replay.failures import BAD_RESPONSE, NOT_COMPARABLE, Failed, post
from toolquake.proxy.replay.inproc import InProcessProxy
from toolquake.proxy.replay.multiturn import given_request, next_call_grade, replay_fields
from toolquake.proxy.replay.progress import Progress
from toolquake.proxy.replay.selection import expand_profiles, results_name, select_cases
from toolquake.proxy.replay.store import Record, ResultsFile
from toolquake.proxy.replay.tracing import ReplayTraces

CASE_HEADER = "X-Toolquake-Case"
#: this many connection failures in a row means the backend (or proxy) is down: stop, resume later
MAX_CONSECUTIVE_UNREACHABLE = 25


@dataclass
class Options:
    backend: str | None
    profiles: str
    out: Path
    config: str | None = None
    categories: list[str] = field(default_factory=lambda: ["multiple"])
    #: files of user cases (docs/own-cases.md), replayed beside the categories
    cases: list[str] = field(default_factory=list)
    limit: int | None = None
    concurrency: int = 4
    model: str | None = None
    shard: tuple[int, int] | None = None
    proxy: str | None = None
    timeout: float = 600.0
    temperature: float | None = 0.0
    trials: int = 1
    max_tokens: int | None = None
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    semantic: bool = False
    fail_open: bool = False
    progress: bool = True
    #: the in-process proxy's token counter: 'auto' (the backend's tokenizer when it has one, else the
    #: estimate with a warning), or any `[server] token_counter` value; None: the config's
    token_counter: str | None = "auto"
    #: let arms that fill a token budget (padding, lengthening) run with it counted by the estimate (refused
    #: otherwise: budgets are meant in the model's own tokens)
    allow_estimate: bool = False
    #: let arms with `paraphrase` be rephrased by the model under test (no fixed generator configured); refused
    #: otherwise: seed 001 used one fixed rephraser, so every model compared saw the same text
    self_rephrase: bool = False


@dataclass
class Summary:
    path: Path
    model: str
    arms: list[str]
    sent: int = 0
    skipped: int = 0
    #: pairs left unscored (toolquake's or the network's failures): retried on the next run
    failed: int = 0
    #: pairs whose request failed on the backend's side, scored as BFCL scores an inference error
    model_failures: int = 0
    #: pairs the backend refused for their shape (failures.REFUSALS): final, in no number
    not_comparable: int = 0
    aborted: str | None = None
    tallies: dict[str, tuple[int, int]] = field(default_factory=dict)


def trial_sampling_seed(case_id: str, trial: int) -> int:
    """The sampling seed (the request body's `seed`) sent with trial `trial` of a case (with --trials > 1): a stable
    31-bit hash of both."""
    return int.from_bytes(hashlib.sha256(f"{case_id}\0{trial}".encode()).digest()[:4], "big") >> 1


def _check_reachable(url: str, what: str, headers: dict[str, str]) -> httpx.Response:
    try:
        return httpx.get(url, timeout=10.0, headers=headers, trust_env=False)
    except httpx.HTTPError as exc:
        raise ReplayError(f"cannot reach the {what} at {url} ({type(exc).__name__}: {exc}). Start it first "
                          "(for the embedded model: `toolquake backend local`), or fix the URL.") from None


def discover_model(backend: str, headers: dict[str, str]) -> str:
    r = _check_reachable(f"{backend.rstrip('/')}/models", "backend", headers)
    if r.status_code >= 400:
        raise ReplayError(f"the backend at {backend} answered GET /models with {r.status_code}: {r.text[:200]}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(f"the backend at {backend} lists no model on GET /models: pass --model") from None


def _auth(options: Options) -> dict[str, str]:
    headers = dict(options.headers)
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    return headers


def _profile_specs(config: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each profile as replayed: mode, and each perturber with all its parameters (defaults included)."""
    from toolquake.perturbers import build

    out = {}
    for name in names:
        spec = config.profiles.get(name)
        if spec is None:
            out[name] = {"mode": "off", "perturbers": []}
            continue
        steps = [{"name": p.name, "params": shown_params(msgspec.to_builtins(build(p.name, p.params).params())),
                  "probability": p.probability} for p in spec.perturbers]
        out[name] = {"mode": spec.mode, "perturbers": steps}
        if spec.remedies:  # recorded only when there are some, so older results files resume
            out[name]["remedies"] = remedy_specs(spec.remedies)
        if spec.conversation != "played":  # recorded only when not the default, so older results files resume
            out[name]["conversation"] = spec.conversation
    return out


def remedy_specs(remedies: list[Any]) -> list[dict[str, Any]]:
    """A profile's remedies as an arm records them: each with all its parameters (defaults included)."""
    from toolquake.remedies import build

    return [{"name": r.name, "params": shown_params(msgspec.to_builtins(build(r.name, r.params).params()))}
            for r in remedies]


def given_profiles(config: Any, arms: list[str]) -> frozenset[str]:
    """The arms whose multi-turn cases are given up to their last user turn (`conversation = "given"`)."""
    return frozenset(p for p in arms if p in config.profiles and config.profiles[p].conversation == "given")


def prepare(options: Options, say: Callable[[str], None] = print) -> tuple[Any, list[str], list[Any]]:
    """Load the config, expand the profiles, select the cases: everything that can fail before sending."""
    from toolquake.proxy.server.config import ConfigError, load_config

    try:
        config = load_config(options.config or os.environ.get("TOOLQUAKE_CONFIG") or None,
                             overrides={"upstream": options.backend, "read_timeout": options.timeout,
                                        "token_counter": options.token_counter})
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None
    known = ["off", *config.profiles]
    arms = expand_profiles(options.profiles, known)
    user = load_user_cases(options.cases, say)
    if options.cases:
        # the proxy must know the user cases too: perturbers such as tool_removal read the case it resolves
        scoring = msgspec.structs.replace(config.scoring, cases=[*config.scoring.cases, *options.cases])
        config = msgspec.structs.replace(config, scoring=scoring)
    try:
        cases = select_cases(options.categories, options.limit, options.shard, user)
    except FileNotFoundError as exc:
        raise ReplayError(str(exc)) from None
    return config, arms, cases


def load_user_cases(paths: list[str], say: Callable[[str], None]) -> list[Any]:
    """The good cases of the files; each bad line is reported and left out; an unreadable file stops."""
    from toolquake.proxy.live.usercases import load_files

    loaded = load_files(paths)
    for problem in loaded.problems:
        if problem.line == 0:
            raise ReplayError(str(problem))
        say(f"replay: skipped {problem}")
    return loaded.cases


class _Sender:
    """The pairs of one run sent through the proxy by `options.concurrency` workers, each result committed as it
    comes; `MAX_CONSECUTIVE_UNREACHABLE` connection failures in a row stop the run (a rerun resumes it)."""

    def __init__(self, options: Options, proxy_url: str, client: httpx.AsyncClient, model: str,
                 in_process: InProcessProxy | None, traces: ReplayTraces | None = None,
                 given: frozenset[str] = frozenset(), say: Callable[[str], None] | None = None,
                 command: str = "replay") -> None:
        self.options, self.proxy_url, self.client, self.model = options, proxy_url, client, model
        self.in_process = in_process
        #: the profiles whose multi-turn cases are given up to their last user turn (`conversation = "given"`)
        self.given = given
        self.traces = traces
        self.grader = Grader(semantic=options.semantic)
        self.headers = _auth(options)
        self.unreachable = 0
        self.stop = asyncio.Event()
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.command = command
        #: the codes of the shape refusals already warned about (one line at the first of each)
        self.warned: set[str] = set()

    def note_refusal(self, rec: Record) -> None:
        """One warning line at the first pair the backend refused for its shape, per code."""
        if rec.error_type != NOT_COMPARABLE or not rec.warning or (rec.error_code or "") in self.warned:
            return
        self.warned.add(rec.error_code or "")
        self.say(f"{self.command}: WARNING: {rec.warning}")

    def sampling(self, case_id: str, trial: int) -> dict[str, Any]:
        """temperature, max_tokens, and with --trials > 1 the trial's sampling seed (`trial_sampling_seed`)."""
        sampling_seed = trial_sampling_seed(case_id, trial) if self.options.trials > 1 else None
        return {k: v for k, v in (("temperature", self.options.temperature), ("max_tokens", self.options.max_tokens),
                                  ("seed", sampling_seed)) if v is not None}

    async def multi_turn(self, case: Any, profile: str, trial: int, traced: dict[str, str]) -> Record:
        """A multi-turn case: a whole conversation through the proxy, scored by BFCL's multi-turn checker."""
        extra = self.sampling(case.id, trial)
        fields = await replay_fields(case, f"{self.proxy_url}/p/{profile}/v1", model=self.model, client=self.client,
                                     headers={**self.headers, **traced}, extra_body=extra,
                                     take=self.in_process.take if self.in_process is not None else None)
        return Record(case_id=case.id, profile=profile, category=case.category, trial=trial, **fields)

    async def one(self, case: Any, profile: str, trial: int) -> Record:
        """One (case, profile, trial): the request, the proxy's record of what it perturbed, the grade; under its
        own span (the case's trace) when the run is traced."""
        if self.traces is None:
            return await self._one(case, profile, trial, {})
        span, traced = self.traces.arm(case, profile, trial)
        rec = None
        try:
            rec = await self._one(case, profile, trial, traced)
            return rec
        finally:
            self.traces.done(span, case, trial, rec)

    async def _one(self, case: Any, profile: str, trial: int, traced: dict[str, str]) -> Record:
        given: dict[str, str] | None = None  # a given conversation's name map (seed 003 §3.3: one graded request)
        rec = Record(case_id=case.id, profile=profile, category=case.category, status="error", trial=trial)
        if case.is_multi_turn and profile not in self.given:
            return await self.multi_turn(case, profile, trial, traced)
        if case.is_multi_turn:
            try:
                body, given = await asyncio.to_thread(given_request, case, self.model)
            except BackendError as exc:  # the simulators failed, not the model: retried on the next run
                rec.error_code, rec.error = "backend_error", str(exc)[:500]
                return rec
        else:
            body = request_body(case, self.model) if is_user_case(case) else case_request(case, model=self.model)
        body.update(self.sampling(case.id, trial))
        t0 = time.perf_counter()
        r = await post(self.client, f"{self.proxy_url}/p/{profile}/v1/chat/completions", body,
                       {**self.headers, CASE_HEADER: case.id, **traced}, self.options.timeout,
                       self.in_process.take if self.in_process is not None else None)
        if isinstance(r, Failed) and r.http_status is None:  # no answer at all: nothing to take from the proxy
            return await self.failed(rec, case, r, None)
        rec.latency_ms = (time.perf_counter() - t0) * 1000
        rec.request_id = r.headers.get("x-toolquake-request-id") if not isinstance(r, Failed) else r.request_id
        ex = self.in_process.take(rec.request_id) if self.in_process is not None else None
        outcome = ex.outcome if ex is not None else None
        if outcome is not None:
            rec.perturbers = {"applied": [a.stored() for a in outcome.applied],
                              "skipped": list(outcome.skipped), "failed": list(outcome.failed)}
            if outcome.remedies_failed:
                rec.perturbers["remedies_failed"] = list(outcome.remedies_failed)
            if given is not None:
                hold_budgets(rec.perturbers)
        if isinstance(r, Failed):
            return await self.failed(rec, case, r, outcome, given)
        rec.http_status = r.status_code
        return await self.graded(rec, case, r, outcome, given)

    async def failed(self, rec: Record, case: Any, failed: Failed, outcome: Any,
                     given: dict[str, str] | None = None) -> Record:
        """A request that got no usable answer: scored as BFCL scores an inference error when the failure is the
        backend's (`failures.is_model_failure`), else an error row, retried on the next run."""
        rec.http_status, rec.error_code, rec.error = failed.http_status, failed.code, failed.message
        if failed.shape:  # refused for its shape: final (sending it again changes nothing), no verdict
            rec.status, rec.error_type, rec.warning = "scored", NOT_COMPARABLE, failed.shape
            return rec
        if not failed.counts:
            return rec
        if given is not None:
            return _given_scored(rec, next_call_grade(case, None, given))
        applied = list(outcome.applied) if outcome is not None else []
        return _scored(rec, self.grader.failed(case, applied))

    async def graded(self, rec: Record, case: Any, r: httpx.Response, outcome: Any,
                     given: dict[str, str] | None = None) -> Record:
        """The record of an answered request: an answer that is not a JSON object is the model's failure, else it
        is scored by the grader (a given conversation: its next call, `next_call_grade`)."""
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return await self.failed(rec, case, Failed(BAD_RESPONSE, f"the answer is not a JSON object: {r.text}"[:500],
                                                       r.status_code, counts=True), outcome, given)
        rec.answer = answer
        usage = answer.get("usage") or {}
        rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if given is not None:
            grade = await asyncio.to_thread(next_call_grade, case, answer, given)
            rec.answer = {**answer, "next_call": grade["next_call"]}
            return _given_scored(rec, grade)
        applied = list(outcome.applied) if outcome is not None else []
        restorers = list(outcome.restorers) if outcome is not None else []
        try:
            grade = await asyncio.to_thread(self.grader.grade, case, answer, applied, restorers)
        except Exception as exc:  # a scorer bug costs this pair only; it is retried on the next run
            rec.error_code, rec.error = "scorer_error", f"{type(exc).__name__}: {exc}"[:500]
            return rec
        return _scored(rec, grade)

    async def worker(self, queue: asyncio.Queue[tuple[Any, str, int]], results: ResultsFile, progress: Progress,
                     summary: Summary) -> None:
        while not self.stop.is_set():
            try:
                case, profile, trial = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rec = await self.one(case, profile, trial)
            results.record(rec)
            summary.sent += 1
            self.note_refusal(rec)
            if rec.status == "error":
                summary.failed += 1
            elif rec.error_type == NOT_COMPARABLE:
                summary.not_comparable += 1
            elif rec.error_code:
                summary.model_failures += 1
            progress.advance(profile, rec.valid if rec.status == "scored" and rec.error_type != NOT_COMPARABLE
                             else None)
            self.count_unreachable(rec, summary)

    def count_unreachable(self, rec: Record, summary: Summary) -> None:
        if rec.error_code != "unreachable":
            self.unreachable = 0
            return
        self.unreachable += 1
        if self.unreachable >= MAX_CONSECUTIVE_UNREACHABLE:
            summary.aborted = (f"{MAX_CONSECUTIVE_UNREACHABLE} requests in a row could not reach "
                               f"the proxy or backend ({rec.error}); stopped. Rerun the same command "
                               "to resume.")
            self.stop.set()


def _given_scored(rec: Record, grade: dict[str, Any]) -> Record:
    """`rec` with a given conversation's next-call verdict (`next_call_grade`): final."""
    rec.status, rec.expected = "scored", "ground_truth" if grade["next_call"]["expected_calls"] else "irrelevance"
    rec.valid, rec.error_type, rec.taxonomy = grade["valid"], grade["error_type"], grade["taxonomy"]
    rec.errors = list(grade["errors"])
    return rec


def hold_budgets(perturbers: dict[str, Any]) -> None:
    """A given conversation's graded request must hold each lengthening budget (`within_budget`, by the run's
    counter): a step whose request landed elsewhere (already over the budget, or filler that missed it) is marked
    not perturbed with why, so the pair is listed apart and left out of its arm, never scored at another length."""
    from toolquake.perturbers.base import NOT_PERTURBED
    from toolquake.perturbers.helpers.lengthening.budget import within_budget

    for step in perturbers.get("applied") or []:
        report = step.get("report") or {}
        total, budget = report.get("tokens_total"), report.get("budget_tokens")
        if NOT_PERTURBED in report or not isinstance(total, int) or not isinstance(budget, int):
            continue
        if not within_budget(total, budget):
            over = "already over" if report.get("tokens_added") == 0 and total > budget else "not within 2 % of"
            step["report"] = {**report, NOT_PERTURBED: f"the request is {total} tokens by {report.get('counter')}, "
                                                       f"{over} the budget of {budget}"}


def _scored(rec: Record, grade: Any) -> Record:
    """`rec` with the grader's verdict: final (a rerun never sends the pair again)."""
    rec.status = "scored"
    rec.expected, rec.valid = grade.expected, grade.valid
    rec.error_type, rec.taxonomy = grade.error_type, grade.taxonomy
    rec.errors, rec.fair_valid, rec.semantic_valid = list(grade.errors), grade.fair_valid, grade.semantic_valid
    return rec


async def _send_all(options: Options, proxy_url: str, pairs: list[tuple[Any, str, int]], results: ResultsFile,
                    progress: Progress, model: str, in_process: InProcessProxy | None,
                    summary: Summary, traces: ReplayTraces | None = None, given: frozenset[str] = frozenset(),
                    say: Callable[[str], None] | None = None) -> None:
    queue: asyncio.Queue[tuple[Any, str, int]] = asyncio.Queue()
    for pair in pairs:
        queue.put_nowait(pair)
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        sender = _Sender(options, proxy_url, client, model, in_process, traces, given, say)
        await asyncio.gather(*(sender.worker(queue, results, progress, summary)
                               for _ in range(max(1, options.concurrency))))


def _check_options(options: Options) -> None:
    if options.concurrency < 1:
        raise ReplayError("--concurrency must be at least 1")
    if options.trials < 1:
        raise ReplayError("--trials must be at least 1")
    if options.backend is None and options.proxy is None:
        raise ReplayError("give --backend URL (and optionally --proxy URL)")


def _reach(options: Options, headers: dict[str, str]) -> str:
    """The proxy (when --proxy) ready and the backend up, checked first for a clear error; the model's name."""
    if options.proxy:
        r = _check_reachable(f"{options.proxy.rstrip('/')}/readyz", "proxy", {})
        if r.status_code != 200:
            raise ReplayError(f"the proxy at {options.proxy} is up but not ready ({r.status_code}: {r.text[:200]}): "
                              "is its backend running?")
    model = options.model
    if options.backend:
        if model is None:
            model = discover_model(options.backend, headers)
        else:  # any HTTP answer will do: the backend is up
            _check_reachable(f"{options.backend.rstrip('/')}/models", "backend", headers)
    return model or "default"


def run(options: Options, log: Callable[[str], None] | None = None) -> Summary:
    """Check the backend, plan the pairs, send what is left, record everything; returns a summary."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    _check_options(options)
    # reachability first: a clear error before anything else happens
    model = _reach(options, _auth(options))
    config, arms, cases = prepare(options, say)
    if not cases:
        raise ReplayError("no cases selected (check --categories, --limit and --shard)")
    specs = _profile_specs(config, arms)
    _check_rephraser(options, specs)
    _check_given(options, config, arms, cases)
    budgets = budget_arms(specs)
    counter = proxy_counter(options, budgets) if options.proxy else _token_counter(config, options, say, budgets)
    if options.proxy and budgets and counter is None:
        say("replay: note: the proxy at --proxy does not say which token counter it uses (its /readyz has no "
            "token_counter): the budgets are counted by its own [server] token_counter, unchecked here")
    results = ResultsFile(Path(options.out) / results_name(options.shard))
    try:
        _start_file(results, options, specs, model, counter)
        done = results.scored_pairs()
        pairs = [(c, p, t) for t in range(options.trials) for c in cases for p in arms if (c.id, p, t) not in done]
        summary = Summary(path=results.path, model=model, arms=arms,
                          skipped=len(cases) * len(arms) * options.trials - len(pairs))
        _notes(options, config, arms, cases, say)
        times = f" × {options.trials} trials" if options.trials > 1 else ""
        say(f"replay: {len(cases)} cases × {len(arms)} profiles{times}, model {model!r}; {summary.skipped} pairs "
            f"already scored in {results.path}")
        if options.trials > 1 and not options.temperature:
            say("replay: note: --trials with temperature 0 (or none) measures only the backend's own "
                "nondeterminism; pass --temperature to sample")
        if pairs:
            _send(options, config, results, pairs, {a: len(cases) * options.trials for a in arms}, model, summary, say)
        summary.tallies = results.tallies()
        return summary
    finally:
        results.close()


def _check_given(options: Options, config: Any, arms: list[str], cases: list[Any]) -> None:
    """Given-conversation arms (seed 003 challenge 3 as the paper measures it) on multi-turn cases need the
    in-process proxy: whether the fact was placed and the budget held is read from its perturbers' reports, and a
    pair where it was not is listed apart, never scored at another length."""
    given = sorted(given_profiles(config, arms))
    if options.proxy and given and any(c.is_multi_turn for c in cases):
        raise ReplayError(
            f"{', '.join(given)}: these arms give each multi-turn conversation up to its last user turn and grade one "
            "request, which must hold its fact and its token budget; with --proxy, what that proxy's perturbers did "
            "is not visible here, so a conversation that could not be lengthened would be scored at another "
            "length. Run without --proxy (the in-process proxy), or pick the played arms "
            "(@seed003-conversations-bfcl).")


def _check_rephraser(options: Options, specs: dict[str, dict[str, Any]]) -> None:
    """Arms with a step whose text a generator model writes (`Perturber.generates_text`: a rephrased query, generated
    related tools) and that names no fixed generator model would have their text written by each model under test:
    refused unless --self-rephrase."""
    from toolquake.perturbers import build

    selfish = [p for p, spec in specs.items() for step in spec["perturbers"]
               if build(step["name"], step["params"]).generates_text() and not step["params"].get("generator_model")]
    if selfish and not options.self_rephrase:
        raise ReplayError(
            f"{', '.join(sorted(set(selfish)))}: no fixed generator model is configured, so each model under test "
            "would write its own rephrased queries or related tools (seed 001 used one fixed model, Llama3.1-70B: "
            "every model compared saw the same text). Set TOOLQUAKE_GENERATOR_URL and TOOLQUAKE_GENERATOR_MODEL (or "
            "the profile's generator_url / generator_model) to a fixed model, or pass --self-rephrase to accept "
            "self-generation; the report labels which rephraser each arm used.")


def temperature_sent(options: Options) -> str:
    """The temperature each request carries, as the results file records it (`none`: the field left out)."""
    return "none" if options.temperature is None else f"{options.temperature:g}"


def claim_temperature(results: ResultsFile, options: Options) -> None:
    """Record the temperature sent; a resume with another one is refused (its pairs would mix two samplings)."""
    stored, sent = results.meta().get("temperature"), temperature_sent(options)
    if stored is not None and stored != sent:
        raise ReplayError(f"{results.path} was sent with temperature {stored}, this run would send {sent}: use "
                          "another --out directory, or the same --temperature")
    results.set_meta({"temperature": sent})


def _start_file(results: ResultsFile, options: Options, specs: dict[str, dict[str, Any]], model: str,
                counter: str | None) -> None:
    """Claim the results file for this model and record the arms and the run's settings (a rerun must match)."""
    results.claim(model, options.backend or options.proxy or "")
    claim_temperature(results, options)
    results.register_arms(specs)
    results.set_meta({"categories": ",".join(options.categories), "cases": ",".join(options.cases),
                      "limit": str(options.limit or ""),
                      "shard": "" if options.shard is None else f"{options.shard[0]}/{options.shard[1]}"})
    trials = max(options.trials, int(results.meta().get("trials") or 1))
    results.set_meta({"trials": str(trials)})
    if counter is not None:
        results.set_meta({"token_counter": counter})


def _notes(options: Options, config: Any, arms: list[str], cases: list[Any], say: Callable[[str], None]) -> None:
    """What this run cannot see or change, said before it starts."""
    if options.proxy and any(_changes_expectation(config, p) for p in arms):
        say("replay: note: with --proxy, what the perturbers did is not visible here; arms that remove the "
            "expected tool or rewrite the answer format are graded on the client's answer only")
    if options.proxy and any(_injects_failures(config, p) for p in arms):
        say("replay: note: with --proxy, the failures tool_failure injects are not visible here: multi-turn "
            "rows get no recovery verdicts")
    if any(_injects_failures(config, p) for p in arms) and not any(_has_tool_results(c) for c in cases):
        say("replay: note: no selected case is multi-turn or holds a tool result, so the tool_failure arms "
            "(fail-*) change nothing here; select multi_turn categories (e.g. --categories multi_turn_base) "
            "or cases with tool results")


def _send(options: Options, config: Any, results: ResultsFile, pairs: list[tuple[Any, str, int]],
          totals: dict[str, int], model: str, summary: Summary, say: Callable[[str], None] | None = None) -> None:
    """Send the pairs through the proxy (started here unless --proxy names one), with the progress line."""
    in_process = None
    proxy_url = options.proxy.rstrip("/") if options.proxy else None
    if proxy_url is None:
        in_process = InProcessProxy(config, fail_open=options.fail_open)
        proxy_url = in_process.start()
    tallies = results.tallies()
    traces = ReplayTraces(config, pairs) if config.tracing.enabled else None
    try:
        with Progress(list(totals), totals, tallies, enabled=options.progress) as progress:
            asyncio.run(_send_all(options, proxy_url, pairs, results, progress, model, in_process, summary, traces,
                                  given_profiles(config, list(totals)), say))
    finally:
        if in_process is not None:
            in_process.stop()
        if traces is not None:
            traces.close()


def budget_arms(specs: dict[str, dict[str, Any]]) -> list[str]:
    """The arms with a step that grows the request to a token budget (`Perturber.fills_token_budget`)."""
    from toolquake.perturbers import build

    return [p for p, spec in specs.items()
            if any(build(step["name"], step["params"]).fills_token_budget() for step in spec["perturbers"])]


def refuse_estimate(arms: list[str], why: str, options: Options) -> None:
    """Arms whose budgets the estimate would count are refused unless --allow-estimate."""
    if not arms or options.allow_estimate:
        return
    shown = ", ".join(arms[:6]) + (f" and {len(arms) - 6} more" if len(arms) > 6 else "")
    presets = [p.strip() for p in options.profiles.split(",") if p.strip().startswith("@")]
    if presets:  # name what was typed too
        shown = f"{', '.join(presets)} ({shown})"
    raise ReplayError(
        f"{shown}: these arms fill a token budget, meant in the model's own tokens (seed 003's budgets are), and "
        f"this run would count it with the estimate ({why}). Pick the model's tokenizer: --token-counter "
        "tiktoken:o200k_base (GPT-4o and other OpenAI models; `make tiktoken-files`), "
        "tokenizer:/path/tokenizer.json (the served model's Hugging Face tokenizer), or upstream (a backend with "
        "/tokenize: vLLM, llama.cpp, the embedded backend) — with --proxy, that proxy's [server] token_counter; "
        "or pass --allow-estimate to run on the estimate anyway (it over-counts real tokens 1.17-1.5x, so every "
        "budget is smaller than its name).")


def _token_counter(config: Any, options: Options, say: Callable[[str], None], budgets: list[str] | None = None
                   ) -> str:
    """What the in-process proxy counts tokens with (what budgets mean in this run); a warning when `auto` found
    no tokenizer at the backend, and a refusal when arms that fill a token budget (`budgets`) would run on the
    estimate unasked."""
    from toolquake.perturbers.helpers.tokens import counter_label, make_counter

    try:
        counter = make_counter(config.server.token_counter, config.server.upstream)
    except (ValueError, OSError) as exc:
        raise ReplayError(f"token counter: {exc}") from None
    if hasattr(counter, "close"):
        counter.close()
    fallback = getattr(counter, "fallback", None)
    if counter.source == "estimate":
        refuse_estimate(budgets or [], fallback or f"token_counter is {config.server.token_counter!r}", options)
    if fallback:
        say(f"replay: WARNING: {fallback}. Token budgets (pad-*, resp-*, conv-*) are then smaller in the model's own "
            "tokens than their names say; the report gives the tokens each arm reached.")
    return counter_label(counter)


def proxy_counter(options: Options, budgets: list[str]) -> str | None:
    """With --proxy: the token counter that proxy says it counts with (its /readyz `token_counter`), refused for
    arms that fill a token budget when it is the estimate; None when the proxy does not say."""
    try:
        r = httpx.get(f"{(options.proxy or '').rstrip('/')}/readyz", timeout=10.0, trust_env=False)
        source = r.json().get("token_counter")
    except (httpx.HTTPError, ValueError, AttributeError):
        source = None
    if source == "estimate":
        refuse_estimate(budgets, "the proxy's [server] token_counter is the estimate", options)
    return source if isinstance(source, str) else None


def _changes_expectation(config: Any, profile: str) -> bool:
    """Grading this profile's answers needs what its perturbers did (declared by each perturber class)."""
    from toolquake.perturbers import registry

    spec = config.profiles.get(profile)
    known = registry()
    return spec is not None and any(p.name in known and known[p.name].affects_grading() for p in spec.perturbers)


def _has_tool_results(case: Any) -> bool:
    """A multi-turn case (the simulators answer its calls), or one whose messages already hold a tool result."""
    return case.is_multi_turn or any(isinstance(m, dict) and m.get("role") == "tool"
                                     for turn in case.turns for m in turn)


def _injects_failures(config: Any, profile: str) -> bool:
    """This profile replaces tool results with failures (declared by the perturber class)."""
    from toolquake.perturbers import Perturber, registry

    spec = config.profiles.get(profile)
    known = registry()
    return spec is not None and any(p.name in known and known[p.name].injected_failures is not
                                    Perturber.injected_failures for p in spec.perturbers)


def iter_tallies(summary: Summary) -> Iterable[tuple[str, int, int]]:
    for arm in summary.arms:
        n, v = summary.tallies.get(arm, (0, 0))
        yield arm, n, v
