"""`@seed003-prompt` (#47): seed 003's catalog grid in BFCL's prompting mode, against a backend that enforces a
hosted API's cap on the tools array. The padded catalog reaches the model in the system prompt (no native `tools`),
the answer is the text a prompting model writes (BFCL's python format) and is parsed back with BFCL's decoder; the
report keeps the prompting arms apart from native ones and names their mode."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.support import start_fake_upstream
from tests.support.replay import replay, rows
from tests.support.report import report_text
from tests.support.scratch import scratch_file

CAP = 20
#: the preset itself (off, prompt-off, the 25 prompting cells) and one native padded arm beside it
PROFILES = "@seed003-prompt,pad-8k-p10"
ARMS = 2 + 25 + 1


def _text_oracle(cases: list) -> Path:
    """The ground truth as a prompting model writes it: `[name(arg=value, ...)]`, the names as BFCL shows them."""
    from toolquake.scorers.mutations import ground_truth_calls

    lines = []
    for case in cases:
        calls = ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items()) + ")"
                          for c in ground_truth_calls(case))
        lines.append({"match": case.turns[0][-1]["content"], "answer": {"text": f"[{calls}]"}})
    path = scratch_file("text-oracle-", ".jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_preset_is_the_catalog_grid_in_prompting_mode_with_its_baseline():
    import tomllib

    from toolquake.proxy.replay.selection import default_categories, expand_profiles
    from toolquake.proxy.server.config import load_config

    known = ["off", *load_config(None).profiles]
    arms = expand_profiles("@seed003-prompt", known)
    assert arms[:2] == ["off", "prompt-off"] and len(arms) == 2 + 25
    assert default_categories("@seed003-prompt") == ["simple_python", "live_simple", "multiple"]
    shipped = tomllib.loads((Path(__file__).resolve().parents[2] / "proxy" / "profiles.toml").read_text())["profiles"]
    grid = {(s["perturbers"][0]["params"]["budget_tokens"], s["perturbers"][0]["params"]["position"])
            for name, s in shipped.items() if name.startswith("prompt-pad-")}
    native = {(s["perturbers"][0]["params"]["budget_tokens"], s["perturbers"][0]["params"]["position"])
              for name, s in shipped.items() if name.startswith("pad-")}
    assert grid == native and len(grid) == 25  # the same budgets × positions as @seed003
    for name in arms[1:]:  # BFCL's default prompt (format_rewrite's defaults), BFCL's decoder, after the padding
        steps = shipped[name]["perturbers"]
        assert steps[-1] == {"name": "format_rewrite", "params": {"parse": "strict"}}, name


@pytest.mark.processes
@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings  # catalog padding screens its tools with the embedding model
def test_prompting_mode_sends_no_native_tools_and_puts_the_padded_catalog_in_the_prompt(tmp_path):
    from toolquake.bfcl.corpus import load_category

    cases = load_category("simple_python")[:2]  # calculate_triangle_area, math.factorial (a dotted name)
    fake = start_fake_upstream("--script", str(_text_oracle(cases)), "--tools-array-max", str(CAP))
    out = tmp_path / "run"
    try:
        # counted with the estimate (allowed): the fake keeps its last 2,000 requests, and the upstream counter's
        # /tokenize calls would push the first chat requests out
        r = replay("--backend", f"{fake.url}/v1", "--profiles", PROFILES, "--categories", "simple_python",
                   "--limit", "2", "--out", str(out), "--header", "X-Test-Tag: prompt", "--token-counter",
                   "estimate", "--allow-estimate")
        assert r.returncode == 0, r.stderr[-3000:]
        sent = [q for q in httpx.get(f"{fake.url}/_fake/requests", params={"tag": "prompt"}).json()
                if q["path"] == "/v1/chat/completions"]
    finally:
        fake.stop()
    stored = {(x["profile"], x["case_id"]): x for x in rows(out)}
    assert len(stored) == ARMS * 2
    bodies = [json.loads(q["body"]) for q in sent]
    prompting = [b for b in bodies if "tools" not in b]
    native = [b for b in bodies if "tools" in b]
    # every prompting request reached the model without native tools: 26 arms × 2 cases; natively, `off` (one
    # tool: within the cap) and the padded arm (past it)
    assert len(prompting) == 26 * 2 and len(native) == 2 * 2
    assert sorted(len(b["tools"]) > CAP for b in native) == [False, False, True, True]
    for b in prompting:
        assert "tool_choice" not in b
        system = b["messages"][0]
        assert system["role"] == "system"
        names = [f["name"] for c in cases for f in c.functions if f["name"] in system["content"]]
        assert names, system["content"][:300]  # the case's own function is in the prompt, as BFCL shows it
    padded = [b for b in prompting if b["messages"][0]["content"].count('"name"') > CAP]
    assert len(padded) == 25 * 2  # every padded cell: more tools in the prompt than the API takes in `tools`
    for (profile, _), x in stored.items():
        if profile == "pad-8k-p10":  # native tools past the cap: the API's limit, not comparable
            assert (x["error_type"], x["error_code"], x["valid"]) == ("not_comparable", "array_above_max_length",
                                                                      None), x
        elif profile == "off":  # native tools, answered with text: no call
            assert (x["valid"], x["error_code"]) == (0, None), x
        else:  # the text answer parsed back with BFCL's decoder: the ground truth, valid
            assert (x["valid"], x["error_code"]) == (1, None), x
            applied = json.loads(x["perturbers"])["applied"]
            assert applied[-1]["report"]["decode"]["strict"]["ok"] is True

    data = json.loads(report_text("--no-plots", "--format", "json", str(out)))
    pads = data["padding"]["fake-model"]
    assert len(pads) == 26 and pads.pop("pad-8k-p10")["mode"] == "native tools"
    assert {a["mode"] for a in pads.values()} == {"prompting"}
    # the prompting grid is its own group in seed 003's tables, never pooled with native arms
    t1 = data["padding_extremes"]
    assert list(t1) == ["fake-model [prompting]"]
    e = t1["fake-model [prompting]"]["simple_python"]
    assert (e["max"], e["min"], e["arms"], e["mode"]) == (1.0, 1.0, 25, "prompting")
    assert (e["drop"]["from_budget"], e["drop"]["to_budget"], e["drop"]["relative"]) == (8192, 120000, 0.0)
    # seed 002's format-sensitivity statistics are over format configurations only: the padded prompting arms are
    # seed 003's (counted there, prompt-off's one configuration would be 26, and give an entry)
    assert data["format_sensitivity"] == {}
    # the backend's own count beside the counter's: this fake says 10 prompt tokens, so every arm is flagged
    b = pads["prompt-pad-8k-p10"]["backend_tokens"]
    assert (b["requests"], b["median"], b["differs"]) == (2, 10, True)
    counted = [a["report"]["tokens_after"] for x in stored.values() if x["profile"] == "prompt-pad-8k-p10"
               for a in json.loads(x["perturbers"])["applied"] if a["name"] == "catalog_padding"]
    assert len(counted) == 2 and b["counter_median"] == round(sum(counted) / 2)
    md = report_text("--no-plots", str(out))
    assert "| fake-model | prompt-pad-8k-p10 | prompting | 8192 |" in md
    assert "DIFFERS by more than 5%" in md
    assert "| fake-model [prompting] | simple_python |" in md
