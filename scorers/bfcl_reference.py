"""BFCL's own checker and python decoder, loaded from the cached wheel, for parity tests and benchmarks.

Not used for scoring. `bfcl-eval` is installed `--no-deps` into a directory of the caller's choosing;
the modules its checker imports but does not need (the model registry with every vendor SDK; tenacity
and tree-sitter for the decoder module) are replaced by small stubs in `sys.modules`.
Calls are translated to BFCL's shape (`[{name: {param: value}}]`) and verdicts back to (valid, error_type).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

# a model name the stub registry knows: BFCL turns '_' into '/' before the lookup
PLAIN_MODEL = "toolquake_plain"       # underscore_to_dot = False
DOTTED_FC_MODEL = "toolquake_fc"      # underscore_to_dot = True


class _Config:
    def __init__(self, underscore_to_dot: bool):
        self.underscore_to_dot = underscore_to_dot


def install(target: Path) -> Path:
    """Install the cached bfcl-eval wheel `--no-deps` into `target` (once)."""
    from toolquake.bfcl.corpus import CorpusError, pull, wheel_path

    if (target / "bfcl_eval" / "eval_checker" / "ast_eval" / "ast_checker.py").is_file():
        return target
    wheel = wheel_path()
    if wheel is None:
        pull()
        wheel = wheel_path()
    if wheel is None:
        raise CorpusError("no bfcl-eval wheel in the cache: run `toolquake corpus pull`")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise CorpusError(f"pip could not install {wheel} into {target}: {proc.stderr[-500:]}")
    return target


def _stub(name: str, **attrs: Any) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _install_stubs() -> None:
    _stub("bfcl_eval.constants.model_config",
          MODEL_CONFIG_MAPPING={"toolquake/plain": _Config(False), "toolquake/fc": _Config(True)})

    class _Anything:
        def __init__(self, *args: Any, **kwargs: Any):
            pass

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
        return lambda fn: fn

    try:  # the real one when installed (an agent framework may need it later in the same process)
        import tenacity  # noqa: F401
    except ImportError:
        _stub("tenacity", retry=_identity_decorator, retry_if_exception_message=_Anything,
              retry_if_exception_type=_Anything, wait_random_exponential=_Anything)
    _stub("tree_sitter", Language=_Anything, Parser=_Anything)
    try:
        import filelock  # noqa: F401 — present with most installs; only a lock class is needed
    except ImportError:
        _stub("filelock", FileLock=_Anything)
    _stub("tree_sitter_java", language=lambda: None)
    _stub("tree_sitter_javascript", language=lambda: None)


class Reference:
    """The official `ast_checker` (and python decoder) behind our call shapes."""

    def __init__(self, target: Path):
        install(target)
        if str(target) not in sys.path:
            sys.path.insert(0, str(target))
        _install_stubs()
        # BFCL creates result/score/lock folders under its project root at import: keep them in `target`
        os.environ["BFCL_PROJECT_ROOT"] = str(target)
        from bfcl_eval.constants.enums import Language, ReturnFormat
        from bfcl_eval.eval_checker.ast_eval import ast_checker

        self._checker = ast_checker
        self._languages = {"python": Language.PYTHON, "java": Language.JAVA, "javascript": Language.JAVASCRIPT}
        self._python_format = ReturnFormat.PYTHON
        self._decoder = None

    @staticmethod
    def bfcl_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{c["name"]: c["arguments"]} for c in calls]

    def check(self, functions: list[dict[str, Any]], ground_truth: Any, category: str, calls: list[dict[str, Any]],
              language: str = "python", underscore_to_dot: bool = False, dispatch: str | None = None
              ) -> tuple[bool, str | None]:
        """(valid, error_type) from BFCL's checker; ("crash", exception name) when it raises."""
        model = DOTTED_FC_MODEL if underscore_to_dot else PLAIN_MODEL
        try:
            result = self._checker.ast_checker(functions, self.bfcl_calls(calls), ground_truth,
                                               self._languages[language], dispatch or category, model)
        except Exception as exc:  # noqa: BLE001 — reported, compared with ours
            return False, f"crash:{type(exc).__name__}"
        return bool(result["valid"]), None if result["valid"] else result["error_type"]

    def raw_check(self, functions: list[dict[str, Any]], ground_truth: Any, category: str,
                  bfcl_calls: list[dict[str, Any]], language: str = "python") -> dict[str, Any]:
        """The checker called exactly as BFCL's runner does (for benchmarks)."""
        return self._checker.ast_checker(functions, bfcl_calls, ground_truth, self._languages[language],
                                         category, PLAIN_MODEL)

    def decode_python(self, text: str, tool_call_tag: bool = False) -> list[dict[str, Any]] | None:
        """BFCL's prompting decoder (it evaluates BinOps with eval: feed it trusted text only); None on failure."""
        if self._decoder is None:
            from bfcl_eval.model_handler.utils import default_decode_ast_prompting

            self._decoder = default_decode_ast_prompting
        try:
            decoded = self._decoder(text, self._python_format, tool_call_tag)
        except Exception:  # noqa: BLE001
            return None
        return [{"name": next(iter(d)), "arguments": next(iter(d.values()))} for d in decoded]
