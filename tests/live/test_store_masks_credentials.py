"""The results stores never keep a generator URL's credentials: a step's parameters are stored as the admin API's
GET shows them (`perturbers.shown_params`: a URL's user, password and query as `***`). Live: the proxy and the fake
upstream (which is also the rephraser) as real processes, the `openai` SDK as client."""

from __future__ import annotations

from tests.support import wait_for
from tests.support.shadow import MESSAGES, TOOLS, client
from toolquake.proxy.live import results
from toolquake.proxy.server.config import load_config

SECRETS = ("gen-user", "pw-h45-hidden", "q-h45-hidden")


def test_a_generator_urls_credentials_are_masked_in_the_live_results_store(proxy_factory, fake_upstream, tmp_path):
    """A shadow profile that rephrases through `generator_url = "http://gen-user:pw@127.0.0.1:.../v1"` (the fake
    upstream, which takes no credentials): the twin's row shows the URL with `***` for its user and password, and no
    byte of the store (its WAL included) holds them."""
    port = fake_upstream.url.rsplit(":", 1)[1]
    db = tmp_path / "live.sqlite"
    generator = f"http://gen-user:pw-h45-hidden@127.0.0.1:{port}/v1"
    proxy = proxy_factory(f"""
[server]
model_allowlist = ["fake-model"]

[profiles.shadow-rephrase]
mode = "shadow"
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }},
              {{ name = "paraphrase", params = {{ generator_url = "{generator}", generator_model = "fake-model" }} }}]

[scoring]
store = "{db}"
""")
    client(proxy, "shadow-rephrase").chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS)
    wait_for(lambda: db.exists() and len(results.read_rows(db)) == 1, what="the twin's row")
    [row] = results.read_rows(db)
    params = {step["name"]: step["params"] for step in row["perturbers"]}
    assert params["paraphrase"]["generator_url"] == f"http://***@127.0.0.1:{port}/v1"
    assert params["tool_order"]["mode"] == "reverse"
    assert row["perturbers"][1]["report"]["paraphrase"] == "accepted"  # the step ran, with the URL as configured
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("live.sqlite*"))
    assert not [s for s in SECRETS if s.encode() in stored]


def test_a_replays_arms_keep_a_generator_url_without_its_credentials(tmp_path):
    """The replay's results file records each arm's parameters (`arms` table) as the admin GET shows them."""
    from toolquake.proxy.replay.run import _profile_specs

    cfg = tmp_path / "replay.toml"
    cfg.write_text('[profiles.rephrase]\nperturbers = [{ name = "paraphrase", params = { generator_url = '
                   '"http://gen-user:pw-h45-hidden@gen.example:8000/v1?token=q-h45-hidden", '
                   'generator_model = "m" } }]\n')
    specs = _profile_specs(load_config(cfg, env={}), ["rephrase"])
    [step] = specs["rephrase"]["perturbers"]
    assert step["params"]["generator_url"] == "http://***@gen.example:8000/v1?***"
    assert step["params"]["generator_model"] == "m"
    assert not [s for s in SECRETS if s in repr(specs)]


def test_the_dry_run_prints_a_generator_url_without_its_credentials(fake_upstream, tmp_path):
    """`toolquake perturb` (its own process) prints what each applied step did to stderr: the step's parameters as
    the admin GET shows them, the rephrasing having run through the URL as configured (the fake upstream)."""
    import json
    import subprocess
    import sys

    port = fake_upstream.url.rsplit(":", 1)[1]
    cfg = tmp_path / "dry.toml"
    cfg.write_text(f'[profiles.rephrase]\nperturbers = [{{ name = "paraphrase", params = {{ generator_url = '
                   f'"http://gen-user:pw-h45-hidden@127.0.0.1:{port}/v1?token=q-h45-hidden", '
                   f'generator_model = "fake-model" }} }}]\n')
    body = tmp_path / "request.json"
    body.write_text(json.dumps({"model": "fake-model", "messages": MESSAGES, "tools": TOOLS}))
    run = subprocess.run([sys.executable, "-m", "toolquake", "perturb", "--config", str(cfg), "--profile", "rephrase",
                          "--request", str(body)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stderr.strip().splitlines()[-1])
    [step] = summary["applied"]
    assert step["paraphrase"] == "accepted"  # the generator was reached with the configured URL
    assert step["params"]["generator_url"] == f"http://***@127.0.0.1:{port}/v1?***"
    assert not [s for s in SECRETS if s in run.stderr + run.stdout]
