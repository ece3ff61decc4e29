"""The Kubernetes manifests under k8s/: valid for Kubernetes 1.30 (kubernetes-validate, strict), the
PodMonitor valid against its CRD schema, the kustomize overlays buildable, and the pieces wired to
each other and to the real CLI (ports, probes, profiles, shard arithmetic).

The overlays are built here by a small reader of the kustomization subset this repo uses
(`resources` and strategic-merge `patches`); where `kubectl kustomize` or `kustomize` is installed
its output is compared with ours.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support import Proc
from tests.support.deploy import K8S, build, image_env, key, load_docs

ROOT = Path(__file__).resolve().parents[2]
KUBE_VERSION = "1.30.0"
PODMONITOR_SCHEMA = K8S / "schemas" / "podmonitor-monitoring.coreos.com-v1.json"
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = [K8S / "base", *sorted((K8S / "overlays").iterdir())]


# ---------------------------------------------------------------------------------------------
# reading manifests and building kustomizations


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None


def objects_by_key(directory: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {key(o): o for o in build(directory)}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def profiles_toml() -> str:
    (cm,) = load_docs(K8S / "base" / "profiles" / "configmap.yaml")
    return cm["data"]["profiles.toml"]


def strict_schema(schema: Any) -> Any:
    """A CRD schema as the API server's field validation applies it: objects that list their
    properties (and allow no extra map keys) reject unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(x) for x in schema]
    return schema


def podmonitor_validator() -> jsonschema.Validator:
    schema = strict_schema(json.loads(PODMONITOR_SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid resource: core kinds by kubernetes-validate (strict, 1.30),
    the PodMonitor by its CRD schema."""
    if obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PodMonitor":
        errors = sorted(podmonitor_validator().iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            raise jsonschema.ValidationError("; ".join(f"{list(e.path)}: {e.message}" for e in errors))
        return
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------
# validity


def patch_files() -> set[Path]:
    return {(d / entry["path"]).resolve() for d in KUSTOMIZATIONS
            for entry in yaml.safe_load((d / "kustomization.yaml").read_text()).get("patches", [])}


@pytest.mark.parametrize("path", [p for p in manifest_files() if p.resolve() not in patch_files()],
                         ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid_for_kubernetes_1_30(path: Path) -> None:
    """Patches are partial resources: they are validated applied, in the overlay builds below."""
    docs = load_docs(path)
    assert docs, f"{path} holds no resource"
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: str(p.relative_to(K8S)))
def test_each_overlay_builds_into_valid_resources(directory: Path) -> None:
    objects = build(directory)
    assert objects
    for obj in objects:
        validate(obj)


def test_the_validators_reject_broken_manifests() -> None:
    """The checks above can fail: a misspelt field and a wrong type are caught."""
    (deployment,) = load_docs(K8S / "base" / "deployment.yaml")
    broken = copy.deepcopy(deployment)
    pod_spec(broken)["containers"][0]["readinesProbe"] = pod_spec(broken)["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    (monitor,) = [d for d in load_docs(K8S / "overlays" / "sidecar" / "podmonitor.yaml")]
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["podMetricEndpoints"] = misspelt["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        validate(misspelt)
    bad_interval = copy.deepcopy(monitor)
    bad_interval["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad_interval)


def test_every_kustomization_lists_only_existing_files() -> None:
    listed: set[Path] = set()
    for directory in KUSTOMIZATIONS:
        kz = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for entry in kz.get("resources", []) + [p["path"] for p in kz.get("patches", [])]:
            target = (directory / entry).resolve()
            assert target.exists(), f"{directory}: {entry} does not exist"
            listed.add(target)
    orphans = [p for p in manifest_files() if p.resolve() not in listed]
    assert not orphans, f"manifests no kustomization uses: {orphans}"


@pytest.mark.processes
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomize_builds_the_same_resources(directory: Path) -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; the overlays were built by this "
                    "file's own reader in test_each_overlay_builds_into_valid_resources")
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=key)
    ours = sorted(build(directory), key=key)
    assert theirs == ours


# ---------------------------------------------------------------------------------------------
# wiring


def test_the_configmap_profiles_load_with_the_proxy_config_loader(tmp_path: Path) -> None:
    from toolquake.proxy.server.config import load_config

    cfg = tmp_path / "profiles.toml"
    cfg.write_text(profiles_toml())
    config = load_config(cfg, env={})
    assert {"shuffled", "reversed", "staging"} <= set(config.profiles)
    assert config.profiles["staging"].mode == "shadow"


def _probe_port(probe: dict[str, Any], container: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _config_mount(spec: dict[str, Any], container: dict[str, Any]) -> None:
    """TOOLQUAKE_CONFIG names the profiles file of a mounted toolquake-profiles ConfigMap."""
    config_path = Path(env_of(container)["TOOLQUAKE_CONFIG"])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "toolquake-profiles"
    (cm,) = load_docs(K8S / "base" / "profiles" / "configmap.yaml")
    assert config_path.name in cm["data"]


def image_cache_dir() -> str:
    """TOOLQUAKE_CACHE as deploy/Dockerfile sets it: where a baked corpus lives in the image."""
    return image_env()["TOOLQUAKE_CACHE"]


def _hardened(spec: dict[str, Any], container: dict[str, Any]) -> None:
    """Non-root, read-only root filesystem, no privileges, resources; writable emptyDirs for /tmp
    and the cache, the cache seeded from the image by an init container that runs before it."""
    pod_sc = spec.get("securityContext", {})
    inits = spec.get("initContainers", [])
    image_containers = [c for c in inits + spec["containers"] if c["image"].startswith("toolquake:")]
    assert container in image_containers
    for c in image_containers:
        sc = c["securityContext"]
        assert pod_sc.get("runAsNonRoot") or sc.get("runAsNonRoot"), c["name"]
        assert (sc.get("runAsUser") or pod_sc.get("runAsUser") or 0) != 0, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if "emptyDir" in volumes[m["name"]]}
    cache = env_of(container)["TOOLQUAKE_CACHE"]
    assert cache == image_cache_dir()
    assert "/tmp" in writable and cache in writable, (
        "a read-only root filesystem needs emptyDirs for /tmp and the cache")
    (seeder,) = [
        c for c in inits if any(m["name"] == writable[cache] for m in c["volumeMounts"]) and c is not container
    ]
    assert "restartPolicy" not in seeder, "the seeding init container must run to completion first"
    if container in inits:
        assert inits.index(seeder) < inits.index(container)
    (src, dst) = re.findall(r"copytree\('([^']+)', '([^']+)'", " ".join(seeder["command"]))[0]
    assert src == cache, "the seed comes from the image's own cache directory"
    assert {m["mountPath"]: m["name"] for m in seeder["volumeMounts"]}[dst] == writable[cache]
    assert not any(m["mountPath"] == cache for m in seeder["volumeMounts"]), "the image's cache must stay visible"


def test_sidecar_is_a_native_sidecar_that_the_agent_reaches_on_loopback() -> None:
    objects = objects_by_key(K8S / "overlays" / "sidecar")
    agent = objects["Deployment", "agent"]
    spec = pod_spec(agent)
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "toolquake"]
    assert sidecar["restartPolicy"] == "Always"
    env = env_of(sidecar)
    port = int(env["TOOLQUAKE_PORT"])
    assert [p["containerPort"] for p in sidecar["ports"]] == [port]
    for probe in ("startupProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["path"] == "/readyz"
        assert _probe_port(sidecar[probe], sidecar) == port
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    _config_mount(spec, sidecar)
    _hardened(spec, sidecar)

    (app,) = spec["containers"]
    base_url = env_of(app)["OPENAI_BASE_URL"]
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/p/([^/]+)/v1", base_url)
    assert m, base_url
    assert int(m.group(1)) == port
    assert m.group(2) in tomllib.loads(profiles_toml())["profiles"]
    assert ("ConfigMap", "toolquake-profiles") in objects


def test_worker_processes_are_set_for_the_sidecar_and_the_shared_proxy() -> None:
    """`toolquake serve` defaults to one worker per CPU, which in a pod without a CPU limit is the node's
    count: the sidecar runs one (its cost is paid on every pod), the shared proxy a fixed number."""
    from toolquake.proxy.server.config import load_config

    sidecar_spec = pod_spec(objects_by_key(K8S / "overlays" / "sidecar")["Deployment", "agent"])
    (sidecar,) = [c for c in sidecar_spec["initContainers"] if c["name"] == "toolquake"]
    (shared,) = pod_spec(objects_by_key(K8S / "base")["Deployment", "toolquake"])["containers"]
    for container, expected in ((sidecar, 1), (shared, None)):
        env = env_of(container)
        assert "TOOLQUAKE_WORKERS" in env, container["name"]
        workers = load_config(None, env={"TOOLQUAKE_WORKERS": env["TOOLQUAKE_WORKERS"]}).server.workers
        assert workers >= 1
        if expected is not None:
            assert workers == expected


def test_podmonitor_scrapes_the_sidecar_metrics_port() -> None:
    objects = objects_by_key(K8S / "overlays" / "sidecar")
    monitor = objects["PodMonitor", "toolquake"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [
        o
        for o in objects.values()
        if o["kind"] == "Deployment" and selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert scraped, "the PodMonitor selects no pod of the overlay"
    for deployment in scraped:
        spec = pod_spec(deployment)
        ports = [
            p
            for c in spec.get("initContainers", []) + spec["containers"]
            if c["name"] == "toolquake"
            for p in c["ports"]
        ]
        assert endpoint["port"] in {p["name"] for p in ports}
    # the shared proxy carries the same label and port name, so the same PodMonitor covers it
    proxy = objects_by_key(K8S / "base")["Deployment", "toolquake"]
    assert selector.items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in pod_spec(proxy)["containers"][0]["ports"]}


def test_shared_proxy_deployment_and_service_fit_together() -> None:
    objects = objects_by_key(K8S / "base")
    deployment, service = objects["Deployment", "toolquake"], objects["Service", "toolquake"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = pod_spec(deployment)
    (container,) = spec["containers"]
    env = env_of(container)
    assert env["TOOLQUAKE_HOST"] == "0.0.0.0"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_names[service["spec"]["ports"][0]["targetPort"]] == int(env["TOOLQUAKE_PORT"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    _config_mount(spec, container)
    _hardened(spec, container)


def test_vllm_overlay_serves_tool_calls_and_the_proxy_counts_with_its_tokenizer() -> None:
    objects = objects_by_key(K8S / "overlays" / "vllm")
    vllm = objects["Deployment", "vllm"]
    (container,) = pod_spec(vllm)["containers"]
    args = container["args"]
    assert "--enable-auto-tool-choice" in args
    assert any(a.startswith("--tool-call-parser=") for a in args)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    model = next(a.split("=", 1)[1] for a in args if a.startswith("--model="))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (models_mount,) = [p for p in mounts if model.startswith(p + "/")]
    (volume,) = [v for v in pod_spec(vllm)["volumes"] if v["name"] == mounts[models_mount]]
    assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in objects
    service = objects["Service", "vllm"]
    port = service["spec"]["ports"][0]["port"]
    proxy_env = env_of(pod_spec(objects["Deployment", "toolquake"])["containers"][0])
    assert proxy_env["TOOLQUAKE_UPSTREAM"] == f"http://vllm:{port}/v1"
    assert proxy_env["TOOLQUAKE_TOKEN_COUNTER"] == "upstream"
    # the patch changed one variable and kept the others
    base_env = env_of(pod_spec(objects_by_key(K8S / "base")["Deployment", "toolquake"])["containers"][0])
    assert {k: v for k, v in proxy_env.items() if k != "TOOLQUAKE_TOKEN_COUNTER"} == {
        k: v for k, v in base_env.items() if k != "TOOLQUAKE_TOKEN_COUNTER"
    }


def _cli_parser():
    from toolquake.proxy.cli import build_parser

    return build_parser()


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def _needs_command(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this checkout, so its flags cannot be checked")


def test_replay_is_an_indexed_job_whose_shards_cover_the_corpus_once() -> None:
    objects = objects_by_key(K8S / "overlays" / "replay")
    job = objects["Job", "toolquake-replay"]
    n, m = job["spec"]["completions"], job["spec"]["parallelism"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert 1 <= m <= n
    spec = pod_spec(job)
    (container,) = spec["containers"]
    assert container["command"] == ["toolquake", "replay"]
    args = container["args"]
    assert args[args.index("--shard") + 1] == f"$(JOB_COMPLETION_INDEX)/{n}"
    declared = {e["name"]: e for e in container["env"]}
    assert (
        declared["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    outs = {_expand(args, {"JOB_COMPLETION_INDEX": str(i)})[args.index("--out") + 1] for i in range(n)}
    assert len(outs) == n, "every shard needs its own output directory"
    mounts = {mnt["mountPath"]: mnt["name"] for mnt in container["volumeMounts"]}
    (results_mount,) = [p for p in mounts if all(o.startswith(p + "/") for o in outs)]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[results_mount]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects
    _config_mount(spec, container)
    _hardened(spec, container)

    # the merge Job reads exactly the directories the shards wrote, from the same claim
    merge = objects_by_key(K8S / "overlays" / "replay-merge")["Job", "toolquake-report"]
    (merger,) = pod_spec(merge)["containers"]
    assert merger["command"] == ["toolquake", "report"]
    dirs = list(itertools.takewhile(lambda a: not a.startswith("--"), merger["args"]))
    assert set(dirs) == outs and len(dirs) == n
    report = merger["args"][merger["args"].index("--out") + 1]
    assert report.startswith(results_mount + "/") and not any(report.startswith(o + "/") for o in outs)
    (merge_volume,) = [v for v in pod_spec(merge)["volumes"] if "persistentVolumeClaim" in v]
    assert merge_volume["persistentVolumeClaim"]["claimName"] == claim

    # every profile the replay names exists in the ConfigMap it mounts
    profiles = args[args.index("--profiles") + 1].split(",")
    assert set(profiles) - {"off"} <= set(tomllib.loads(profiles_toml())["profiles"])


def _replay_job() -> tuple[dict[str, Any], dict[str, Any]]:
    job = objects_by_key(K8S / "overlays" / "replay")["Job", "toolquake-replay"]
    return job, pod_spec(job)["containers"][0]


def _replay_argv(container: dict[str, Any], index: int) -> list[str]:
    return _expand(container["command"][1:] + container["args"], {"JOB_COMPLETION_INDEX": str(index)})


def test_replay_command_line_parses_with_the_real_cli() -> None:
    """Each pod's `toolquake replay` line is accepted by the CLI, names its own shard, and asks for
    profiles the mounted ConfigMap defines."""
    _needs_command("toolquake.proxy.cli.replay")
    from toolquake.proxy.replay.selection import expand_profiles, parse_shard

    job, container = _replay_job()
    n = job["spec"]["completions"]
    parser = _cli_parser()
    known = ["off", *tomllib.loads(profiles_toml())["profiles"]]
    for index in range(n):
        parsed = parser.parse_args(_replay_argv(container, index))
        assert callable(parsed.func)
        assert parse_shard(parsed.shard, env={}) == (index, n)
        assert expand_profiles(parsed.profiles, known) == parsed.profiles.split(",")


@pytest.mark.needs_corpus
def test_replay_shards_cover_the_selected_cases_exactly_once() -> None:
    _needs_command("toolquake.proxy.cli.replay")
    from toolquake.proxy.replay.selection import parse_shard, select_cases

    job, container = _replay_job()
    parser = _cli_parser()
    n = job["spec"]["completions"]
    shards = []
    for index in range(n):
        parsed = parser.parse_args(_replay_argv(container, index))
        categories = parsed.categories.split(",")
        shards.append([c.id for c in select_cases(categories, parsed.limit, parse_shard(parsed.shard, env={}))])
    everything = [c.id for c in select_cases(categories, parsed.limit, None)]
    assert all(shards), "a shard with no case"
    assert sorted(i for shard in shards for i in shard) == sorted(everything)
    assert len(set(everything)) == len(everything)


@pytest.mark.slow
@pytest.mark.needs_corpus
def test_replay_and_merge_jobs_run_against_a_backend_on_loopback(tmp_path: Path, fake_upstream: Proc) -> None:
    """The Jobs' own command lines, run: every pod of the Indexed Job (`parallelism` at a time) with
    the ConfigMap's profiles and a cache seeded as the init container seeds it, the results claim
    played by a directory; then the merge Job's command over what they wrote. Only --backend points
    at the fake upstream, and --limit keeps the run short."""
    from toolquake.bfcl.corpus import CORPUS_VERSION, cache_root
    from toolquake.proxy.replay.selection import select_cases

    job, container = _replay_job()
    n, m = job["spec"]["completions"], job["spec"]["parallelism"]
    results_mount = next(v["mountPath"] for v in container["volumeMounts"] if v["name"] == "results")
    claim = tmp_path / "claim"
    cache = tmp_path / "cache"
    shutil.copytree(cache_root() / "bfcl" / CORPUS_VERSION, cache / "bfcl" / CORPUS_VERSION)
    config = tmp_path / "etc" / Path(env_of(container)["TOOLQUAKE_CONFIG"]).name
    config.parent.mkdir()
    config.write_text(profiles_toml())
    env = {
        **os.environ,
        "TOOLQUAKE_CONFIG": str(config),
        "TOOLQUAKE_CACHE": str(cache),
        "HOME": str(tmp_path),
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
    }
    limit = 4

    def local(argv: list[str]) -> list[str]:
        return [a.replace(results_mount + "/", f"{claim}/") for a in argv]

    def pod_argv(index: int) -> list[str]:
        argv = local(_replay_argv(container, index))
        argv[argv.index("--backend") + 1] = f"{fake_upstream.url}/v1"
        return [sys.executable, "-m", "toolquake", *argv, "--limit", str(limit)]

    for wave in range(0, n, m):
        pods = [
            subprocess.Popen(
                pod_argv(i), env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for i in range(wave, min(wave + m, n))
        ]
        for pod in pods:
            out, err = pod.communicate(timeout=300)
            assert pod.returncode == 0, err[-2000:]

    merge = pod_spec(objects_by_key(K8S / "overlays" / "replay-merge")["Job", "toolquake-report"])["containers"][0]
    merged = subprocess.run(
        [sys.executable, "-m", "toolquake", *local(merge["command"][1:] + merge["args"])],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stderr[-2000:]
    report = Path(local([merge["args"][merge["args"].index("--out") + 1]])[0])
    assert report.is_file() and "<html" in report.read_text().lower()

    # merged, every selected case counts once per arm
    dirs = list(itertools.takewhile(lambda a: not a.startswith("--"), local(merge["args"])))
    tables = subprocess.run(
        [sys.executable, "-m", "toolquake", "report", *dirs, "--format", "json", "--no-plots"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tables.returncode == 0, tables.stderr[-2000:]
    arms = json.loads(tables.stdout)["arms"]
    args = container["args"]
    selected = select_cases(args[args.index("--categories") + 1].split(","), limit, None)
    assert sorted(arms) == sorted(args[args.index("--profiles") + 1].split(","))
    assert {arm["n"] for arm in arms.values()} == {len(selected)}


def test_merge_command_line_parses_with_the_real_cli() -> None:
    _needs_command("toolquake.proxy.cli.report")
    merge = pod_spec(objects_by_key(K8S / "overlays" / "replay-merge")["Job", "toolquake-report"])["containers"][0]
    parsed = _cli_parser().parse_args(merge["command"][1:] + merge["args"])
    assert callable(parsed.func)
