"""`toolquake report`: every number is computed from the verdicts in the replay files.

The files are written by the replay's own writer (`proxy.replay.ResultsFile`) with verdicts drawn at
random; the expected numbers are recomputed here from those draws, independently of the report code.
"""

from __future__ import annotations

import csv
import io
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.report import report_text as report
from toolquake.proxy.replay.store import Record, ResultsFile

TAXA = ["wrong_function", "wrong_count", "wrong_param_value", "missing_param", "wrong_syntax"]
BUDGETS = [8192, 32768]
POSITIONS = [0.1, 0.9]


def _arm_specs() -> dict[str, dict]:
    specs = {"off": {"mode": "off", "perturbers": []},
             "shuffled": {"mode": "perturb", "perturbers": [{"name": "tool_order", "params": {"mode": "shuffle"},
                                                               "probability": 1.0}]}}
    for b in BUDGETS:
        for p in POSITIONS:
            specs[f"pad-{b}-{p}"] = {"mode": "perturb", "perturbers": [
                {"name": "catalog_padding", "params": {"budget_tokens": b, "position": p, "max_similarity": 0.8},
                 "probability": 1.0}]}
    for fmt, tag in (("python", False), ("json", True)):
        specs[f"fmt-{fmt}"] = {"mode": "perturb", "perturbers": [
            {"name": "format_rewrite", "params": {"return_format": fmt, "function_doc_format": "json",
                                                  "tool_call_tag": tag, "prompt_format": "plaintext",
                                                  "prompt_style": "classic", "parse": "strict"},
             "probability": 1.0}]}
    return specs


def _write(path: Path, model: str, records: list[Record]) -> None:
    f = ResultsFile(path)
    f.claim(model, "http://backend/v1")
    f.register_arms(_arm_specs())
    for rec in records:
        f.record(rec)
    f.close()


def _draw(rng: random.Random, profiles: list[str], n_cases: int) -> list[Record]:
    out = []
    for i in range(n_cases):
        category = "multiple" if i % 3 else "simple_python"
        for p in profiles:
            if rng.random() < 0.1:
                out.append(
                    Record(f"{category}_{i}", p, category, "error", error_code=rng.choice(["timeout", "http_500"]))
                )
                continue
            valid = rng.random() < (0.8 if p == "off" else 0.5)
            out.append(
                Record(
                    f"{category}_{i}",
                    p,
                    category,
                    "scored",
                    valid=valid,
                    taxonomy=None if valid else rng.choice(TAXA),
                    fair_valid=valid or rng.random() < 0.3,
                )
            )
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    rng = random.Random(3)
    root = tmp_path_factory.mktemp("report")
    profiles = list(_arm_specs())
    records = _draw(rng, profiles, 60)
    # two shards of one run, plus the first shard's error rows repeated as scored in a third file (a retry
    # that landed elsewhere): the scored copy must win and count once
    a, b = records[: len(records) // 2], records[len(records) // 2 :]
    _write(root / "s0" / "replay-shard-0-of-2.sqlite", "m1", a)
    _write(root / "s1" / "replay-shard-1-of-2.sqlite", "m1", b)
    retried = [
        Record(r.case_id, r.profile, r.category, "scored", valid=True, fair_valid=True)
        for r in a
        if r.status == "error"
    ]
    _write(root / "s2" / "replay.sqlite", "m1", retried)
    final = {(r.case_id, r.profile): r for r in records}
    for r in retried:
        final[(r.case_id, r.profile)] = r
    return root, list(final.values()), len(retried)


def _expected(records: list[Record], profile: str) -> dict:
    scored = [r for r in records if r.profile == profile and r.status == "scored"]
    by_cat = {}
    for cat in sorted({r.category for r in scored}):
        rs = [r for r in scored if r.category == cat]
        by_cat[cat] = (len(rs), sum(r.valid for r in rs) / len(rs))
    return {
        "n": len(scored),
        "accuracy": sum(r.valid for r in scored) / len(scored),
        "by_category": by_cat,
        "errors": Counter(r.taxonomy for r in scored if not r.valid),
        "unscored": sum(1 for r in records if r.profile == profile and r.status == "error"),
        "fair": sum(bool(r.fair_valid) for r in scored) / len(scored),
    }


def test_json_report_merges_shards_and_matches_the_stored_verdicts(shards):
    root, records, retried = shards
    data = json.loads(report("--format", "json", str(root / "s0"), str(root / "s1"), str(root / "s2")))
    assert data["duplicates"] == retried
    assert set(data["arms"]) == set(_arm_specs())
    base = _expected(records, "off")["accuracy"]
    for profile, arm in data["arms"].items():
        want = _expected(records, profile)
        assert arm["n"] == want["n"]
        assert arm["accuracy"] == pytest.approx(want["accuracy"])
        assert arm["errors"] == dict(want["errors"])
        assert arm["unscored"] == want["unscored"] and arm["failed"] == 0  # no scored row holds an error code
        assert arm["fair_accuracy"] == pytest.approx(want["fair"])
        assert {c: (v["n"], pytest.approx(v["accuracy"])) for c, v in arm["by_category"].items()} == want["by_category"]
        if profile == "off":
            assert arm["drop_vs_off"] == 0.0
        else:  # paired: both accuracies over the cases both scored
            assert base and arm["drop_vs_off"] == pytest.approx(_paired_drop(records, profile))


def _paired_drop(records: list[Record], profile: str) -> float:
    off = {r.case_id: r.valid for r in records if r.profile == "off" and r.status == "scored"}
    mine = {r.case_id: r.valid for r in records if r.profile == profile and r.status == "scored"}
    both = [c for c in mine if c in off]
    acc, acc_off = sum(mine[c] for c in both) / len(both), sum(off[c] for c in both) / len(both)
    return (acc - acc_off) / acc_off


@pytest.mark.processes
def test_markdown_has_table_2_with_relative_drops_and_the_error_breakdown(shards, tmp_path):
    root, records, _ = shards
    out = tmp_path / "report.md"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "toolquake",
            "report",
            str(root / "s0"),
            str(root / "s1"),
            str(root / "s2"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    text = out.read_text()
    base = _expected(records, "off")["accuracy"]
    shuffled = _expected(records, "shuffled")
    drop = round(_paired_drop(records, "shuffled") * 100)
    assert f"| m1 | {base:.3f} | {shuffled['accuracy']:.3f} ({drop:+d}%) |" in text
    failures = sum(shuffled["errors"].values())
    header = next(line for line in text.splitlines() if line.startswith("| model | profile | failures |"))
    columns = [c.strip() for c in header.strip("|").split("|")][3:]
    row = next(line for line in text.splitlines() if line.startswith(f"| m1 | shuffled | {failures} |"))
    shares = [float(x) for x in row.strip("|").split("|")[3:]]
    assert shares == [round(shuffled["errors"].get(c, 0) / failures, 2) for c in columns]
    # the heatmaps sit next to the report and are real PNGs
    for name in ("report-heatmap-catalog.png", "report-heatmap-formats.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
        assert f"]({name})" in text


def test_heatmap_cells_are_the_arm_accuracies(shards):
    from toolquake.proxy.replay.report import format_counts, format_grid, load, padding_counts, padding_grid, summarize

    root, records, _ = shards
    summary = summarize(load([root / "s0", root / "s1", root / "s2"]))
    budgets, positions, cells = padding_grid(summary, "m1")
    counts = padding_counts(summary, "m1")
    assert budgets == BUDGETS and positions == POSITIONS
    for b in BUDGETS:
        for p in POSITIONS:
            want = _expected(records, f"pad-{b}-{p}")
            assert cells[(b, p)] == pytest.approx(want["accuracy"])
            # the counts written in the cells: valid / scored pairs
            assert counts[(b, p)] == (round(want["accuracy"] * want["n"]), want["n"])
    fmt = _expected(records, "fmt-json")
    assert format_counts(summary)[("json->json,True", "m1")] == (round(fmt["accuracy"] * fmt["n"]), fmt["n"])
    labels, models, fcells = format_grid(summary)
    # seed 002's order: python return format before json; its label notation
    assert labels == ["json->python,False", "json->json,True"] and models == ["m1"]
    assert fcells[("json->json,True", "m1")] == pytest.approx(_expected(records, "fmt-json")["accuracy"])


def test_csv_is_bfcl_shaped_and_html_embeds_the_heatmaps(shards):
    root, records, _ = shards
    dirs = [str(root / "s0"), str(root / "s1"), str(root / "s2")]
    table = list(csv.reader(io.StringIO(report("--format", "csv", *dirs))))
    assert table[0] == ["Rank", "Overall Acc", "Model", "Profile", "N", "multiple", "simple_python"]
    accs = [float(r[1].rstrip("%")) for r in table[1:]]
    assert accs == sorted(accs, reverse=True) and [int(r[0]) for r in table[1:]] == list(range(1, len(accs) + 1))
    off = next(r for r in table[1:] if r[3] == "off")
    assert off[1] == f"{_expected(records, 'off')['accuracy'] * 100:.2f}%"
    page = report("--format", "html", *dirs)
    # the catalog heatmap (pooled, then one per subset: multiple, simple_python) and the format heatmap
    assert page.count("data:image/png;base64,") == 4 and "<table>" in page
    assert "<h3>heatmap-catalog-multiple.png</h3>" in page and "<h3>heatmap-catalog-simple_python.png</h3>" in page


def test_several_models_get_their_own_arms(tmp_path):
    rng = random.Random(5)
    for model in ("m1", "m2"):
        _write(tmp_path / model / "replay.sqlite", model, _draw(rng, ["off", "fmt-python", "fmt-json"], 10))
    data = json.loads(report("--format", "json", str(tmp_path / "m1"), str(tmp_path / "m2")))
    assert set(data["models"]) == {"m1", "m2"}
    assert "off [m1]" in data["arms"] and "off [m2]" in data["arms"]


@pytest.mark.processes
def test_report_errors_are_clear(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "toolquake", "report", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 2 and "no replay results" in r.stderr


def test_db_option_summarises_the_live_results_store(tmp_path):
    from toolquake.proxy.live.results import ResultsStore, Row

    store = ResultsStore(tmp_path / "live.sqlite")
    for i, (profile, valid) in enumerate([("off", True), ("off", True), ("expanded", True), ("expanded", False)]):
        store.append(
            Row(
                request_id=f"r{i}",
                profile=profile,
                mode="perturb",
                arm="live",
                model="m",
                stream=False,
                status=200,
                case_id=f"multiple_{i}",
                category="multiple",
                expected="ground_truth",
                valid=valid,
                taxonomy=None if valid else "wrong_function",
            )
        )
    store.close()
    data = json.loads(report("--db", str(tmp_path / "live.sqlite"), "--format", "json"))
    assert data["arms"]["off"]["accuracy"] == 1.0 and data["arms"]["expanded"]["accuracy"] == 0.5
    assert data["arms"]["expanded"]["drop_vs_off"] == pytest.approx(-0.5)
    assert "| live | expanded | 2 | 0.500 |" in report("--db", str(tmp_path / "live.sqlite"), "--no-plots")
