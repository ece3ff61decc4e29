"""Every registered perturber, with the parameters of every packaged profile that uses it (of a grid of numbers,
its ends), against hostile text
(issue 28 item 1): repeated regex metacharacters, long runs of spaces, deep nesting, control and bidi characters,
in every place a client controls (user and system messages, tool names, descriptions, parameter descriptions and
defaults, tool results). Nothing raises out of `apply`, and the time it takes grows at most linearly with the text:
a bound in CPU milliseconds per KiB, and the time for 8x the text at most 3x what linear growth allows. The CPU
time of the process is measured, not the wall clock, so a busy machine does not fail the test; the quadratic
scans this guards against took seconds at 64 KiB (minutes at 512 KiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import random
import sys
import time
import tomllib
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import ROOT
from tests.support.hostile import FIELDS, LARGE, MS_PER_KIB, SMALL, UNITS, hostile, ordinary, request_with
from tests.support.perturbers import HAVE_EMBEDDINGS, corpus_present
from toolquake.perturbers import build, registry
from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.generator import DiskCache
from toolquake.perturbers.helpers.tokens import EstimateCounter

#: perturbers that need what an install may lack: (corpus, embeddings)
NEEDS = {"catalog_padding": (True, True), "toolkit_expansion": (True, True), "conversation_lengthening": (True, False)}


def packaged_params() -> list[tuple[str, dict[str, Any]]]:
    """(perturber, params) for every distinct step of the packaged profiles, and each registered perturber that no
    packaged profile uses with its defaults. Of steps that differ only in numbers (the paper grids: catalog padding
    at 5 budgets x 5 positions, response lengthening at 8 positions), those at the ends of each number's range:
    the numbers say how much is added and where, the code that reads the client's text is the same."""
    profiles = tomllib.loads((ROOT / "proxy" / "profiles.toml").read_text())["profiles"]
    seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for profile in profiles.values():
        for step in profile.get("perturbers", []):
            params = step.get("params", {})
            seen.setdefault((step["name"], json.dumps(params, sort_keys=True)), (step["name"], params))
    for name in registry():
        if not any(key[0] == name for key in seen):
            seen[(name, "{}")] = (name, {})
    return at_the_ends(list(seen.values()))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_the_ends(steps: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The steps whose every number is the smallest or the largest among the steps of the same perturber with the
    same other params (and the same numeric keys)."""
    def family(step: tuple[str, dict[str, Any]]) -> str:
        name, params = step
        return json.dumps([name, {k: (None if _is_number(v) else v) for k, v in params.items()}], sort_keys=True)

    values: dict[tuple[str, str], set[Any]] = {}  # (family, numeric key) -> the values the steps give it
    for step in steps:
        for key, value in step[1].items():
            if _is_number(value):
                values.setdefault((family(step), key), set()).add(value)
    ends = {where: (min(found), max(found)) for where, found in values.items()}
    return [step for step in steps
            if all(not _is_number(v) or v in ends[(family(step), k)] for k, v in step[1].items())]


def _param_id(item: tuple[str, dict[str, Any]]) -> str:
    name, params = item
    return name + "".join(f"-{k}={v}" for k, v in sorted(params.items()))


def _marks(name: str) -> list[Any]:
    corpus, embeddings = NEEDS.get(name, (False, False))
    marks = []
    if corpus:
        marks += [pytest.mark.needs_corpus,
                  pytest.mark.skipif(not corpus_present(), reason="needs the BFCL corpus: toolquake corpus pull")]
    if embeddings:
        marks += [pytest.mark.needs_embeddings,
                  pytest.mark.skipif(not HAVE_EMBEDDINGS, reason="needs the embeddings extra: make install-embeddings")]
    return marks


STEPS = [pytest.param(item, id=_param_id(item), marks=_marks(item[0])) for item in packaged_params()]


@functools.cache
def _services() -> Services:
    return Services(token_counter=EstimateCounter())


@functools.cache
def _perturber(name: str, params_json: str, cache_dir: str) -> Any:
    params = json.loads(params_json)
    if name == "paraphrase":  # answers come from its cache (filled below), never from the network
        params = {**params, "cache_dir": cache_dir, "generator_model": "m", "timeout_s": 0.5}
    perturber = build(name, params)
    perturber.setup(_services())
    return perturber


def _fill_paraphrase_cache(cache_dir: str, body: dict[str, Any]) -> None:
    """The rephraser's answer for the request's last user message: the message itself, echoed (every quoted value
    and number kept, so the whole value check runs over the hostile text)."""
    from toolquake.perturbers.paraphrase import PROMPT_VERSION

    original = body["messages"][-1]["content"]
    cache = DiskCache(cache_dir)
    cache.put(cache.key(PROMPT_VERSION, "m", original), {"version": PROMPT_VERSION, "model": "m",
                                                           "original": original, "answer": original + " "})


def _apply(perturber: Any, body: dict[str, Any]) -> ChatRequest:
    ctx = PerturbContext(perturbation_seed=3, rng=random.Random(f"3:0:{perturber.name}"), services=_services())
    result = perturber.apply(ChatRequest(body), ctx)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def refusal(perturber: Any) -> type[BaseException] | None:
    """What `perturber` raises on a benign request, if anything (e.g. `tool_removal` with `which = "expected"`
    and no case: a documented refusal the pipeline counts and serves unperturbed)."""
    try:
        _apply(perturber, request_with("user", "What is the weather in Rome?"))
    except Exception as exc:
        return type(exc)
    return None


def cpu_seconds(perturber: Any, body: dict[str, Any]) -> float:
    """CPU time of the whole process (threads of torch included) to apply `perturber` once. It must return a
    request, or raise only what it raises on a benign request too."""
    refused = refusal(perturber)
    embedder = _services().extra.get("embedder")
    if embedder is not None:  # every measurement embeds its texts afresh: a cached baseline is no baseline
        embedder._cache.clear()
    with one_torch_thread():
        start = time.process_time()
        try:
            result = _apply(perturber, body)
        except Exception as exc:
            if refused is None or not isinstance(exc, refused):
                raise
            return time.process_time() - start
        spent = time.process_time() - start
    assert isinstance(result, ChatRequest)
    return spent


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Embeddings computed on one thread while measured: torch's worker threads spin while they wait for work, and
    on a busy machine that spinning, not the work, made the process's CPU time (seen: 0.7 s more for the same
    embedding of a 64 KiB description)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: made once, at import: settings made inside a running test take that moment's default as their parent, and a
#: chain of them grew with every test until hypothesis' settings look-ups hit the recursion limit (seen in a full
#: run: RecursionError in `settings.database` in a later file's hypothesis tests)
CHECK_SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("step", STEPS)
def test_every_perturber_is_linear_in_hostile_text(step: tuple[str, dict[str, Any]], tmp_path_factory: Any) -> None:
    name, params = step
    cache_dir = str(tmp_path_factory.mktemp(f"cache-{name}"))
    perturber = _perturber(name, json.dumps(params, sort_keys=True), cache_dir)
    for text in ("What is the weather in Rome?", "warm up: load what the first request loads"):
        if name == "paraphrase":
            _fill_paraphrase_cache(cache_dir, request_with("user", text))
        cpu_seconds(perturber, request_with("user", text))

    @CHECK_SETTINGS
    @given(field=st.sampled_from(FIELDS), unit=st.sampled_from(UNITS))
    def check(field: str, unit: str) -> None:
        small, large = request_with(field, hostile(unit, SMALL)), request_with(field, hostile(unit, LARGE))
        # the baseline: ordinary prose of the same size in the same place. What a perturber spends on any large
        # request is not what the hostile text adds: embedding a tool reads at most the model's window (256
        # tokens), a constant ~0.8 s CPU for any description that fills it; a budget perturber pads a short
        # response more than a long one. The hostile text's extra cost is what must stay linear.
        benign_small, benign_large = request_with(field, ordinary(SMALL)), request_with(field, ordinary(LARGE))
        if name == "paraphrase":
            for body in (benign_small, benign_large, small, large):
                _fill_paraphrase_cache(cache_dir, body)
        t_small = max(0.0, cpu_seconds(perturber, small) - cpu_seconds(perturber, benign_small))
        where = f"{name} {params} with {unit!r} repeated in the {field}"
        # checked before the large text is tried: quadratic code would take minutes there
        assert t_small * 1000 <= MS_PER_KIB * SMALL / 1024, f"{where}: {t_small:.2f} s CPU for 64 KiB"
        t_large = max(0.0, cpu_seconds(perturber, large) - cpu_seconds(perturber, benign_large))
        assert t_large * 1000 <= MS_PER_KIB * LARGE / 1024, f"{where}: {t_large:.2f} s CPU for 512 KiB"
        assert t_large <= 3 * 8 * t_small + 0.5, f"{where}: 64 KiB {t_small:.3f} s, 512 KiB {t_large:.3f} s CPU"

    check()


@pytest.mark.parametrize("unit", UNITS)
def test_surface_noise_and_paraphrase_target_take_a_mebibyte_of_each_hostile_text(unit: str) -> None:
    """The two attacks the issue reproduced (7.5 s for 64 KiB of 'a+' through `noisy`, 4.6 s for an 80 KB
    description through `meta-paraphrase-target`), at 1 MiB, for every hostile text."""
    noisy = _perturber("surface_noise", json.dumps({"rate": 0.1}), "")
    target = _perturber("tool_metadata", json.dumps({"kind": "paraphrase_target"}), "")
    for size in (SMALL, 1024 * 1024):  # the small one first: quadratic code would take half an hour on the large
        text = hostile(unit, size)
        spent = cpu_seconds(noisy, request_with("user", text)) + cpu_seconds(target, request_with("tool_description",
                                                                                                  text))
        assert spent * 1000 <= 2 * MS_PER_KIB * size / 1024, f"{unit!r}: {spent:.2f} s CPU for {size} characters"


def test_every_registered_perturber_is_covered() -> None:
    assert {name for name, _ in packaged_params()} == set(registry())


@pytest.mark.parametrize("unit", UNITS)
def test_the_protected_value_scans_are_linear(unit: str) -> None:
    """The scans behind surface_noise and paraphrase (protected spans, quoted strings, numbers), on the whole
    text at once: each start position costs O(1) amortised."""
    from toolquake.perturbers.helpers.protected import numbers, protected_spans, quoted

    spent = {}
    for size in (SMALL, LARGE):
        text = hostile(unit, size)
        start = time.process_time()
        protected_spans(text), quoted(text), numbers(text)
        spent[size] = time.process_time() - start
        assert spent[size] * 1000 <= MS_PER_KIB * size / 1024, f"{unit!r}: {spent[size]:.2f} s CPU for {size}"
    assert spent[LARGE] <= 3 * 8 * spent[SMALL] + 0.25, spent
