"""Nothing outside `perturbers/` asks for a perturber by name (docs/architecture.md): what the rest of the code
relies on is declared on `Perturber` (perturbers/base.py). The Python sources of every other package, of
scripts/ and of examples/ are read (not imported) and none may hold a registered perturber's name as a string,
nor import a perturber's own module.

Data is not code: profiles.toml, the docs and the tests name perturbers freely, and so may help texts and
messages that mention one in a sentence (only a string that *is* a name is looked for).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT
from toolquake.perturbers import registry

#: the folders whose Python sources may not name a perturber
CODE = ("proxy", "remedies", "scorers", "bfcl", "toolquake", "scripts", "examples")
#: (file, imported module) pairs allowed, each with its reason
ALLOWED_IMPORTS = {
    # `toolquake formats` renders BFCL V4's 26 format configurations as format_rewrite sends them: the command is
    # a view of that one perturber's prompts, not a use of a perturber picked by name
    ("proxy/cli/formats.py", "toolquake.perturbers.format_rewrite"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in(path: Path, names: set[str], modules: set[str], root: Path = ROOT) -> list[str]:
    """Where the file holds a perturber's name as a whole string, or imports a perturber's module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root).as_posix()
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in names:
                out.append(f"{rel}:{node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            out += [f"{rel}:{node.lineno}: import {m}" for m in imported
                    if m in modules and (rel, m) not in ALLOWED_IMPORTS]
    return sorted(out)


def test_no_code_outside_perturbers_names_a_perturber(tmp_path: Path) -> None:
    known = registry()
    names = set(known)
    modules = {cls.__module__ for cls in known.values()}
    assert "tool_order" in names and "toolquake.perturbers.tool_order" in modules  # the registry was read
    # the scan itself: a comparison with a name, a name in a tuple and imports are found; a sentence that mentions
    # a perturber, and a docstring, are not
    probe = tmp_path / "names_probe.py"
    probe.write_text('"""tool_order"""\nimport toolquake.perturbers.tool_order\n'
                     'from toolquake.perturbers import paraphrase\n'
                     'def f(step):\n    """paraphrase"""\n    msg = "arms with `tool_order` steps"\n'
                     '    return step["name"] == "tool_order" or step["name"] in ("x", "paraphrase")\n')
    assert names_in(probe, names, modules, root=tmp_path) == [
        "names_probe.py:2: import toolquake.perturbers.tool_order",
        "names_probe.py:3: import toolquake.perturbers.paraphrase",
        "names_probe.py:7: 'paraphrase'", "names_probe.py:7: 'tool_order'"]
    sources = [p for folder in CODE for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(sources) > 100
    found = [hit for path in sources for hit in names_in(path, names, modules)]
    assert found == [], "declare what the code needs on Perturber (perturbers/base.py) instead:\n" + "\n".join(found)
