"""The sidecar pattern without Kubernetes: the pod of k8s/overlays/sidecar/agent-deployment.yaml
played by processes sharing loopback. The proxy runs with the sidecar container's environment and
the ConfigMap's profiles; a kubelet loop holds the agent back until the sidecar's startupProbe
passes, which happens only once the upstream answers; the agent is a plain OpenAI SDK script that
knows nothing but OPENAI_BASE_URL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import Proc, scraped, start_fake_upstream, start_process, wait_for
from tests.support.deploy import image_env
from tests.support.ports import held_port

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
AGENT_DEPLOYMENT = ROOT / "k8s" / "overlays" / "sidecar" / "agent-deployment.yaml"
CONFIGMAP = ROOT / "k8s" / "base" / "profiles" / "configmap.yaml"

AGENT = textwrap.dedent("""
    import json
    from openai import OpenAI

    client = OpenAI()  # base URL and key from OPENAI_BASE_URL / OPENAI_API_KEY, like any agent
    tools = [{"type": "function", "function": {"name": name, "description": "look something up",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}}
             for name in ("get_weather", "get_time", "get_population")]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    answer = client.chat.completions.create(model="agent-model", messages=messages, tools=tools)
    streamed = client.chat.completions.create(model="agent-model", messages=messages, tools=tools, stream=True)
    streamed_names = [tc.function.name for chunk in streamed for choice in chunk.choices
                      for tc in (choice.delta.tool_calls or []) if tc.function and tc.function.name]
    print(json.dumps({"tools": [t["function"]["name"] for t in tools],
                      "call": answer.choices[0].message.tool_calls[0].function.name,
                      "streamed": streamed_names}))
""")


def pod() -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = yaml.safe_load_all(AGENT_DEPLOYMENT.read_text())
    spec = deployment["spec"]["template"]["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "toolquake"]
    (agent,) = spec["containers"]
    return sidecar, agent


def probe(url: str, path: str) -> int:
    try:
        return httpx.get(url + path, timeout=3).status_code
    except httpx.HTTPError:
        return 0


def test_agent_pod_on_loopback_starts_only_when_the_upstream_answers(tmp_path: Path) -> None:
    sidecar, agent = pod()
    assert sidecar["restartPolicy"] == "Always"
    # the container's environment: the image's ENV, then the manifest's
    env = image_env()
    env.pop("PATH")
    env.update({e["name"]: e["value"] for e in sidecar["env"] if "value" in e})
    pod_port = int(env["TOOLQUAKE_PORT"])
    startup_path = sidecar["startupProbe"]["httpGet"]["path"]

    # the ConfigMap mounted where TOOLQUAKE_CONFIG points
    (cm,) = yaml.safe_load_all(CONFIGMAP.read_text())
    config = Path(env["TOOLQUAKE_CONFIG"])
    local_config = tmp_path / "etc" / config.name
    local_config.parent.mkdir()
    local_config.write_text(cm["data"][config.name])

    # the pod's ports and addresses moved to loopback: the sidecar on a port of its own choosing (port 0, said in its
    # `listening` log line); the upstream's port is named in the sidecar's environment before the upstream runs, so
    # it is held here until the upstream binds it (tests/support/ports.py)
    with held_port() as upstream_port:
        env.update(TOOLQUAKE_PORT="0", TOOLQUAKE_HOST="127.0.0.1", TOOLQUAKE_CONFIG=str(local_config),
                   TOOLQUAKE_UPSTREAM=f"http://127.0.0.1:{upstream_port}/v1", HOME=str(tmp_path),
                   XDG_CACHE_HOME=str(tmp_path / "xdg-cache"), TOOLQUAKE_CACHE=str(tmp_path / "cache-emptydir"))
        run_pod(sidecar, agent, env, pod_port, startup_path, local_config, upstream_port, tmp_path)


def run_pod(sidecar: dict[str, Any], agent: dict[str, Any], env: dict[str, str], pod_port: int, startup_path: str,
            local_config: Path, upstream_port: int, tmp_path: Path) -> None:
    agent_env = {e["name"]: e["value"] for e in agent["env"] if "value" in e}
    base_url = agent_env["OPENAI_BASE_URL"]
    m = re.fullmatch(rf"http://127\.0\.0\.1:{pod_port}/p/([^/]+)/v1", base_url)
    assert m, base_url
    profile = m.group(1)
    assert tomllib.loads(local_config.read_text())["profiles"][profile]["mode"] == "shadow", \
        "staging runs in shadow mode: the agent must get answers to its own requests"

    started: list[Proc] = []
    try:
        sidecar_proc = start_process(["-m", "toolquake", "serve"], None, "/healthz", env=env)
        started.append(sidecar_proc)
        url = sidecar_proc.url
        base_url = base_url.replace(f":{pod_port}/", f":{sidecar_proc.port}/")
        # the manifest turns warm-up on (TOOLQUAKE_WARM_UP): /readyz says warming_up until the profiles' perturbers
        # are set up (here, with an empty emptyDir cache and no corpus, their set-up fails fast and the sidecar goes
        # on: tests/server/test_readiness_warmup.py covers the warm-up itself); the startup probe holds the agent
        wait_for(lambda: httpx.get(url + startup_path).json().get("error", {}).get("code") != "warming_up", 90,
                 "the sidecar to finish warming up")
        # kubelet: the sidecar is alive but its upstream is not there, so the agent is held back (probed a few times,
        # as the kubelet does)
        for _ in range(5):
            assert probe(url, "/healthz") == 200
            assert probe(url, startup_path) == 503
        not_ready = httpx.get(url + startup_path).json()
        assert not_ready["error"]["type"] == "upstream_error"

        upstream = start_fake_upstream("--port", str(upstream_port))  # the last --port wins: the held one
        started.append(upstream)
        wait_for(lambda: probe(url, startup_path) == 200, 15, f"{startup_path} to answer 200")

        # kubelet: startupProbe passed, start the agent container with only its own environment
        script = tmp_path / "agent.py"
        script.write_text(AGENT)
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
                                  "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "sk-agent-secret"})
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)
        # the fake answers with the first tool it is offered: the agent's own first tool, unperturbed
        assert result["call"] == result["tools"][0]
        assert result["streamed"] == [result["tools"][0]]

        received = [r for r in httpx.get(f"{upstream.url}/_fake/requests").json()
                    if r["path"].endswith("/chat/completions")]
        originals = [r for r in received
                     if [t["function"]["name"] for t in json.loads(r["body"])["tools"]] == result["tools"]]
        assert len(originals) >= 2, "the upstream got the agent's requests as sent"
        assert {r["headers"].get("authorization") for r in originals} == {"Bearer sk-agent-secret"}
        assert scraped(url, "toolquake_requests_total", profile=profile, status_class="2xx") == 2

        # readiness follows the upstream: gone upstream, pod out of its Service
        upstream.stop()
        wait_for(lambda: probe(url, sidecar["readinessProbe"]["httpGet"]["path"]) == 503, 15,
                 "readiness to fail without the upstream")
        assert probe(url, sidecar["livenessProbe"]["httpGet"]["path"]) == 200
    finally:
        for proc in reversed(started):
            proc.stop()
