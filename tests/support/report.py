"""`toolquake report` run in this process: the command line's own parser and `run` (proxy/cli/report.py), its
stdout and stderr captured, so that a test of the report's numbers and formats pays no Python start per call. The
command as a process (its exit code, files written, the merged shards) stays tested with subprocess in
tests/replay/test_replay.py and test_report.py."""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

#: the statistics a live results store and a replay of the same verdicts must agree on, per arm
SAME = ("n", "accuracy", "accuracy_ci", "errors", "errors_ci", "by_category", "drop_vs_off", "drop_vs_off_ci",
        "paired", "not_perturbed", "perturbed_share", "semantic_flips", "accuracy_cs", "drop_vs_off_cs",
        "anytime_pairs")


def report_run(*args: str | Path) -> subprocess.CompletedProcess:
    """`toolquake report ARGS` in this process, whatever its exit code, as a finished process would say it."""
    from toolquake.proxy.cli import main

    argv = ["report", *(str(a) for a in args)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["toolquake", *argv], code, out.getvalue(), err.getvalue())


def report(*args: str | Path) -> subprocess.CompletedProcess:
    """`toolquake report ARGS` in this process; it must succeed."""
    r = report_run(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def report_text(*args: str | Path) -> str:
    """What `toolquake report ARGS` prints (it must succeed)."""
    return report(*args).stdout
