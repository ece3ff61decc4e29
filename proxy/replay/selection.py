"""What to replay: profiles (names, patterns, `@presets`), cases (categories, limit, shard)."""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from toolquake.proxy.replay.errors import ReplayError

#: named groups of profiles for `--profiles` (`@name`); patterns are expanded against the config. A perturber's
#: family has a preset of the perturber's name, with the profiles it declares (`Perturber.preset_profiles`): `presets`
PRESETS: dict[str, list[str]] = {
    # seed 001 Table 2: original / rephrased query / expanded toolkit (run it on `multiple`); the rephrasing drop on
    # the cases whose rephrasing passed the value check (rephrased) and on all of them (rephrased-all, the paper's)
    "seed001": ["off", "rephrased", "rephrased-all", "expanded"],
    # seed 003 challenge 1: catalog padded to 5 budgets × 5 positions of the original tools
    "seed003": ["off", "pad-*"],
    # the same grid in BFCL's prompting mode (the padded catalog in the system prompt, BFCL's decoder): for models
    # served without native tools and APIs that cap the tools array; prompt-off is its baseline (--baseline)
    "seed003-prompt": ["off", "prompt-off", "prompt-pad-*"],
    # seed 002: the 26 format configurations of BFCL V4 format sensitivity (run it on `format_sensitivity`)
    "seed002": ["fmt-*"],
    # issue #19: failed tool results (tool_failure) and rewritten tool descriptions (tool_metadata)
    "faults": ["off", "fail-*"],
    "metadata": ["off", "meta-*"],
    # seed 003 challenge 2 (Fig. 4a/4b, Table 7): the last tool response grown with real records to 10K-80K tokens
    # (p1), and at 80K the original records after (p − 1)/7 of the padding records, p = 1…8 (Fig. 4b's 8 answer
    # positions); run on multi-turn cases (docs/replay.md)
    "seed003-responses": ["off", "resp-*"],
    # seed 003 challenge 3 (Table 2) as the paper measures it: each conversation given up to its last user turn,
    # 4 sizes × 2 settings (fact in a user turn / a tool response), one request graded on its next call by AST
    "seed003-conversations": ["conv-off", "conv-*k-s*"],
    # the same sizes and settings with the whole conversation played live, BFCL's multi-turn verdict
    "seed003-conversations-bfcl": ["off", "bfcl-conv-*"],
    # issue #49: remedies measured as arms, each perturbation beside its remedied twin (the report's `remedies`
    # section pairs them). Two presets, not one: every arm of a replay runs on every selected case, and the catalog
    # half is seed 003's single-turn cases while the responses half needs multi-turn ones (a tool response to grow)
    "remedies": ["off", "pad-8k-p50", "search-pad-8k-p50", "pad-32k-p50", "search-pad-32k-p50", "pad-120k-p50",
                 "search-pad-120k-p50"],
    "remedies-responses": ["off", "resp-20k-p1", "trim-resp-20k-p1", "resp-80k-p1", "trim-resp-80k-p1"],
}
#: the BFCL categories a preset replays when --categories is not given: the papers' own data (seed 003 §4.1:
#: BFCL's simple, live_simple and multiple, 858 cases; seed 002: BFCL V4's 200-case format-sensitivity selection;
#: the multi-turn presets need a history to perturb)
PRESET_CATEGORIES: dict[str, list[str]] = {
    "seed001": ["multiple"],
    "seed003": ["simple_python", "live_simple", "multiple"],
    "seed003-prompt": ["simple_python", "live_simple", "multiple"],
    "seed002": ["format_sensitivity"],
    "seed003-responses": ["multi_turn_base"],
    "seed003-conversations": ["multi_turn_base"],
    "seed003-conversations-bfcl": ["multi_turn_base"],
    "remedies": ["simple_python", "live_simple", "multiple"],
    "remedies-responses": ["multi_turn_base"],
}


def presets() -> dict[str, list[str]]:
    """Every preset: `PRESETS`, then one per perturber that declares `preset_profiles` (`@tool_order`, ...)."""
    from toolquake.perturbers import registry

    declared = {name: ["off", *cls.preset_profiles] for name, cls in sorted(registry().items())
                if cls.preset_profiles and name not in PRESETS}
    return {**PRESETS, **declared}


def default_categories(profiles_spec: str) -> list[str] | None:
    """The categories a run of only such presets defaults to (`@seed003` → simple_python, live_simple, multiple;
    `@seed002` → format_sensitivity; `@seed003-responses` → multi-turn), else None."""
    items = [s.strip() for s in profiles_spec.split(",") if s.strip()]
    wanted = [PRESET_CATEGORIES.get(i[1:]) for i in items if i.startswith("@")]
    if not wanted or len(wanted) != len(items) or any(w is None for w in wanted):
        return None
    out: list[str] = []
    for group in wanted:
        out.extend(c for c in group or [] if c not in out)
    return out


#: this many connection failures in a row means the backend (or proxy) is down: stop, resume later


def parse_shard(text: str | None, env: dict[str, str] | None = None) -> tuple[int, int] | None:
    """`I/N` → (I, N); `N` alone takes I from JOB_COMPLETION_INDEX (a Kubernetes Indexed Job)."""
    if text is None or text == "":
        return None
    env = os.environ if env is None else env
    index_text, sep, count_text = text.partition("/")
    if not sep:
        index_text, count_text = env.get("JOB_COMPLETION_INDEX", ""), text
        if index_text == "":
            raise ReplayError(f"--shard {text}: give I/N, or set JOB_COMPLETION_INDEX for the index")
    try:
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise ReplayError(f"--shard {text!r}: expected I/N with integers, e.g. 0/8") from None
    if count < 1 or not 0 <= index < count:
        raise ReplayError(f"--shard {text!r}: need 0 <= I < N")
    return index, count


def expand_profiles(spec: str, known: list[str]) -> list[str]:
    """Comma-separated profile names, shell patterns (`pad-*`) and presets (`@seed001`), in order, once each."""
    out: list[str] = []
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ReplayError("--profiles is empty")
    groups = presets() if any(i.startswith("@") for i in items) else PRESETS
    for item in items:
        if item.startswith("@"):
            group = groups.get(item[1:])
            if group is None:
                raise ReplayError(f"unknown preset {item!r} (presets: {', '.join('@' + p for p in groups)})")
            names = [n for pattern in group for n in _match(pattern, known, item)]
        else:
            names = _match(item, known, item)
        out.extend(n for n in names if n not in out)
    return out


def _match(pattern: str, known: list[str], asked: str) -> list[str]:
    if any(c in pattern for c in "*?["):
        names = [n for n in known if fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ReplayError(f"{asked!r}: no profile matches {pattern!r}")
        return names
    if pattern not in known:
        raise ReplayError(f"unknown profile {pattern!r} (known: {', '.join(known)})")
    return [pattern]


#: BFCL V4's format-sensitivity selection (seed 002's case mix): its 200 original cases, as BFCL selects them
FORMAT_SENSITIVITY = "format_sensitivity"


def format_sensitivity_cases() -> list[Any]:
    """The 200 cases of `BFCL_v4_format_sensitivity.json` in BFCL's order: its categories in key order, each
    category's listed entries in file order (not list order)."""
    from toolquake.bfcl.corpus import format_sensitivity_ids, load_category

    out: list[Any] = []
    for category, ids in format_sensitivity_ids().items():
        wanted = set(ids)
        out.extend(c for c in load_category(category) if c.id in wanted)
    return out


def select_cases(categories: list[str], limit: int | None, shard: tuple[int, int] | None,
                 user_cases: list[Any] | None = None) -> list[Any]:
    """The first `limit` cases of each BFCL category (file order), then the user cases (all of them: a file of
    one's own cases is chosen case by case), then every N-th from index I for a shard. `format_sensitivity`
    stands for BFCL's 200-case format-sensitivity selection (original ids and categories)."""
    from toolquake.bfcl.corpus import MULTI_TURN_CATEGORIES, load_category
    from toolquake.proxy.live.resolver import scorable_categories

    allowed = scorable_categories() + MULTI_TURN_CATEGORIES + (FORMAT_SENSITIVITY,)  # multi-turn: proxy/multiturn.py
    cases: list[Any] = []
    for name in categories:
        if name not in allowed:
            raise ReplayError(f"category {name!r} cannot be replayed (categories: {', '.join(allowed)})")
        items = format_sensitivity_cases() if name == FORMAT_SENSITIVITY else load_category(name)
        cases.extend(items if limit is None else items[:limit])
    cases.extend(user_cases or [])
    if shard is not None:
        index, count = shard
        cases = cases[index::count]
    return cases


def results_name(shard: tuple[int, int] | None) -> str:
    return "replay.sqlite" if shard is None else f"replay-shard-{shard[0]}-of-{shard[1]}.sqlite"
