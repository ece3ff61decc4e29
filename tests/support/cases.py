"""User cases and recordings, shared by tests/cases/: the tools the case-format tests build cases with, the two
tools the recorded agent is offered, the `toolquake` command line run as its own process, and a recording read
back whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT

#: tools of the user cases (tests/cases/test_case_format.py and the cases built on them)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "number"}, "options": {"type": "object"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}

#: the tools of the agent whose exchanges `toolquake serve --record` records
RECORD_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone.", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


def toolquake(*args: str) -> subprocess.CompletedProcess:
    """`python -m toolquake ARGS` in its own process (the timeout is a bound on a hang)."""
    return subprocess.run([sys.executable, "-m", "toolquake", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def read_records(path: Path) -> list[dict]:
    """Every record of a recording, which must hold nothing unreadable and no torn line."""
    from toolquake.proxy.live.recording import read_recording

    rec = read_recording(path)
    assert rec.problems == [] and rec.torn == 0, (rec.problems, rec.torn)
    return rec.records
