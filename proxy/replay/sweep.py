"""`toolquake sweep`: per case, the intensity along one axis at which the model's call stops being right.

An axis is a numeric parameter a perturber declares sweepable (`Perturber.numeric_axes`: `tools` of
catalog_padding, `related` of toolkit_expansion, `response_tokens` of response_lengthening, `conversation_tokens` of
conversation_lengthening, and any a plugin declares). Each intensity x of the grid (`--min`, `--max`,
`--resolution`) is one profile, `sweep-<axis>-<x>`: that perturber with the parameter set to x. The profiles are put
into the proxy through its admin API when first needed (the in-process proxy gets a one-run admin token; a running
proxy, `--proxy`, needs its own: `--admin-token` or TOOLQUAKE_ADMIN_TOKEN), and every request is replay's: the same
sender, grader, results file (one row per (case, profile, trial), committed once) and multi-turn player.

Which x to send next is decided by `toolquake.proxy.replay.breaking` from the verdicts already recorded and nothing
else, so a sweep killed at any moment (SIGKILL included) resumes where it stopped: the recorded verdicts are read
back, the same decisions follow, and only what is missing is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from toolquake.proxy.replay.breaking import Outcome, grid, next_point, outcome, verdict
from toolquake.proxy.replay.errors import ReplayError
from toolquake.proxy.replay.failures import NOT_COMPARABLE
from toolquake.proxy.replay.inproc import InProcessProxy
from toolquake.proxy.replay.progress import Progress
from toolquake.proxy.replay.run import (
    Options,
    _auth,
    _check_options,
    _reach,
    _Sender,
    _token_counter,
    claim_temperature,
    prepare,
    proxy_counter,
    remedy_specs,
)
from toolquake.proxy.replay.store import Record, ResultsFile
from toolquake.proxy.replay.tracing import ReplayTraces

#: the axes of the brief, in the order `--help` lists them (any other declared axis works the same way)
NAMED_AXES = ("tools", "related", "response_tokens", "conversation_tokens")
RULES = ("majority", "all")
#: the results file's meta keys a resumed sweep must match
SWEEP_META = ("sweep_axis", "sweep_perturber", "sweep_param", "sweep_grid", "sweep_position", "sweep_rule",
              "trials", "sweep_remedies")


@dataclass(frozen=True)
class Axis:
    """A declared numeric axis, found by name: `name` (as declared, or `<perturber>.<param>`)."""

    name: str
    perturber: str
    decl: Any  # toolquake.perturbers.base.NumericAxis

    def params(self, x: float, position: int | float | None) -> dict[str, Any] | None:
        """The step's parameters at intensity x; None below the axis' `low` (no step: the request as sent)."""
        if x < self.decl.low:
            return None
        value = int(round(x)) if self.decl.integer else x
        params = {**self.decl.fixed, self.decl.param: value}
        if position is not None:
            params["position"] = position
        return params


def declared_axes() -> dict[str, Axis]:
    """Every numeric axis the registered perturbers declare, by its name and by `<perturber>.<param>`."""
    from toolquake.perturbers import registry

    out: dict[str, Axis] = {}
    for pname, cls in sorted(registry().items()):
        for name, decl in cls.numeric_axes.items():
            out.setdefault(name, Axis(name, pname, decl))
            out[f"{pname}.{decl.param}"] = Axis(f"{pname}.{decl.param}", pname, decl)
    return out


def find_axis(name: str) -> Axis:
    axes = declared_axes()
    if name not in axes:
        raise ReplayError(f"unknown axis {name!r}: the declared axes are {', '.join(sorted(axes))} (a perturber "
                          "declares one in its `numeric_axes`)")
    return axes[name]


@dataclass
class SweepOptions(Options):
    """Replay's options (`profiles` unused: give "off") and the sweep's own."""

    axis: str = "tools"
    low: float | None = None
    high: float | None = None
    resolution: float | None = None
    position: int | float | None = None
    rule: str = "majority"
    #: the running proxy's admin token (`--proxy`): the sweep's profiles are put there through its admin API
    admin_token: str | None = None
    #: remedies ({name, params}, `--remedy`) applied after the axis' step at every point: the sweep then runs twice,
    #: its unremedied twin first (sweep.sqlite) and the remedied one (sweep-remedied.sqlite), for the report to draw
    #: both survival curves on one plot
    remedies: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SweepSummary:
    path: Path
    model: str
    axis: str
    points: list[float]
    cases: int = 0
    sent: int = 0
    failed: int = 0
    #: cases stopped at a point the backend refused for its shape (failures.REFUSALS): no breaking point
    not_comparable: int = 0
    aborted: str | None = None
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    #: with --remedy: the remedies of this run, and the summary of its unremedied twin (run first)
    remedies: list[str] = field(default_factory=list)
    twin: SweepSummary | None = None
    #: the axis' unit ("tools in the request")
    unit: str = ""


def sweep_name(shard: tuple[int, int] | None, remedied: bool = False) -> str:
    stem = "sweep-remedied" if remedied else "sweep"
    return f"{stem}.sqlite" if shard is None else f"{stem}-shard-{shard[0]}-of-{shard[1]}.sqlite"


def profile_name(axis: str, x: float, remedied: bool = False) -> str:
    name = f"sweep-{axis}-{x:g}" if isinstance(x, float) else f"sweep-{axis}-{x}"
    return f"{name}-remedied" if remedied else name


class _Profiles:
    """The sweep's profiles, each put into the proxy (admin API) and recorded in the results file when first used."""

    def __init__(self, axis: Axis, options: SweepOptions, points: list[float], results: ResultsFile,
                 client: httpx.AsyncClient, proxy_url: str, token: str) -> None:
        self.axis, self.options, self.points, self.results = axis, options, points, results
        self.client, self.proxy_url, self.token = client, proxy_url, token
        self.ready: set[int] = set()
        self.lock = asyncio.Lock()

    def spec(self, i: int) -> dict[str, Any]:
        """The profile of grid point i as the proxy gets it."""
        params = self.axis.params(self.points[i], self.options.position)
        steps = [] if params is None else [{"name": self.axis.perturber, "params": params}]
        remedies = self.options.remedies
        return {"mode": "perturb" if steps or remedies else "off", "perturbers": steps,
                **({"remedies": remedies} if remedies else {}), "strict": not self.options.fail_open,
                "injected_calls": "pass", "description": f"toolquake sweep: {self.axis.name} = {self.points[i]:g}"}

    def recorded(self, i: int) -> dict[str, Any]:
        """The profile as the results file keeps it: every parameter (defaults included), and the sweep point."""
        from toolquake.perturbers import build, shown_params

        spec = self.spec(i)
        steps = [{"name": s["name"], "params": shown_params(build(s["name"], s["params"]).params()), "probability": 1.0}
                 for s in spec["perturbers"]]
        remedies = {"remedies": remedy_specs(_remedy_specs(spec["remedies"]))} if spec.get("remedies") else {}
        return {"mode": spec["mode"], "perturbers": steps, **remedies,
                "sweep": {"axis": self.axis.name, "x": self.points[i]}}

    async def ensure(self, i: int) -> str:
        name = profile_name(self.axis.name, self.points[i], bool(self.options.remedies))
        if i in self.ready:
            return name
        async with self.lock:
            if i not in self.ready:
                self.results.register_arms({name: self.recorded(i)})
                try:
                    r = await self.client.put(f"{self.proxy_url}/admin/profiles/{name}", json=self.spec(i),
                                              headers={"Authorization": f"Bearer {self.token}"})
                except httpx.HTTPError as exc:
                    raise ReplayError(f"cannot put the sweep's profile {name!r} into the proxy at {self.proxy_url} "
                                      f"({type(exc).__name__}); rerun to resume") from None
                if r.status_code != 200:
                    raise ReplayError(f"the proxy refused the sweep's profile {name!r} ({r.status_code}: "
                                      f"{r.text[:300]})" + (": give its admin token (--admin-token or "
                                                            "TOOLQUAKE_ADMIN_TOKEN)" if r.status_code in (401, 404)
                                                            else ""))
                self.ready.add(i)
        return name


class _Sweeper:
    """Every case's questions, one point at a time per case (its K trials at once), `concurrency` requests in
    flight over all cases."""

    def __init__(self, options: SweepOptions, profiles: _Profiles, sender: _Sender, results: ResultsFile,
                 progress: Progress, summary: SweepSummary, traces: ReplayTraces | None = None) -> None:
        self.options, self.profiles, self.sender, self.results = options, profiles, sender, results
        self.progress, self.summary, self.traces = progress, summary, traces
        self.slots = asyncio.Semaphore(max(1, options.concurrency))
        names = {profile_name(profiles.axis.name, x, bool(options.remedies)): i for i, x in enumerate(profiles.points)}
        #: case → grid index → {trial: right}, as recorded (a resumed sweep starts from these)
        self.recorded: dict[str, dict[int, dict[int, bool]]] = {}
        for (cid, profile, trial), valid in results.verdicts().items():
            if profile in names:
                self.recorded.setdefault(cid, {}).setdefault(names[profile], {})[trial] = valid
        #: cases with a point the backend refused for its shape: asked no further (not comparable there)
        self.refused = {cid for cid, profile, _ in results.not_comparable() if profile in names}

    def known(self, case_id: str) -> dict[int, dict[int, bool]]:
        """Grid index → {trial: right} of the case, as recorded."""
        return self.recorded.get(case_id, {})

    async def send(self, case: Any, name: str, trial: int) -> Record | None:
        async with self.slots:
            if self.sender.stop.is_set():  # the backend is gone: what is left waits for a rerun
                return None
            rec = await self.sender.one(case, name, trial)
        self.results.record(rec)
        self.summary.sent += 1
        self.sender.note_refusal(rec)
        self.sender.count_unreachable(rec, self.summary)  # type: ignore[arg-type]
        return rec

    async def case(self, case: Any) -> None:
        """Ask the case's points until its breaking point is known (under its own span when the run is traced)."""
        try:
            await self._case(case)
        finally:
            if self.traces is not None:
                self.traces.case_done(case, self._span_attributes(case))

    def _span_attributes(self, case: Any) -> dict[str, Any]:
        """The case's span: the axis, and the breaking point in the axis' units when the case finished."""
        points, found = self.profiles.points, self.summary.outcomes.get(case.id)
        attributes: dict[str, Any] = {"toolquake.sweep.axis": self.profiles.axis.name,
                                      "toolquake.sweep.finished": found is not None}
        if found is not None:
            attributes["toolquake.sweep.last_right"] = None if found.last_right is None else points[found.last_right]
            attributes["toolquake.sweep.first_wrong"] = \
                None if found.first_wrong is None else points[found.first_wrong]
            attributes["toolquake.sweep.non_monotone"] = bool(found.right_after)
        return attributes

    async def _case(self, case: Any) -> None:
        n, k = len(self.profiles.points), self.options.trials
        trials = self.known(case.id)
        if case.id in self.refused:  # a point the backend refused for its shape: this case has no breaking point
            self.summary.not_comparable += 1
            return
        while not self.sender.stop.is_set():
            done = {i: verdict([ts[t] for t in range(k)], self.options.rule) for i, ts in trials.items()
                    if all(t in ts for t in range(k))}
            i = next_point(n, done)
            if i is None:
                self.summary.outcomes[case.id] = outcome(n, done)
                self.progress.advance(self.progress.arms[0], done[n - 1] if n - 1 in done else None)
                return
            name = await self.profiles.ensure(i)
            have = trials.setdefault(i, {})
            recs = await asyncio.gather(*(self.send(case, name, t) for t in range(k) if t not in have))
            for rec in recs:
                if rec is None:
                    return
                if rec.error_type == NOT_COMPARABLE:  # the API's limit, not the model's: no breaking point here
                    self.summary.not_comparable += 1
                    return
                if rec.status != "scored":
                    self.summary.failed += 1
                    return  # this case waits for a rerun; the row says why
                have[rec.trial] = bool(rec.valid)


def _check(options: SweepOptions, axis: Axis) -> list[float]:
    _check_options(options)
    if options.proxy and not options.admin_token:
        raise ReplayError(f"with --proxy the sweep puts its profiles (sweep-{axis.name}-<x>) into that proxy through "
                          "its admin API: give the proxy's admin token (--admin-token, or TOOLQUAKE_ADMIN_TOKEN)")
    if options.rule not in RULES:
        raise ReplayError(f"--rule must be one of {', '.join(RULES)}")
    decl = axis.decl
    low = decl.default_min if options.low is None else options.low
    high = decl.default_max if options.high is None else options.high
    step = (decl.default_step if options.resolution is None else options.resolution)
    if decl.integer and step != int(step):
        raise ReplayError(f"--resolution must be a whole number on the {axis.name} axis")
    if options.position is not None and "position" not in _fields(axis.perturber):
        raise ReplayError(f"--position: {axis.perturber} has no position parameter")
    try:
        return grid(low, high, step, decl.integer)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None


def _applies(axis: Axis, cases: list[Any]) -> None:
    """Refuse an axis that can grow nothing in any of the cases (`NumericAxis.needs`): every case would come out
    right at every intensity, which would read as a result."""
    if axis.decl.needs != "tool_response" or any(_has_tool_response(c) for c in cases):
        return
    raise ReplayError(f"--axis {axis.name} grows the last tool response, and none of the {len(cases)} selected "
                      "cases has one (single-turn BFCL cases have none): sweep multi-turn cases (--categories "
                      "multi_turn_base, this axis' default) or your own cases with a tool message (--cases FILE)")


def _has_tool_response(case: Any) -> bool:
    """A multi-turn case (its steps after the first carry tool results), or a request that holds a tool message."""
    from toolquake.bfcl.corpus import case_request
    from toolquake.proxy.live.usercases import is_user_case, request_body

    if case.is_multi_turn:
        return True
    body = request_body(case, "sweep") if is_user_case(case) else case_request(case, model="sweep")
    return any(isinstance(m, dict) and m.get("role") == "tool" for m in body.get("messages") or [])


def _fields(perturber: str) -> set[str]:
    import msgspec

    from toolquake.perturbers import registry

    return {f.name for f in msgspec.structs.fields(registry()[perturber])}


def _claim(results: ResultsFile, options: SweepOptions, axis: Axis, points: list[float], model: str,
           config: Any, say: Callable[[str], None]) -> None:
    """Tie the file to the model and to this sweep's settings: a resume with other settings is refused."""
    results.claim(model, options.backend or options.proxy or "")
    claim_temperature(results, options)
    wanted = {"sweep_axis": axis.name, "sweep_perturber": axis.perturber, "sweep_param": axis.decl.param,
              "sweep_grid": f"{points[0]:g}:{points[-1]:g}:{len(points)}",
              "sweep_position": "" if options.position is None else f"{options.position:g}",
              "sweep_rule": options.rule, "trials": str(options.trials),
              "sweep_remedies": json.dumps(options.remedies, sort_keys=True) if options.remedies else ""}
    meta = results.meta()
    changed = [k for k in SWEEP_META if k in meta and meta[k] != wanted[k]]
    if changed:
        stored = ", ".join(f"{k}: {meta[k]}" for k in changed)
        raise ReplayError(f"{results.path} holds a sweep with other settings ({stored}): use another --out "
                          "directory, or the same settings")
    wanted.update({"categories": ",".join(options.categories), "cases": ",".join(options.cases),
                   "sweep_points": json.dumps(points),
                   "limit": str(options.limit or ""), "sweep_unit": axis.decl.unit,
                   "shard": "" if options.shard is None else f"{options.shard[0]}/{options.shard[1]}"})
    last = profile_name(axis.name, points[-1], bool(options.remedies))
    budgets = [last] if _fills_budget(axis, points, options) else []
    counter = proxy_counter(options, budgets) if options.proxy else _token_counter(config, options, say, budgets)
    if counter is not None:
        wanted["token_counter"] = counter
    results.set_meta(wanted)


def _fills_budget(axis: Axis, points: list[float], options: SweepOptions) -> bool:
    """The axis grows the request to a token budget (at its largest point), as the perturber declares."""
    from toolquake.perturbers import build

    params = axis.params(points[-1], options.position)
    return params is not None and build(axis.perturber, params).fills_token_budget()


def _remedy_specs(remedies: list[dict[str, Any]]) -> list[Any]:
    """`--remedy` specs as a profile's RemedySpec, each checked against its remedy (ReplayError otherwise)."""
    from toolquake.proxy.server.config import RemedySpec
    from toolquake.remedies import build

    out = []
    for r in remedies:
        try:
            build(r["name"], r.get("params") or {})
        except ValueError as exc:
            raise ReplayError(f"--remedy: {exc}") from None
        out.append(RemedySpec(r["name"], dict(r.get("params") or {})))
    return out


def run_sweep(options: SweepOptions, log: Callable[[str], None] | None = None) -> SweepSummary:
    """Check the backend, plan the grid, ask each case what is left to ask, record everything. With remedies, the
    unremedied twin is swept first (the same grid and cases, sweep.sqlite), then the remedied sweep
    (sweep-remedied.sqlite); the remedied summary is returned, the twin's in its `twin`."""
    if options.remedies:
        _remedy_specs(options.remedies)
        twin = _run_sweep(dataclasses.replace(options, remedies=[]), log)
        if twin.aborted:
            return twin
        summary = _run_sweep(options, log)
        summary.twin, summary.remedies = twin, [r["name"] for r in options.remedies]
        return summary
    return _run_sweep(options, log)


def _run_sweep(options: SweepOptions, log: Callable[[str], None] | None = None) -> SweepSummary:
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model = _reach(options, _auth(options))
    config, _, cases = prepare(options, say)  # loads the plugins too: their axes are declared from here on
    axis = find_axis(options.axis)
    points = _check(options, axis)
    if not cases:
        raise ReplayError("no cases selected (check --categories, --limit and --shard)")
    _applies(axis, cases)
    results = ResultsFile(Path(options.out) / sweep_name(options.shard, bool(options.remedies)))
    try:
        _claim(results, options, axis, points, model, config, say)
        summary = SweepSummary(results.path, model, axis.name, points, cases=len(cases), unit=axis.decl.unit)
        with_remedies = f" with {' + '.join(r['name'] for r in options.remedies)}" if options.remedies else ""
        say(f"sweep: {len(cases)} cases along {axis.name} ({axis.decl.unit}) from {points[0]:g} to {points[-1]:g} "
            f"in {len(points)} points{with_remedies}, model {model!r}"
            + (f", {options.trials} trials per point ({options.rule})" if options.trials > 1 else ""))
        if options.trials > 1 and not options.temperature:
            say("sweep: note: --trials with temperature 0 (or none) measures only the backend's own nondeterminism; "
                "pass --temperature to sample")
        _run(options, config, axis, points, cases, results, model, summary)
        return summary
    finally:
        results.close()


def _run(options: SweepOptions, config: Any, axis: Axis, points: list[float], cases: list[Any],
         results: ResultsFile, model: str, summary: SweepSummary) -> None:
    """Start the proxy (unless --proxy), then every case's sweep."""
    in_process = None
    token = options.admin_token or ""
    proxy_url = options.proxy.rstrip("/") if options.proxy else None
    if proxy_url is None:
        token = secrets.token_urlsafe(24)
        in_process = InProcessProxy(config, fail_open=options.fail_open, admin_token=token)
        proxy_url = in_process.start()
    traces = ReplayTraces(config, None, command="sweep") if config.tracing.enabled else None
    try:
        label = f"{axis.name}: right at max"
        with Progress([label], {label: len(cases)}, {}, enabled=options.progress, command="sweep",
                      unit="cases") as progress:
            asyncio.run(_sweep_all(options, axis, points, cases, results, model, in_process, proxy_url, token,
                                   progress, summary, traces))
    finally:
        if in_process is not None:
            in_process.stop()
        if traces is not None:
            traces.close()


async def _sweep_all(options: SweepOptions, axis: Axis, points: list[float], cases: list[Any], results: ResultsFile,
                     model: str, in_process: InProcessProxy | None, proxy_url: str, token: str, progress: Progress,
                     summary: SweepSummary, traces: ReplayTraces | None = None) -> None:
    limits = httpx.Limits(max_connections=options.concurrency + 1, max_keepalive_connections=options.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        sender = _Sender(options, proxy_url, client, model, in_process, traces, command="sweep")
        profiles = _Profiles(axis, options, points, results, client, proxy_url, token)
        sweeper = _Sweeper(options, profiles, sender, results, progress, summary, traces)
        await asyncio.gather(*(sweeper.case(c) for c in cases))
