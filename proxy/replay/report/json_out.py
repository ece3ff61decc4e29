"""The JSON report's text."""

from __future__ import annotations

import json
from typing import Any


def json_text(summary: dict[str, Any]) -> str:
    """The JSON report: the values as stored (a reader escapes for its own display); UTF-8 text, except that a
    lone surrogate (a `\\ud800` in a stored answer) makes the whole file ASCII with `\\u` escapes."""
    text = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(summary, indent=2) + "\n"
    return text
