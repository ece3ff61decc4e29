"""Reading the deployment files as the tools that use them do: deploy/Dockerfile's stages, instructions and the
runtime image's ENV (as `docker build` reads them), and k8s/'s kustomizations built (`kustomize build`, for the
subset of kustomize the manifests use)."""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.processes import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "k8s"
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


# ---------------------------------------------------------------------------------------------
# the Dockerfile


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [rest for o, rest in self.instructions if o == op]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs; continuation lines joined the way the Dockerfile parser joins them."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not buf and not stripped):
            continue
        line = raw.rstrip()
        if line.endswith("\\"):
            buf += line[:-1]
            continue
        buf += line
        op, _, rest = buf.strip().partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    return out


def parse_assignments(rest: str) -> dict[str, str]:
    return dict(item.split("=", 1) if "=" in item else (item, "") for item in shlex.split(rest))


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def stages() -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for op, rest in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append(Stage(expand(parts[0], global_args), name))
        elif not result:
            assert op == "ARG", f"only ARG may come before the first FROM, got {op}"
            global_args.update(parse_assignments(rest))
        else:
            result[-1].instructions.append((op, rest))
    return global_args, result


def image_env() -> dict[str, str]:
    """The runtime stage's ENV, as written (not expanded)."""
    env: dict[str, str] = {}
    for rest in stages()[1][-1].all("ENV"):
        env.update(parse_assignments(rest))
    return env


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def warmed_up(url: str, path: str = "/readyz") -> bool:
    """For wait_for: True once GET url+path answers 200, False while it answers 503 `warming_up` (the image and the
    manifests turn TOOLQUAKE_WARM_UP on); any other answer fails."""
    r = httpx.get(f"{url}{path}", timeout=10)
    if r.status_code == 200:
        return True
    assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up", r.text
    return False


# ---------------------------------------------------------------------------------------------
# kustomizations


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Strategic-merge `patch` into `base` for the cases used here: maps merge, lists of maps with a
    `name` merge by name (patched items first, as kustomize orders them), other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    named = lambda xs: isinstance(xs, list) and xs and all(isinstance(x, dict) and "name" in x for x in xs)  # noqa: E731
    if named(base) and named(patch):
        by_name = {x["name"]: x for x in base}
        merged = [strategic_merge(by_name[p["name"]], p) if p["name"] in by_name else copy.deepcopy(p)
                  for p in patch]
        patched = {p["name"] for p in patch}
        return merged + [copy.deepcopy(x) for x in base if x["name"] not in patched]
    return copy.deepcopy(patch)


def build(directory: Path) -> list[dict[str, Any]]:
    """What `kustomize build directory` gives for our subset; anything outside it is an error."""
    kz = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kz) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomization keys this test cannot check: {unknown}"
    assert kz["kind"] == "Kustomization"
    objects: list[dict[str, Any]] = []
    for entry in kz.get("resources", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml: resource {entry} does not exist"
        if target.is_dir():
            objects += build(target)
        else:
            assert target.is_relative_to(directory.resolve()), \
                f"{directory}: file resource {entry} lies outside the kustomization (kustomize refuses it)"
            objects += load_docs(target)
    keys = [key(o) for o in objects]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate resources {keys}"
    for entry in kz.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only file patches are used here, got {entry}"
        path = directory / entry["path"]
        assert path.is_file(), f"{directory}: patch {entry['path']} does not exist"
        (patch,) = load_docs(path)
        matches = [i for i, o in enumerate(objects) if key(o) == key(patch)
                   and o["apiVersion"] == patch["apiVersion"]]
        assert len(matches) == 1, f"{directory}: patch {entry['path']} matches {len(matches)} resources"
        objects[matches[0]] = strategic_merge(objects[matches[0]], patch)
    return objects
