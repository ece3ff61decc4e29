"""The layout as installed: one `toolquake` namespace, nothing at top level, and the import layers kept.

`pip install .` (no dependencies: they are the ones this environment already has) into a scratch
target lays the package out as a user gets it; the import-layer contracts of pyproject.toml are
checked there with import-linter's own `lint-imports`, and the installed CLI is run from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.processes

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    # setuptools builds in the checkout's build/lib and keeps what is there: a module deleted or moved since the
    # last build would otherwise still be installed (and checked) here
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def _run(installed: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_the_wheel_installs_one_namespace_and_nothing_at_top_level(installed: Path) -> None:
    top = sorted(p.name for p in installed.iterdir() if p.name not in ("bin", "__pycache__")
                 and not p.name.endswith(".dist-info"))
    assert top == ["toolquake"]
    assert {p.name for p in (installed / "toolquake").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "proxy", "perturbers", "scorers", "remedies", "bfcl"}


def test_old_top_level_names_do_not_import_and_the_cli_runs_from_the_install(installed: Path, tmp_path: Path) -> None:
    for name in ("proxy", "perturbers", "scorers", "remedies"):
        r = _run(installed, "-c", f"import {name}", cwd=tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (name, r.stderr)
    r = _run(installed, "-c", "import toolquake, toolquake.proxy.cli as c; print(toolquake.__file__, c.__file__)",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(path.startswith(str(installed)) for path in r.stdout.split()), r.stdout
    helped = _run(installed, "-m", "toolquake", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "serve" in helped.stdout and "replay" in helped.stdout


def test_packaged_profiles_load_from_the_install(installed: Path, tmp_path: Path) -> None:
    code = ("from toolquake.proxy.server.config import PACKAGED_CONFIG, load_config; c = load_config(None, env={}); "
            "print(PACKAGED_CONFIG); print(len(c.profiles)); print(' '.join(sorted(c.profiles)))")
    r = _run(installed, "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path, count, names = r.stdout.splitlines()
    assert path.startswith(str(installed)) and Path(path).is_file()
    shipped = tomllib.loads((ROOT / "proxy" / "profiles.toml").read_text())["profiles"]
    assert int(count) == len(shipped) and names.split() == sorted(shipped)


def test_import_layer_contracts_hold(installed: Path, tmp_path: Path) -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is a dev dependency: pip install -e '.[dev]'"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    r = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "broken" in r.stdout and " 0 broken" in r.stdout


def test_every_package_folder_is_listed_for_setuptools() -> None:
    """A sub-package missing from [tool.setuptools] packages works in the editable install and vanishes
    from the wheel: every folder with an __init__.py under a mapped folder must be listed."""
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert found == listed


def test_the_case_schema_ships_with_the_install(installed: Path, tmp_path: Path) -> None:
    r = _run(installed, "-c", "from toolquake.proxy.live.usercases import SCHEMA_PATH, schema; "
             "print(SCHEMA_PATH); print(schema()['title'])", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path, title = r.stdout.splitlines()
    assert path.startswith(str(installed)) and "user case" in title


def test_the_server_imports_nothing_of_the_tracing_wing(installed: Path, tmp_path: Path) -> None:
    """The tracing wing is a package of its own above the server (`toolquake.proxy.tracing`): no chain of imports,
    lazy ones included, leads from any module of `toolquake.proxy.server` to it, and no span machinery is left
    in the server; pyproject.toml holds the contract that `lint-imports` keeps (test_import_layer_contracts_hold)."""
    code = ("import json, grimp; g = grimp.build_graph('toolquake', cache_dir=None); "
            "print(json.dumps({'wing': sorted(m for m in g.modules if m.startswith('toolquake.proxy.tracing')), "
            "'server': sorted(m for m in g.modules if m.startswith('toolquake.proxy.server.')), "
            "'chains': sorted(map(list, g.find_shortest_chains('toolquake.proxy.server', 'toolquake.proxy.tracing')))"
            " if 'toolquake.proxy.tracing' in g.modules else None}))")
    r = _run(installed, "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    graph = json.loads(r.stdout)
    assert {"toolquake.proxy.tracing.tracer", "toolquake.proxy.tracing.spans", "toolquake.proxy.tracing.otlp"} \
        <= set(graph["wing"])
    assert graph["chains"] == []
    assert not {"toolquake.proxy.server.tracing", "toolquake.proxy.server.spans", "toolquake.proxy.server.otlp"} \
        & set(graph["server"])
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    assert any(c["type"] == "forbidden" and c["source_modules"] == ["toolquake.proxy.server"]
               and c["forbidden_modules"] == ["toolquake.proxy.tracing"] for c in contracts)
