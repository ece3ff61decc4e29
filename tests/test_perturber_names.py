"""Nothing outside `perturbers/` asks for a perturber by name (docs/architecture.md): what the rest of the code
relies on is declared on `Perturber` (perturbers/base.py). The Python sources of every other package, of
scripts/ and of examples/ are read (not imported) and none may hold a registered perturber's name as a string:
no `step["name"] == "paraphrase"`, no `in ("tool_order", ...)`, no dict keyed by a name.

Data is not code: profiles.toml, the docs and the tests name perturbers freely, and so may help texts and
messages that mention one in a sentence (only a string that *is* a name is looked for). Importing a function or
a class from a perturber's module is reuse, not a look-up by name, and is not looked for.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT
from toolquake.perturbers import registry

#: the folders whose Python sources may not name a perturber
CODE = ("proxy", "remedies", "scorers", "bfcl", "toolquake", "scripts", "examples")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def names_in(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """Where the file holds a perturber's name as a whole string (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root).as_posix()
    docs = _docstrings(tree)
    return sorted(f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                  and node.value in names)


def test_no_code_outside_perturbers_names_a_perturber(tmp_path: Path) -> None:
    names = set(registry())
    assert {"tool_order", "paraphrase"} <= names  # the registry was read
    # the scan itself: a comparison with a name and a name in a tuple are found; a sentence that mentions a
    # perturber, and a docstring, are not
    probe = tmp_path / "names_probe.py"
    probe.write_text('"""tool_order"""\n'
                     'def f(step):\n    """paraphrase"""\n    msg = "arms with `tool_order` steps"\n'
                     '    return step["name"] == "tool_order" or step["name"] in ("x", "paraphrase")\n')
    assert names_in(probe, names, root=tmp_path) == ["names_probe.py:5: 'paraphrase'", "names_probe.py:5: 'tool_order'"]
    sources = [p for folder in CODE for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(sources) > 100
    found = [hit for path in sources for hit in names_in(path, names)]
    assert found == [], "declare what the code needs on Perturber (perturbers/base.py) instead:\n" + "\n".join(found)
