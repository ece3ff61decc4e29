"""`toolquake report`: seed 003's Tables 5, 6 (catalog padding), 7 and Fig. 4 (long tool responses), Table 2 (long
conversations), and the catalog heatmap's labels of the tokens reached, each recomputed here from the verdicts and
the perturbers' reports written to a real results file (the replay's own store)."""

from __future__ import annotations

import csv
import io
import json
import random
import re
import statistics

import pytest

from tests.support import ROOT
from tests.support.browser import chromium, console, open_page
from tests.support.report import report_text as report
from tests.support.results import perturb_arm, write_results
from toolquake.proxy.replay.store import Record
from toolquake.scorers.aggregate import wilson_ci

CATS = ("simple_python", "multiple")


# catalog padding: 3 budgets × 3 positions, named so that no name says its cell (the grid comes from the params)
PAD = {"off": {"mode": "off", "perturbers": []}}
for _j, (_b, _p) in enumerate([(b, p) for b in (8192, 32768, 65536) for p in (0.1, 0.5, 0.9)]):
    PAD[f"catalog-arm-{_j}"] = perturb_arm("catalog_padding", budget_tokens=_b, position=_p)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """40 cases per category × 10 arms, random verdicts; each padded pair reports the tokens it reached."""
    rng = random.Random(3)
    records = []
    for cat in CATS:
        for i in range(40):
            for j, (p, spec) in enumerate(PAD.items()):
                valid = rng.random() < 0.9 - 0.07 * j
                perturbers = None
                if spec["perturbers"]:
                    budget = spec["perturbers"][0]["params"]["budget_tokens"]
                    report_ = {"tokens_after": int(budget * rng.uniform(0.9, 1.0)), "token_counter": "tokenizer",
                               "tools_after": rng.randint(40, 400)}
                    perturbers = {"applied": [{"name": "catalog_padding", "params": spec["perturbers"][0]["params"],
                                               "report": report_}]}
                records.append(Record(f"{cat}_{i}", p, cat, "scored", valid=valid,
                                      taxonomy=None if valid else "wrong_function", perturbers=perturbers))
    path = tmp_path_factory.mktemp("pad") / "replay.sqlite"
    write_results(path, PAD, records)
    return path, records


def _acc(records, profile, cat=None) -> float:
    mine = [r.valid for r in records if r.profile == profile and r.status == "scored"
            and (cat is None or r.category == cat)]
    return sum(mine) / len(mine)


def _expected_extremes(values: dict[str, float]) -> dict:
    hi = max(values.values())
    lo = min(values.values())
    return {"max": hi, "min": lo, "deg": round((hi - lo) * 100, 2), "deg_relative": round((hi - lo) / hi * 100, 2),
            "arms": len(values)}


def _check(entry: dict, values: dict[str, float]) -> None:
    want = _expected_extremes(values)
    for k, v in want.items():
        assert entry[k] == pytest.approx(v), k
    assert values[entry["max_arm"]] == pytest.approx(want["max"])
    assert values[entry["min_arm"]] == pytest.approx(want["min"])


def test_tables_5_and_6_are_the_extremes_at_position_0_1_and_at_the_largest_budget(padded) -> None:
    path, records = padded
    got = json.loads(report(path, "--format", "json"))
    at_01 = [p for p, s in PAD.items() if s["perturbers"] and s["perturbers"][0]["params"]["position"] == 0.1]
    at_max = [p for p, s in PAD.items() if s["perturbers"] and s["perturbers"][0]["params"]["budget_tokens"] == 65536]
    assert len(at_01) == 3 and len(at_max) == 3
    for cat in CATS:
        t5 = got["padding_same_position"]["m1"][cat]
        _check(t5, {p: _acc(records, p, cat) for p in at_01})
        assert t5["position"] == 0.1
        t6 = got["padding_same_budget"]["m1"][cat]
        _check(t6, {p: _acc(records, p, cat) for p in at_max})
        assert t6["budget_tokens"] == 65536
        t1 = got["padding_extremes"]["m1"][cat]
        _check(t1, {p: _acc(records, p, cat) for p in PAD if p != "off"})
    md = report(path, "--no-plots")
    assert "Seed 003 Table 5" in md and "Seed 003 Table 6" in md
    t5 = got["padding_same_position"]["m1"]["multiple"]
    assert (f"| m1 | multiple | 0.1 | {t5['max']:.3f} | {t5['max_arm']} | {t5['min']:.3f} | {t5['min_arm']} | "
            f"{t5['drop']['relative']:.2f} (8K → 64K) | {t5['drop']['points']:.2f} | "
            f"{t5['deg']:.2f} | {t5['deg_relative']:.2f} | 3 | 0 |") in md
    rows = list(csv.DictReader(io.StringIO(report(path, "--format", "csv", "--csv-tables"))))
    for table, fixed, arms in (("seed 003 Table 5", "position=0.1", at_01),
                               ("seed 003 Table 6", "budget_tokens=65536", at_max)):
        mine = {r["Statistic"]: r for r in rows if r["Table"] == table and r["Group"] == "simple_python"}
        assert all(r["Held Fixed"] == fixed for r in mine.values())
        values = {p: _acc(records, p, "simple_python") for p in arms}
        assert float(mine["Max"]["Value"]) == pytest.approx(max(values.values()))
        assert values[mine["Min"]["Arm"]] == pytest.approx(min(values.values()))
        # Table 6's % degradation is (Max − Min) / Max; Table 5's is directional, (Max − Min) / Max beside it
        spread = "% Deg. (relative)" if table.endswith("6") else "(Max − Min) / Max"
        assert float(mine[spread]["Value"]) == pytest.approx(_expected_extremes(values)["deg_relative"])


def test_the_heatmap_labels_each_budget_with_the_tokens_reached(padded) -> None:
    from toolquake.proxy.replay.report import budget_ticks, load, summarize

    path, records = padded
    summary = summarize(load([path]))
    budgets = [8192, 32768, 65536]
    labels = budget_ticks(summary, "m1", budgets)
    for b, label in zip(budgets, labels):
        reached = [r.perturbers["applied"][0]["report"]["tokens_after"] for r in records
                   if r.perturbers and r.perturbers["applied"][0]["params"]["budget_tokens"] == b]
        assert len(reached) == 3 * 40 * len(CATS)
        med = statistics.median(reached)
        assert summary["padding_reached"]["m1"][str(b)]["median"] == round(med)
        assert label == f"{b // 1024}K (≈{round(med) / 1000:.1f}K)"
        assert round(med) < b  # what `estimate` hides: the label says the catalog fell short of the budget
    page = report(path, "--format", "md", "--out", str(path.with_name("r.md")))
    assert page == ""  # written to the file
    assert path.with_name("r-heatmap-catalog.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# long tool responses: a test config's profiles with the params on main (budget_tokens, position)
RESP = {"off": {"mode": "off", "perturbers": []},
        **{f"resp-{k}k-p1": perturb_arm("response_lengthening", budget_tokens=k * 1000, position=0.0)
           for k in (10, 20, 40, 80)},
        **{f"resp-80k-p{i + 1}": perturb_arm("response_lengthening", budget_tokens=80000, position=round(i / 7, 4))
           for i in range(1, 8)}}
CONV = {"off": {"mode": "off", "perturbers": []},
        # the `conv` helper's profiles: `fact` names where the needed fact sits
        **{f"conv-{k}k-s1": perturb_arm("conversation_lengthening", budget_tokens=k * 1000, setting="unstructured",
                                 fact="user_turn") for k in (10, 20, 40, 80)},
        **{f"conv-{k}k-s2": perturb_arm("conversation_lengthening", budget_tokens=k * 1000, setting="structured",
                                 fact="tool_response") for k in (10, 20, 40, 80)},
        # arms without `fact`, or with the default `any`: grouped by their setting; two in one cell are pooled
        "long-a": perturb_arm("conversation_lengthening", budget_tokens=20000, setting="structured", fact="any"),
        "long-b": perturb_arm("conversation_lengthening", budget_tokens=20000, setting="structured")}


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """Two models, each with the response and conversation arms, 30 multi-turn cases, random verdicts."""
    root = tmp_path_factory.mktemp("long")
    rng = random.Random(17)
    records = {}
    for model in ("m1", "m2"):
        arms = {**RESP, **CONV}
        mine = []
        for i in range(30):
            for j, p in enumerate(arms):
                valid = rng.random() < 0.85 - 0.03 * j
                mine.append(Record(f"multi_turn_base_{i}", p, "multi_turn_base", "scored", valid=valid,
                                   taxonomy=None if valid else "wrong_param_value"))
        write_results(root / f"replay-{model}.sqlite", arms, mine, model)
        records[model] = mine
    return root, records


def test_table_7_and_fig_4_hold_the_response_size_and_answer_position_experiments(long_runs) -> None:
    root, records = long_runs
    got = json.loads(report(root, "--format", "json"))["response_experiments"]
    for model, recs in records.items():
        e = got[model]["context_length"]
        sizes = ["resp-10k-p1", "resp-20k-p1", "resp-40k-p1", "resp-80k-p1"]
        assert [pt["profile"] for pt in e["points"]] == sizes and e["position"] == 0.0
        for pt in e["points"]:
            valid = sum(1 for r in recs if r.profile == pt["profile"] and r.valid)
            n = sum(1 for r in recs if r.profile == pt["profile"])
            assert pt["n"] == n and pt["accuracy"] == pytest.approx(valid / n)
            assert pt["accuracy_ci"] == pytest.approx(list(wilson_ci(valid, n)))
        _check(e, {p: _acc(recs, p) for p in sizes})
        e = got[model]["answer_position"]
        # at 80K: resp-80k-p1 (0.0) and resp-80k-p2..p8 (1/7 .. 1), labelled p1..p8 in position order
        at_80k = ["resp-80k-p1", *(f"resp-80k-p{i}" for i in range(2, 9))]
        assert [pt["profile"] for pt in e["points"]] == at_80k and e["budget_tokens"] == 80000
        assert [pt["label"] for pt in e["points"]] == [f"p{i}" for i in range(1, 9)]
        assert [pt["position"] for pt in e["points"]] == [RESP[p]["perturbers"][0]["params"]["position"]
                                                          for p in at_80k]
        _check(e, {p: _acc(recs, p) for p in at_80k})
    out = root.parent / "long-report.md"
    md = report(root, "--out", str(out))
    assert md == ""
    text = out.read_text()
    assert "Seed 003 Table 7" in text
    for name in ("response-size.png", "response-position.png"):
        assert f"]({out.stem}-{name})" in text
        assert out.with_name(f"{out.stem}-{name}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_2_groups_by_fact_else_setting_with_wilson_intervals(long_runs) -> None:
    root, records = long_runs
    got = json.loads(report(root, "--format", "json"))["conversation_grid"]
    for model, recs in records.items():
        grid = got[model]
        # arms played live (no `conversation = "given"`: BFCL's loop and verdict) are grouped apart from given ones
        assert set(grid) == {"played, fact user_turn", "played, fact tool_response", "played, setting structured"}
        for group, fact in (("played, fact user_turn", "s1"), ("played, fact tool_response", "s2")):
            assert sorted(grid[group], key=int) == ["10000", "20000", "40000", "80000"]
            for k in (10, 20, 40, 80):
                cell = grid[group][str(k * 1000)]
                mine = [r for r in recs if r.profile == f"conv-{k}k-{fact}"]
                valid = sum(1 for r in mine if r.valid)
                assert cell["n"] == len(mine) and cell["accuracy"] == pytest.approx(valid / len(mine))
                assert cell["accuracy_ci"] == pytest.approx(list(wilson_ci(valid, len(mine))))
        pooled = [r for r in recs if r.profile in ("long-a", "long-b")]
        cell = grid["played, setting structured"]["20000"]
        assert cell["profiles"] == ["long-a", "long-b"] and cell["n"] == len(pooled)
        assert cell["accuracy_ci"] == pytest.approx(list(wilson_ci(sum(1 for r in pooled if r.valid), len(pooled))))
    md = report(root, "--no-plots")
    assert "Seed 003 Table 2 (challenge 3" in md
    c = got["m2"]["played, fact tool_response"]["40000"]
    assert (f"{c['accuracy']:.3f} [{c['accuracy_ci'][0]:.3f}, {c['accuracy_ci'][1]:.3f}] (n={c['n']})") in md


@pytest.mark.processes
def test_html_report_with_the_seed_003_plots_in_headless_chromium(long_runs, tmp_path) -> None:
    browser = chromium()
    root, _ = long_runs
    page = tmp_path / "long.html"
    report(root, "--format", "html", "--out", str(page))
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", text)
    assert text.count("data:image/svg+xml;base64,") == 3  # accuracy per arm, Fig. 4a, Fig. 4b
    r, requests = open_page(browser, tmp_path, page.as_uri(), "--dump-dom")
    assert console(r.stderr) == [] and requests == []
    for title in ("Seed 003 Table 7", "Seed 003 Table 2", "seed 003 Fig. 4a: accuracy by response size",
                  "seed 003 Fig. 4b: accuracy by answer position"):
        assert title in r.stdout
    shot = tmp_path / "long.png"
    r, requests = open_page(browser, tmp_path, page.as_uri(), f"--screenshot={shot}", "--window-size=1400,5000")
    assert console(r.stderr) == [] and requests == []
    from PIL import Image

    with Image.open(shot) as img:
        gray = img.convert("L")
        assert sum(gray.histogram()[:128]) > 0.005 * 1400 * 5000 and len(gray.getcolors(256) or []) > 20
    keep = ROOT / ".pytest_cache" / "report-seed003-screenshot.png"  # for a person to look at
    keep.parent.mkdir(exist_ok=True)
    keep.write_bytes(shot.read_bytes())


def _packaged(preset: str) -> tuple[list[str], dict]:
    """A preset's profiles from the packaged config, expanded and specified as `toolquake replay` registers them."""
    from toolquake.proxy.replay.run import _profile_specs
    from toolquake.proxy.replay.selection import expand_profiles
    from toolquake.proxy.server.config import PACKAGED_CONFIG, load_config

    config = load_config(PACKAGED_CONFIG)
    names = expand_profiles(preset, ["off", *config.profiles])
    return names, _profile_specs(config, names)


def test_the_packaged_seed003_responses_profiles_give_fig_4s_points_in_their_own_order(tmp_path) -> None:
    """The profiles `@seed003-responses` replays, specs as the replay registers them (every parameter, defaults
    included): sizes at p1 make Fig. 4a, the 80K arms make p1..p8 of Fig. 4b, the label each name promises."""
    names, arms = _packaged("@seed003-responses")
    resp = [p for p in names if p != "off"]
    assert "off" in names and len(resp) == 11
    rng = random.Random(23)
    records = [Record(f"multi_turn_base_{i}", p, "multi_turn_base", "scored", valid=(v := rng.random() < 0.6),
                      taxonomy=None if v else "wrong_param_value") for i in range(20) for p in names]
    write_results(tmp_path / "replay.sqlite", arms, records)
    got = json.loads(report(tmp_path, "--format", "json"))["response_experiments"]["m1"]
    sizes = sorted((p for p in resp if p.endswith("-p1")), key=lambda p: int(p.split("-")[1][:-1]))
    assert [pt["profile"] for pt in got["context_length"]["points"]] == sizes
    assert [pt["label"] for pt in got["context_length"]["points"]] == ["10K", "20K", "40K", "80K"]
    at_80k = got["answer_position"]["points"]
    assert [pt["label"] for pt in at_80k] == [pt["profile"].rsplit("-", 1)[1] for pt in at_80k]
    assert [pt["profile"] for pt in at_80k] == sorted((p for p in resp if p.startswith("resp-80k-")),
                                                      key=lambda p: int(p.rsplit("-p", 1)[1]))
    _check(got["answer_position"], {pt["profile"]: _acc(records, pt["profile"]) for pt in at_80k})
    _check(got["context_length"], {p: _acc(records, p) for p in sizes})


def test_the_packaged_seed003_conversations_profiles_give_table_2s_two_settings(tmp_path) -> None:
    """`@seed003-conversations` as replay registers it: s1 = the fact in a user turn, s2 = in a tool response."""
    names, arms = _packaged("@seed003-conversations")
    conv = [p for p in names if p != "conv-off"]
    assert len(conv) == 8
    rng = random.Random(29)
    records = [Record(f"multi_turn_base_{i}", p, "multi_turn_base", "scored", valid=(v := rng.random() < 0.5),
                      taxonomy=None if v else "wrong_param_value") for i in range(20) for p in names]
    write_results(tmp_path / "replay.sqlite", arms, records)
    grid = json.loads(report(tmp_path, "--format", "json"))["conversation_grid"]["m1"]
    assert set(grid) == {"fact user_turn", "fact tool_response"}
    for group, suffix in (("fact user_turn", "s1"), ("fact tool_response", "s2")):
        mine = sorted((p for p in conv if p.endswith(suffix)), key=lambda p: int(p.split("-")[1][:-1]))
        assert [c["profiles"] for c in grid[group].values()] == [[p] for p in mine]
        assert list(grid[group]) == [str(int(p.split("-")[1][:-1]) * 1000) for p in mine]
        for p, cell in zip(mine, grid[group].values()):
            valid = sum(1 for r in records if r.profile == p and r.valid)
            assert cell["accuracy_ci"] == pytest.approx(list(wilson_ci(valid, 20)))


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_a_real_catalog_padding_replay_gives_tables_5_6_and_the_reached_labels(tmp_path) -> None:
    """`toolquake replay` of a 2 × 2 padding grid (a test config) against the fake upstream playing an oracle that
    answers two cases in five wrong; the report's tables and labels recomputed from the rows it stored."""
    import sqlite3

    from tests.support import start_fake_upstream
    from tests.support.replay import oracle_script, replay
    from toolquake.bfcl.corpus import is_present, load_category

    if not is_present():
        pytest.skip("needs the BFCL corpus: toolquake corpus pull")
    cases = load_category("multiple")[:10]
    script = oracle_script(cases, {c.id for i, c in enumerate(cases) if i % 5 in (1, 3)})
    config = tmp_path / "config.toml"
    grid = [(b, p) for b in (2000, 6000) for p in (0.1, 0.9)]
    config.write_text("".join(f'[profiles.grid-{j}]\nmode = "perturb"\nperturbers = [{{ name = "catalog_padding", '
                              f'params = {{ budget_tokens = {b}, position = {p} }} }}]\n\n'
                              for j, (b, p) in enumerate(grid)))
    fake = start_fake_upstream("--script", str(script))
    try:
        r = replay("--backend", f"{fake.url}/v1", "--profiles", "off,grid-*", "--config", str(config),
                   "--categories", "multiple", "--limit", str(len(cases)), "--out", str(tmp_path / "out"))
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        fake.stop()
    db = sqlite3.connect(tmp_path / "out" / "replay.sqlite")
    stored = db.execute("SELECT profile, case_id, valid, perturbers FROM results WHERE status = 'scored'").fetchall()
    db.close()
    assert len(stored) == 5 * len(cases)
    got = json.loads(report(tmp_path / "out", "--format", "json"))
    model = next(iter(got["models"]))

    def acc(profile: str) -> float:
        mine = [v for p, _, v, _ in stored if p == profile]
        return sum(mine) / len(mine)

    at_01 = {f"grid-{j}": acc(f"grid-{j}") for j, (_, p) in enumerate(grid) if p == 0.1}
    at_max = {f"grid-{j}": acc(f"grid-{j}") for j, (b, _) in enumerate(grid) if b == 6000}
    _check(got["padding_same_position"][model]["multiple"], at_01)
    _check(got["padding_same_budget"][model]["multiple"], at_max)
    for budget in (2000, 6000):
        reached = [json.loads(t)["applied"][0]["report"]["tokens_after"] for p, _, _, t in stored
                   if p != "off" and grid[int(p.split("-")[1])][0] == budget]
        assert len(reached) == 2 * len(cases)
        assert got["padding_reached"][model][str(budget)]["median"] == round(statistics.median(reached))
